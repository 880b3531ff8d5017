"""SGLang 0.5.23's own Engram code, on a CPU, through the installed plugin.

These tests import SGLang in the test process: SGLang's ``load_plugins`` finds the plugin by its
entry point and replaces ``EngramEmbedding``; SGLang's ``Engram`` layers are built, loaded and
run as its model does (its torch paths: no Triton, no GPU), under SGLang's server args parsed
from a command line by its own parser and published as its scheduler publishes them (``served``,
against a local model directory holding only a DeepSeek-V4.1 ``config.json``). SGLang's own
``EngramEmbedding``, loaded with the same checkpoint rows, is the oracle. They run in the SGLang
environment (``make test-sglang``: SGLang 0.5.23 beside the torch its torchvision was built for)
and are skipped elsewhere. Not run here: SGLang's all-reduce over TP ranks (each rank's owned
rows are compared, and their sum is checked against one rank's lookup), its CUDA kernels and its
graph capture (the plugin's decision from SGLang's resolved graph settings is).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_offload.integrations import sglang as plugin
from engram_offload.integrations.settings import settings_from_json

from engram_tables import same_bits, served_tables, v41_config

try:
    SGLANG = importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    SGLANG = None

pytestmark = pytest.mark.skipif(SGLANG not in plugin.TESTED_VERSIONS,
                                reason=f"SGLang {plugin.TESTED_VERSIONS[0]} is not installed here "
                                       "(make test-sglang runs these tests beside it)")

CONFIG = v41_config()
# the model's config.json fields SGLang reads (EngramLayout.from_config, Engram)
HF_CONFIG = types.SimpleNamespace(
    engram_layer_ids=list(CONFIG.layer_ids), engram_max_ngram_size=CONFIG.max_ngram_size,
    engram_n_heads=CONFIG.n_heads, engram_vocab_size=CONFIG.prime_starts[0], engram_head_dim=CONFIG.head_dim,
    engram_num_embeddings=[CONFIG.rows_per_layer[layer] for layer in CONFIG.layer_ids],
    hidden_size=CONFIG.hidden_size, hc_mult=CONFIG.hc_mult, rms_norm_eps=1e-6)
TOKENS = 7
RELEASED_CONFIG = Path(__file__).resolve().parents[1] / "data" / "deepseek-v4.1-flash-config.json"
# what SGLang's ModelConfig reads of a DeepSeek-V4.1 config beyond the fields tests/data keeps
MODEL_FIELDS = {"sliding_window": 128, "index_head_dim": 128, "compress_ratios": [4, 128] * 20}
NO_GRAPHS = ("--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled")


def sglang_modules() -> types.SimpleNamespace:
    """SGLang's modules, with its own ``EngramEmbedding`` kept as the oracle."""
    from sglang.srt import plugins
    from sglang.srt.layers import engram, engram_staging
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel

    return types.SimpleNamespace(engram=engram, staging=engram_staging, plugins=plugins, hooks=HookRegistry,
                                 parallel=get_parallel, original=engram.EngramEmbedding,
                                 layout=engram.EngramLayout.from_config(HF_CONFIG))


@pytest.fixture(scope="module")
def sglang():
    return sglang_modules()


def write_model_dir(folder: Path) -> Path:
    """A local DeepSeek-V4.1 model directory (its ``config.json`` only) that SGLang resolves its
    server args against."""
    config = json.loads(RELEASED_CONFIG.read_text())
    config["text_config"].update(MODEL_FIELDS)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("model") / "DeepSeek-V4.1-Flash")


def server_args(argv: list[str]):
    """SGLang's ``ServerArgs`` from its own parser (which also sets the root logger up: put back)."""
    from sglang.srt.server_args import prepare_server_args

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return prepare_server_args(argv)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


@contextmanager
def served(model_dir: Path, *flags: str):
    """SGLang's server args for ``--model-path MODEL_DIR --device cuda FLAGS``, resolved and
    published as its scheduler does, for the block."""
    from sglang.srt.runtime_context import create_context, use_context

    args = server_args(["--model-path", str(model_dir), "--device", "cuda", *flags])
    args.resolve_once()
    with use_context(create_context(args, role="scheduler")):
        yield args


def restore(sglang) -> None:
    """SGLang's own class back in every module that holds the name, no hook left, stores closed."""
    from sglang.srt.plugins.hook_registry import HookType

    sglang.hooks.reset()
    if sglang.engram.EngramEmbedding is not sglang.original:
        sglang.hooks.register(plugin.TARGET, sglang.original, HookType.REPLACE)
        sglang.hooks.apply_hooks()  # propagates to engram_staging and the rest, as it did for ours
        sglang.hooks.reset()
    sglang.plugins._plugins_loaded = False
    for store in plugin._stores.values():
        store.close()
    plugin._stores.clear()
    plugin._resolutions.clear()


