"""The vLLM plugin's entry point and checkpoint check, in this process and without vLLM.

``register`` decides from the version ``importlib.metadata`` reports whether to patch, and
arranges the patch through an import hook; the hook is exercised on a stand-in module file
under the Engram module's name. The weight loader's check reads a real table.
(``test_vllm_engine.py`` runs the same code inside vLLM 0.33.0.)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import sys
import types

import numpy as np
import pytest
import torch

import engram_offload.integrations.vllm as plugin
from engram_offload.integrations.lookup import LayerShard
from engram_offload.integrations.settings import parse_settings
from engram_offload.serving.store import open_table

from engram_tables import v41_config, write_other_model_table, write_v41_table
from row_servers import serving

STAND_IN = "engram_offload_stand_in_engram"


@pytest.fixture
def hooks(monkeypatch):
    """``sys.meta_path`` and ``sys.modules`` restored after the test; ``patch`` records its calls
    (and whether the module had run its code by then)."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, plugin.ENGRAM_MODULE, raising=False)
    monkeypatch.delitem(sys.modules, STAND_IN, raising=False)
    patched: list[tuple[types.ModuleType, bool]] = []
    monkeypatch.setattr(plugin, "patch", lambda module: patched.append((module, hasattr(module, "Engram"))))
    return patched