@contextmanager
def plugin_loaded(sglang, monkeypatch, settings: dict | str | None):
    """SGLang's ``load_plugins`` run with ``ENGRAM_OFFLOAD_CONFIG`` set to ``settings``."""
    restore(sglang)
    if settings is None:
        monkeypatch.delenv(plugin.ENV, raising=False)
    else:
        monkeypatch.setenv(plugin.ENV, settings if isinstance(settings, str) else json.dumps(settings))
    monkeypatch.setenv("SGLANG_PLUGINS", "engram_offload")
    try:
        sglang.plugins.load_plugins()
        yield sglang.engram.EngramEmbedding
    finally:
        restore(sglang)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One V4.1 table (as a file, behind a row server, and in a Redis pool where redis-server
    runs), another model's table, and the plugin's settings for each tier."""
    with served_tables(tmp_path_factory.mktemp("sglang-engine"), seed=9, socket_prefix="sg-") as served:
        table = str(served.table)
        served.tiers = {
            "memory": {"table": table, "tier": "memory"},
            "direct+cache": {"table": table, "tier": "direct", "cache_bytes": 40 * CONFIG.row_bytes},
            "mmap": {"table": table, "tier": "mmap"},
            "shared": {"table": table, "tier": "shared"},
            "row_server": {"table": table, "tier": served.server_tier, "row_server": str(served.socket)},
        }
        if served.pool_table is not None:
            served.tiers["pool"] = {"table": served.pool_table, "tier": "remote"}
        yield served


def checkpoint_tensors(raw: np.ndarray, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's tensors of one layer: fp8 values ``[rows, 256]`` and e8m0 scales ``[rows, 8]``."""
    index = CONFIG.layer_ids.index(layer_id)
    base, n = CONFIG.layer_row_bases[index], CONFIG.rows_per_layer[layer_id]
    rows = torch.from_numpy(raw[base: base + n].copy())
    d = CONFIG.head_dim
    return rows[:, :d].contiguous().view(torch.float8_e4m3fn), rows[:, d:].contiguous().view(torch.float8_e8m0fnu)


def build_engram(sglang, layer_id: int, raw: np.ndarray, tp_size: int = 1, tp_rank: int = 0):
    """SGLang's ``Engram`` layer as its model builds and loads it (bf16 default dtype, weight loaders)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with sglang.parallel().override(tp_size=tp_size, tp_rank=tp_rank):
            engram = sglang.engram.Engram(HF_CONFIG, layer_id, sglang.layout)
            values, scales = checkpoint_tensors(raw, layer_id)
            engram.embed.weight.weight_loader(engram.embed.weight, values)
            engram.embed.scale.weight_loader(engram.embed.scale, scales)
            engram.embed.finish_load(f"layer {layer_id}")
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator().manual_seed(layer_id)
    for param in (engram.wkv.weight, engram.q_weight, engram.k_weight):
        param.data.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return engram


def layer_ids_of(layer_id: int, seed: int) -> torch.Tensor:
    """Hash ids ``int64 [TOKENS, 24]`` into one layer's table, its first and last rows and the
    rows with scale bytes 0 and 255 among them."""
    n = CONFIG.rows_per_layer[layer_id]
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, n, (TOKENS, CONFIG.cols_per_layer)))
    ids[0, :2] = torch.tensor([0, n - 1])
    if layer_id == CONFIG.layer_ids[0]:
        ids[1, :2] = torch.tensor([3, 5])  # scale byte 0, and 255 beside fp8 zeros
    return ids


def test_sglangs_layout_of_the_model_is_the_tables(sglang):
    """SGLang's prime search and engram-offload's give the same heads, so the same row ids."""
    for index, layer_id in enumerate(CONFIG.layer_ids):
        assert list(sglang.layout.column_bounds(index)) == [0, *np.cumsum(CONFIG.head_sizes(layer_id)).tolist()]
        assert sglang.layout.num_embeddings[index] == CONFIG.rows_per_layer[layer_id]


def test_load_plugins_replaces_the_embedding_in_every_module_that_holds_it(sglang, files, monkeypatch):
    with plugin_loaded(sglang, monkeypatch, None) as cls:
        assert cls is sglang.original  # without the variable the plugin does nothing
    with plugin_loaded(sglang, monkeypatch, files.tiers["memory"]) as cls:
        assert cls is not sglang.original and issubclass(cls, sglang.original)
        assert cls.__name__ == "OffloadedEngramEmbedding"
        assert sglang.staging.EngramEmbedding is cls  # SGLang's hook propagation reaches the stager
    assert sglang.engram.EngramEmbedding is sglang.original and sglang.staging.EngramEmbedding is sglang.original


IN_PLACE = ("memory", "shared")


@pytest.mark.parametrize("tier", ["memory", "direct+cache", "mmap", "shared", "row_server", "pool"])
def test_engram_layers_through_the_plugin_equal_sglangs_own(sglang, files, model_dir, monkeypatch, tier):
    """Each layer's output (lookup, wkv and gate) bit-equal to SGLang's own layer on the same
    checkpoint, and its placeholders hold no row. The in-place tiers run under SGLang's default
    command line (CUDA graphs on) and gather from the resident rows (no read through the store);
    the host-read ones with graphs turned off."""
    if tier not in files.tiers:
        pytest.skip("redis-server is not installed (the pool tier needs it)")
    with served(model_dir, *(() if tier in IN_PLACE else NO_GRAPHS)):
        own = {layer_id: build_engram(sglang, layer_id, files.raw) for layer_id in CONFIG.layer_ids}
        with plugin_loaded(sglang, monkeypatch, files.tiers[tier]):
            ours = {layer_id: build_engram(sglang, layer_id, files.raw) for layer_id in CONFIG.layer_ids}
            assert len(plugin._stores) == 1  # one store for the rank's layers
            store = next(iter(plugin._stores.values()))
            checked = store.stats()["store"]["rows_requested"]  # the checkpoint checks' reads
            for layer_id in CONFIG.layer_ids:
                embed = ours[layer_id].embed
                assert (embed.engram_offload.table is not None) == (tier in IN_PLACE)
                assert embed.weight.numel() == 0 and embed.scale.numel() == 0
                assert embed.weight.dtype == torch.float8_e4m3fn and embed.scale.dtype == torch.float8_e8m0fnu
                ids = layer_ids_of(layer_id, seed=layer_id)
                x = torch.randn((TOKENS, CONFIG.hc_mult, CONFIG.hidden_size),
                                generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
                input_ids = torch.arange(TOKENS)
                assert same_bits(embed(ids), own[layer_id].embed(ids))
                assert same_bits(ours[layer_id](x, ids, None, input_ids=input_ids),
                                 own[layer_id](x, ids, None, input_ids=input_ids))
            read = store.stats()["store"]["rows_requested"] - checked
            assert read == 0 if tier in IN_PLACE else read > 0


@pytest.mark.parametrize("tier", ["memory", "direct+cache"])
@pytest.mark.parametrize("tp_size", [2, 4, 5])
def test_each_ranks_rows_equal_sglangs_shard_and_the_ranks_add_up(sglang, files, model_dir, monkeypatch, caplog,
                                                                 tp_size, tier):
    """Per TP rank (5 does not divide the 24 columns: SGLang's equal-row split), the owned rows
    equal SGLang's own shard's; the ranks' sum, which SGLang's all-reduce forms, is one rank's
    lookup at TP 1. Split by whole heads, each rank's store serves its columns only; split by
    equal rows, the ranks share one store of the whole table, said in one line."""
    layer_id = CONFIG.layer_ids[-1]
    ids = layer_ids_of(layer_id, seed=tp_size)
    whole = build_engram(sglang, layer_id, files.raw).embed(ids).float()
    total = torch.zeros_like(whole)
    with served(model_dir, "--tp", str(tp_size), *NO_GRAPHS), caplog.at_level(logging.INFO, plugin.log.name):
        own = [build_engram(sglang, layer_id, files.raw, tp_size, rank).embed for rank in range(tp_size)]
        with plugin_loaded(sglang, monkeypatch, files.tiers[tier]) as cls:
            for rank in range(tp_size):
                ours = build_engram(sglang, layer_id, files.raw, tp_size, rank).embed
                assert type(ours) is cls and ours.tp_size == tp_size and ours.rows > 0
                assert (ours.row_start, ours.rows) == (own[rank].row_start, own[rank].rows)
                rows = ours._owned_rows(ids)
                assert same_bits(rows, own[rank]._owned_rows(ids))
                total += rows.float()
                if tier == "memory":  # resident: the rank's rows (whole pages of them), or the whole table
                    held = ours.engram_offload.table[0].num_rows
                    assert ours.rows <= held <= (ours.rows + 2 * 4096 // CONFIG.row_bytes if tp_size != 5
                                                 else CONFIG.num_rows)
            columns = [store.columns for store in plugin._stores.values()]
    step = CONFIG.cols_per_layer // tp_size
    if CONFIG.cols_per_layer % tp_size == 0:
        assert columns == [(rank * step, (rank + 1) * step) for rank in range(tp_size)]
        assert "equally" not in caplog.text
    else:
        assert columns == [None]
        assert [r.getMessage() for r in caplog.records if r.name == plugin.log.name] == [
            f"engram-offload: SGLang splits each Engram layer's rows equally over {tp_size} TP ranks (24 columns do "
            "not divide), so each rank opens the whole table"]
    finite = torch.isfinite(whole)
    assert torch.equal(total[finite], whole[finite])
    assert torch.equal(torch.isnan(total), torch.isnan(whole))


def test_tier_auto_is_chosen_once_at_the_first_layer_and_logged(sglang, files, model_dir, monkeypatch, caplog):
    """On this machine the tiny table fits in DRAM: auto chooses pinned, read in place, graphs on."""
    ids = layer_ids_of(1, seed=5)
    with served(model_dir), caplog.at_level(logging.INFO, plugin.log.name):
        own = build_engram(sglang, 1, files.raw).embed(ids)
        with plugin_loaded(sglang, monkeypatch, {"table": str(files.table), "tier": "auto"}):
            ours = [build_engram(sglang, layer_id, files.raw).embed for layer_id in CONFIG.layer_ids]
            assert [store.tier.name for store in plugin._stores.values()] == ["pinned"]
            assert all(embed.engram_offload.table is not None for embed in ours)
            assert same_bits(ours[0](ids), own)
    chosen = [r.getMessage() for r in caplog.records if r.name == plugin.log.name]
    assert len(chosen) == 1 and chosen[0].startswith("engram-offload: auto chose pinned: ")
    assert chosen[0].endswith(f" ({files.table})")


def test_the_plugins_embedding_has_sglangs_attributes_and_holds_no_row(sglang, files, monkeypatch):
    """Every attribute SGLang's constructor sets (read by its forward, its stager and its model)
    equals SGLang's own at TP 4; the parameters are empty fp8/e8m0 placeholders, frozen."""
    own = build_engram(sglang, 14, files.raw, tp_size=4, tp_rank=1).embed
    with plugin_loaded(sglang, monkeypatch, files.tiers["memory"]):
        ours = build_engram(sglang, 14, files.raw, tp_size=4, tp_rank=1).embed
    for name in ("dim", "tp_size", "row_start", "rows", "host_table", "_sort_host_reads", "staged_by_scheduler",
                 "peer", "shared_host_table_without_ats"):
        assert getattr(ours, name) == getattr(own, name), name
    assert (ours.weight.shape, ours.scale.shape) == ((0, CONFIG.head_dim), (0, CONFIG.head_dim // 32))
    assert (ours.weight.dtype, ours.scale.dtype) == (own.weight.dtype, own.scale.dtype)
    assert not ours.weight.requires_grad and not ours.scale.requires_grad and not own.weight.requires_grad


def test_two_settings_in_one_process_read_two_stores(sglang, files, model_dir):
    """One store per setting (and rank): a second table's layers never read the first's store."""
    restore(sglang)
    bounds = sglang.layout.column_bounds(0)
    try:
        with served(model_dir, *NO_GRAPHS), sglang.parallel().override(tp_size=1, tp_rank=0):
            built = {}
            for tier in ("memory", "mmap"):
                cls = plugin.embedding_class(settings_from_json(json.dumps(files.tiers[tier]), plugin.ENV))
                built[tier] = cls(CONFIG.rows_per_layer[1], CONFIG.head_dim, 1, bounds)
        assert len(plugin._stores) == 2
        assert built["memory"].engram_offload.store is not built["mmap"].engram_offload.store
        assert [e.engram_offload.store.tier.name for e in built.values()] == ["memory", "mmap"]
    finally:
        restore(sglang)


def test_a_table_of_another_model_stops_the_first_layer_in_one_line(sglang, files, monkeypatch):
    with plugin_loaded(sglang, monkeypatch, {"table": str(files.other), "tier": "memory"}):
        with pytest.raises(ValueError) as refused:
            build_engram(sglang, CONFIG.layer_ids[0], files.raw)
    assert str(refused.value) == (
        f"the table {files.other} was converted from another model (layer 1's heads differ): "
        "convert this checkpoint's table with `engram-offload convert CHECKPOINT TABLE`")


def test_a_checkpoint_other_than_the_tables_is_refused_while_it_loads(sglang, files, model_dir, monkeypatch):
    changed = files.raw.copy()
    index = CONFIG.layer_ids.index(14)
    changed[CONFIG.layer_row_bases[index] + CONFIG.rows_per_layer[14] - 1, 7] ^= 1  # the layer's last row
    with served(model_dir, *NO_GRAPHS), plugin_loaded(sglang, monkeypatch, files.tiers["mmap"]):
        build_engram(sglang, 1, changed)  # layer 1's rows are the table's
        with pytest.raises(ValueError) as refused:
            build_engram(sglang, 14, changed)
    assert str(refused.value) == ("the Engram table does not hold this checkpoint's rows (layer 14): "
                                  "convert this checkpoint's table with `engram-offload convert CHECKPOINT TABLE`")


def test_a_bad_setting_stops_the_model_not_just_the_plugin(sglang, monkeypatch, caplog):
    """SGLang's ``load_plugins`` logs a plugin's exception and goes on: the layers still refuse
    to build, with the setting's one line, so SGLang's own table is never loaded instead."""
    with caplog.at_level(logging.ERROR):
        with plugin_loaded(sglang, monkeypatch, {"table": "/t.table", "tier": "nvme"}) as cls:
            assert cls.__name__ == "RefusedEngramEmbedding"
            assert sglang.staging.EngramEmbedding is cls
            with pytest.raises(ValueError) as refused:
                build_engram(sglang, 1, np.zeros((CONFIG.num_rows, CONFIG.row_bytes), dtype=np.uint8))
    assert "tier 'nvme' is unknown" in str(refused.value)
    assert "Failed to execute general plugin: engram_offload" in caplog.text  # what SGLang said of it
    assert "tier 'nvme' is unknown" in caplog.text


def test_an_sglang_version_not_tested_stops_the_model_in_one_line(sglang, files, monkeypatch, caplog):
    monkeypatch.setattr(plugin, "TESTED_VERSIONS", ("0.5.22",))
    with caplog.at_level(logging.ERROR):
        with plugin_loaded(sglang, monkeypatch, files.tiers["memory"]) as cls:
            assert cls.__name__ == "RefusedEngramEmbedding"
            with pytest.raises(ValueError) as refused:
                build_engram(sglang, 1, files.raw)
    assert str(refused.value) == (
        f'engram-offload was tested with SGLang 0.5.22, not {SGLANG}: install one of those, or add '
        '"allow_untested_engine": true to ENGRAM_OFFLOAD_CONFIG to run it anyway (every SGLang name the plugin '
        'uses is there)')
    assert "Failed to execute general plugin: engram_offload" in caplog.text


def test_an_untested_sglang_serves_when_allowed_with_a_warning(sglang, files, monkeypatch, caplog):
    monkeypatch.setattr(plugin, "TESTED_VERSIONS", ("0.5.22",))
    ids = layer_ids_of(1, seed=1)
    own = build_engram(sglang, 1, files.raw).embed(ids)
    with caplog.at_level(logging.WARNING, plugin.log.name):
        with plugin_loaded(sglang, monkeypatch, {**files.tiers["memory"], "allow_untested_engine": True}) as cls:
            assert cls.__name__ == "OffloadedEngramEmbedding"
            assert same_bits(build_engram(sglang, 1, files.raw).embed(ids), own)
    assert [r.getMessage() for r in caplog.records if r.name == plugin.log.name] == [
        f"engram-offload: running on SGLang {SGLANG}, which it was not tested with (0.5.22), because "
        "allow_untested_engine is set; every SGLang name it uses is there"]


def test_every_sglang_name_the_plugin_uses_is_checked(sglang, files, monkeypatch):
    """0.5.23 has them all; without one (here ``shard_range``) the model stops in one line, even
    with ``allow_untested_engine``."""
    assert plugin.missing_names() == []
    monkeypatch.delattr(sglang.engram, "shard_range")
    assert plugin.missing_names() == ["sglang.srt.layers.engram.shard_range"]
    with plugin_loaded(sglang, monkeypatch, {**files.tiers["memory"], "allow_untested_engine": True}) as cls:
        assert cls.__name__ == "RefusedEngramEmbedding"
        with pytest.raises(ValueError) as refused:
            build_engram(sglang, 1, files.raw)
    assert str(refused.value) == (f"SGLang {SGLANG} lacks sglang.srt.layers.engram.shard_range, which engram-offload "
                                  "uses: install SGLang 0.5.23")