def vllm_version(monkeypatch, answer: str | None) -> None:
    """``importlib.metadata.version('vllm')`` answers ``answer`` (None: not installed)."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name.lower() != "vllm":  # distribution names compare case-insensitively
            return real(name)
        if answer is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return answer

    monkeypatch.setattr(importlib.metadata, "version", version)


def hook_count() -> int:
    return sum(isinstance(f, plugin._PatchOnImport) for f in sys.meta_path)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "engram_offload.integrations.vllm"
            and r.levelno == logging.WARNING]


def test_without_vllm_register_warns_and_touches_nothing(monkeypatch, hooks, caplog):
    vllm_version(monkeypatch, None)
    with caplog.at_level(logging.WARNING):
        plugin.register()
    assert warnings_of(caplog) == ["engram-offload: vLLM is not installed; the plugin does nothing"]
    assert hook_count() == 0 and hooks == []


def test_an_untested_vllm_is_patched_too_and_judged_when_settings_are_given(monkeypatch, hooks, caplog):
    vllm_version(monkeypatch, "0.35.0")
    with caplog.at_level(logging.WARNING):
        plugin.register()
    assert hook_count() == 1 and warnings_of(caplog) == []  # without settings the patch calls vLLM's own code
    settings = parse_settings({"table": "t.table", "tier": "pinned"})
    with pytest.raises(ValueError) as refused:
        plugin.check_engine(settings)
    assert str(refused.value) == (
        f"engram-offload was tested with vLLM {', '.join(plugin.TESTED_VERSIONS)}, not 0.35.0: install one of "
        'those, or add "allow_untested_engine": true to the engram_offload settings to run it anyway (every vLLM '
        "name the plugin uses is there)")
    monkeypatch.setattr(plugin, "_warned_untested", [])
    allowed = parse_settings({"table": "t.table", "tier": "pinned", "allow_untested_engine": True})
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # every layer of every rank asks: one warning a process
            plugin.check_engine(allowed)
    assert warnings_of(caplog) == ["engram-offload: running on vLLM 0.35.0, which it was not tested with "
                                   f"({', '.join(plugin.TESTED_VERSIONS)}), because allow_untested_engine is set; "
                                   "every vLLM name it uses is there"]
    vllm_version(monkeypatch, plugin.TESTED_VERSIONS[-1])
    plugin.check_engine(settings)  # a tested version: nothing to say


def stand_in_engram(decorated: bool = False) -> types.ModuleType:
    """A module with an ``Engram`` whose ``_finish_prefetch`` is (or not) under a capture decorator."""
    module = types.ModuleType(STAND_IN)

    class Engram:
        def _create_embedding(self, layout, index):
            return "vLLM's own"

        def _finish_prefetch(self, event):
            pass

    if decorated:
        body = Engram._finish_prefetch
        Engram._finish_prefetch = functools.wraps(body)(lambda self, event: body(self, event))
    module.Engram = Engram
    return module


def test_a_vllm_without_a_name_the_plugin_uses_keeps_its_table_and_refuses_settings(monkeypatch, caplog):
    module = stand_in_engram()  # no capture decorator, no ParallelEngramEmbedding
    missing = plugin.missing_names(module)
    assert "Engram._finish_prefetch's eager_break_during_capture" in missing and "ParallelEngramEmbedding" in missing
    monkeypatch.setattr(plugin, "missing_names", lambda engram: missing[:2])  # as if vLLM's config were there
    given: list = [None]
    monkeypatch.setattr(plugin, "settings_from_vllm", lambda: given[0])
    vllm_version(monkeypatch, "0.35.0")
    with caplog.at_level(logging.ERROR):
        plugin.patch(module)
    assert any(f"vLLM 0.35.0 lacks {', '.join(missing[:2])}, which the plugin uses" in r.getMessage()
               for r in caplog.records if r.levelno == logging.ERROR)
    engram = module.Engram()
    assert engram._create_embedding(None, 0) == "vLLM's own"  # without settings: vLLM's table
    given[0] = parse_settings({"table": "t.table", "tier": "pinned"})
    with pytest.raises(ValueError, match=r"^engram_offload settings are given but vLLM 0\.35\.0 lacks "):
        engram._create_embedding(None, 0)
    before = module.Engram.__dict__["_finish_prefetch"]
    plugin.patch(module)  # once
    assert module.Engram.__dict__["_finish_prefetch"] is before


def test_a_vllm_without_its_config_getter_is_left_wholly_alone(monkeypatch):
    module = stand_in_engram(decorated=True)
    monkeypatch.setattr(plugin, "missing_names", lambda engram: ["vllm.config.get_current_vllm_config"])
    create = module.Engram.__dict__["_create_embedding"]
    plugin.patch(module)
    assert module.Engram.__dict__["_create_embedding"] is create
    assert not getattr(module.Engram, "_engram_offload_patched", False)


def test_a_tested_vllm_gets_one_import_hook_first_in_line_however_often_registered(monkeypatch, hooks, caplog):
    vllm_version(monkeypatch, plugin.TESTED_VERSIONS[0])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # vLLM calls every general plugin in every process, maybe more than once
            plugin.register()
    assert isinstance(sys.meta_path[0], plugin._PatchOnImport) and hook_count() == 1
    assert hooks == [] and warnings_of(caplog) == []


def test_an_engram_module_already_imported_is_patched_at_once(monkeypatch, hooks):
    vllm_version(monkeypatch, plugin.TESTED_VERSIONS[0])
    module = types.ModuleType(plugin.ENGRAM_MODULE)
    module.Engram = object
    monkeypatch.setitem(sys.modules, plugin.ENGRAM_MODULE, module)
    plugin.register()
    assert hooks == [(module, True)] and hook_count() == 0


def test_the_hook_patches_the_engram_module_right_after_it_runs(monkeypatch, hooks, tmp_path):
    (tmp_path / f"{STAND_IN}.py").write_text("class Engram:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugin, "ENGRAM_MODULE", STAND_IN)
    vllm_version(monkeypatch, plugin.TESTED_VERSIONS[0])
    plugin.register()
    import engram_offload_stand_in_engram as module  # the hook's spec, its loader's exec wrapped

    assert hooks == [(module, True)]  # patched once, after the module's code ran
    hook = sys.meta_path[0]
    assert hook.find_spec("json", None) is None  # other modules are left to the other finders
    monkeypatch.setattr(plugin, "ENGRAM_MODULE", "engram_offload_no_such_module")
    assert hook.find_spec("engram_offload_no_such_module", None) is None  # no finder finds it: neither does the hook


class Reads:
    """A store that records the ids of each ``read_raw``."""

    def __init__(self, store) -> None:
        self.store, self.reads = store, []

    def read_raw(self, ids: np.ndarray) -> torch.Tensor:
        self.reads.append(np.asarray(ids).copy())
        return self.store.read_raw(ids)


@pytest.fixture(scope="module")
def table_path(tmp_path_factory):
    path, _ = write_v41_table(tmp_path_factory.mktemp("vllm-loader") / "v41.table", v41_config(), seed=5)
    return path


@pytest.fixture(scope="module")
def table(table_path):
    with open_table(table_path, "memory") as store:
        yield store


@pytest.mark.parametrize("rank, world", [(0, 1), (1, 4)])
def test_the_checking_loader_accepts_the_tables_own_rows_and_names_the_first_that_differs(table, rank, world):
    config, raw = table.config, table.tier.rows.numpy()
    layer_id = config.layer_ids[1]
    shard = LayerShard.of(config, layer_id, rank, world)
    rows = config.rows_per_layer[layer_id]
    part = torch.from_numpy(raw[shard.row_base:shard.row_base + rows].copy())  # the checkpoint's tensor of the layer
    head_dim = config.head_dim
    store = Reads(table)
    load_values = plugin._checking_loader(store, shard, head_dim, values=True)
    load_scales = plugin._checking_loader(store, shard, head_dim, values=False)
    values = part[:, :head_dim].contiguous().view(torch.float8_e4m3fn)
    scales = part[:, head_dim:].contiguous().view(torch.float8_e8m0fnu)
    load_values(None, values)
    load_scales(None, scales)  # its own rows: accepted, nothing kept

    checked = np.unique(np.linspace(shard.vocab_start, shard.vocab_end - 1, plugin.CHECKED_ROWS).astype(np.int64))
    assert checked.size == plugin.CHECKED_ROWS  # spread over the rank's rows, both ends included
    assert [ids.tolist() for ids in store.reads] == [(checked + shard.row_base).tolist()] * 2
    for which, load, tensor, dtype in (("values", load_values, part[:, :head_dim], torch.float8_e4m3fn),
                                       ("scales", load_scales, part[:, head_dim:], torch.float8_e8m0fnu)):
        for row in (checked[0], checked[-1], checked[3]):
            other = tensor.clone()
            other[row, -1] ^= 1
            with pytest.raises(ValueError) as refused:
                load(None, other.contiguous().view(dtype))
            assert str(refused.value) == (
                f"the Engram table does not hold this checkpoint's rows (layer {layer_id}, row {row} of its {which} "
                "differs): convert this checkpoint's table with `engram-offload convert CHECKPOINT TABLE`")
        unchecked = int(checked[0]) + 1  # between two checked rows: not read
        other = tensor.clone()
        other[unchecked] ^= 1
        load(None, other.contiguous().view(dtype))
    both = values.view(torch.uint8).clone()
    both[checked[2], 0] ^= 1
    both[checked[5], 0] ^= 1
    with pytest.raises(ValueError, match=f"row {checked[2]} of its values differs"):  # the first of two
        load_values(None, both.view(torch.float8_e4m3fn))


def test_the_checking_loader_of_a_rank_without_rows_reads_nothing_and_of_one_row_checks_it(table):
    config = table.config
    shard = LayerShard.of(config, config.layer_ids[1], 1, 4)  # rows from vocab_start > 0
    empty = dataclasses.replace(shard, vocab_end=shard.vocab_start)

    class Unread:
        def read_raw(self, ids):
            raise AssertionError("a rank without rows read the table")

    plugin._checking_loader(Unread(), empty, config.head_dim, values=True)(None, torch.empty(0))
    one = dataclasses.replace(shard, vocab_end=shard.vocab_start + 1)
    layer = torch.from_numpy(table.tier.rows.numpy()[shard.row_base:shard.row_base + config.rows_per_layer[one.layer_id]])
    store = Reads(table)
    load = plugin._checking_loader(store, one, config.head_dim, values=True)
    load(None, layer[:, :config.head_dim].contiguous().view(torch.float8_e4m3fn))
    assert [ids.tolist() for ids in store.reads] == [[one.row_base + one.vocab_start]]
    other = layer[:, :config.head_dim].clone()
    other[one.vocab_start, 0] ^= 1
    with pytest.raises(ValueError, match=f"row {one.vocab_start} of its values differs"):
        load(None, other.view(torch.float8_e4m3fn))


def layout_of(config) -> types.SimpleNamespace:
    """The fields of vLLM's ``EngramLayout`` the plugin reads, for a table's own model."""
    return types.SimpleNamespace(
        layer_ids=list(config.layer_ids), max_ngram_size=config.max_ngram_size, n_heads=config.n_heads,
        head_dim=config.head_dim, primes=[config.primes[i] for i in config.layer_ids],
        num_embeddings=[config.rows_per_layer[i] for i in config.layer_ids])


@pytest.fixture
def stores(monkeypatch):
    """``_store``'s cache emptied for the test, and every store it opened closed after."""
    monkeypatch.setattr(plugin, "_stores", {})
    yield plugin._stores
    for store, _ in plugin._stores.values():
        store.close()


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A table of another model's layout (the bucket primes differ)."""
    return write_other_model_table(tmp_path_factory.mktemp("vllm-other") / "other.table")


def test_a_store_a_setting_and_rank_holding_the_ranks_columns(table_path, stores, monkeypatch):
    opened = []
    real = plugin.open_store
    monkeypatch.setattr(plugin, "open_store", lambda settings, columns: opened.append(columns) or real(settings, columns))
    settings = parse_settings({"table": str(table_path), "tier": "memory"})
    layout = layout_of(v41_config())
    first = plugin._store(settings, layout, 1, 4)
    assert plugin._store(settings, layout, 1, 4)[0] is first[0]  # every layer of the rank: one store
    assert first[1] == first[0].config == v41_config()
    assert opened == [(6, 12)]  # the rank's 6 of 24 columns: its caches hold only their rows
    plugin._store(settings, layout, 0, 1)
    assert opened == [(6, 12), (0, 24)]


def test_a_local_table_of_another_model_is_refused_before_it_is_loaded(other_model, stores, monkeypatch):
    def open_store(settings, columns):
        raise AssertionError("the table was opened before its layout was checked")

    monkeypatch.setattr(plugin, "open_store", open_store)
    settings = parse_settings({"table": str(other_model), "tier": "memory"})
    with pytest.raises(ValueError, match=f"^the table {other_model} was converted from another model "):
        plugin._store(settings, layout_of(v41_config()), 0, 1)
    assert stores == {}


def test_a_row_servers_table_of_another_model_is_refused_and_its_client_closed(other_model, stores, tmp_path,
                                                                             monkeypatch):
    clients = []
    real = plugin.open_store
    monkeypatch.setattr(plugin, "open_store", lambda settings, columns: clients.append(real(settings, columns))
                        or clients[-1])
    settings = parse_settings({"table": str(other_model), "tier": "direct", "row_server": str(tmp_path / "rows.sock")})
    with serving(other_model, tmp_path / "rows.sock"):
        with pytest.raises(ValueError, match=f"^the table {other_model} was converted from another model "):
            plugin._store(settings, layout_of(v41_config()), 0, 1)
    assert len(clients) == 1 and clients[0].closed and stores == {}


def test_a_table_with_more_rows_in_a_layer_than_the_checkpoint_declares_is_refused(table_path, stores):
    config = v41_config()
    layout = layout_of(config)
    layout.num_embeddings[1] -= 1  # the checkpoint's layer 14 one row shorter than the table's
    settings = parse_settings({"table": str(table_path), "tier": "memory"})
    rows = config.rows_per_layer[14]
    with pytest.raises(ValueError, match=f"^the table {table_path} was converted from another model \\(layer 14 has "
                                         f"{rows} rows, the checkpoint {rows - 1}\\)"):
        plugin._store(settings, layout, 0, 1)
    assert stores == {}
