"""The SGLang plugin's parts that need no SGLang: owned rows as SGLang's torch path computes
them (gathered from resident rows by the device, or read on the host), the layer check, the
checkpoint check, ``register``'s settings and its version policy."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
import torch

from engram_offload.gpu.device_table import DeviceTable
from engram_offload.integrations import sglang as plugin
from engram_offload.serving.store import open_table

from engram_tables import v41_config, write_v41_table

CONFIG = v41_config()


def shard_range(num_embeddings, column_bounds, tp_rank, tp_size):
    """SGLang 0.5.23's ``shard_range``, restated: whole heads when the columns divide evenly."""
    if (len(column_bounds) - 1) % tp_size == 0:
        per = (len(column_bounds) - 1) // tp_size
        return column_bounds[tp_rank * per], column_bounds[(tp_rank + 1) * per]
    return num_embeddings * tp_rank // tp_size, num_embeddings * (tp_rank + 1) // tp_size


def sglang_owned_rows(weight, scale, indices, row_start, rows):
    """SGLang 0.5.23's ``EngramEmbedding._owned_rows`` torch path, restated over its shard."""
    local = indices - row_start
    owned = (local >= 0) & (local < rows)
    local = local.masked_fill(~owned, 0)
    values = weight[local].float().unflatten(-1, (-1, 32))
    values = (values * scale[local].float().unsqueeze(-1)).flatten(-2)
    return values.to(torch.bfloat16).masked_fill(~owned.unsqueeze(-1), 0)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return write_v41_table(tmp_path_factory.mktemp("sglang") / "v41.table", CONFIG, seed=6)


def layer_rows(raw, layer_id, start, end):
    """SGLang's shard of one layer as its checkpoint tensors: fp8 values and e8m0 scales."""
    base = CONFIG.layer_row_bases[CONFIG.layer_ids.index(layer_id)]
    shard = torch.from_numpy(raw[base + start: base + end].copy())
    return shard[:, :256].contiguous().view(torch.float8_e4m3fn), shard[:, 256:].contiguous().view(torch.float8_e8m0fnu)


def owned_rows(store, layer_id, start, count):
    """The plugin's rows of a shard: gathered in place where the store's rows are resident."""
    table = plugin._device_table(store, layer_id, torch.device("cpu"))
    return plugin.OwnedRows(store, CONFIG, layer_id, start, count, table)


@pytest.mark.parametrize("tier", ["direct", "memory"])
@pytest.mark.parametrize("tp_size", [1, 3, 4, 5])
def test_owned_rows_equal_sglangs_torch_path(table, tp_size, tier):
    """Read on the host (direct) or gathered from the resident rows (memory), bit for bit."""
    path, raw = table
    with open_table(path, tier, **({"cache_bytes": 50 * 264} if tier == "direct" else {})) as store:
        for index, layer_id in enumerate(CONFIG.layer_ids):
            n = CONFIG.rows_per_layer[layer_id]
            bounds = (0, *np.cumsum(CONFIG.head_sizes(layer_id)).tolist())
            rng = np.random.default_rng(tp_size)
            ids = torch.from_numpy(rng.integers(0, n, (6, 24)))
            ids[0, :2] = torch.tensor([3, 5]) if index == 0 else ids[0, :2]  # scale bytes 0 and 255
            for rank in range(tp_size):
                start, end = shard_range(n, bounds, rank, tp_size)
                rows = owned_rows(store, layer_id, start, end - start)
                assert (rows.table is not None) == (tier == "memory")
                want = sglang_owned_rows(*layer_rows(raw, layer_id, start, end), ids, start, end - start)
                nan = torch.isnan(want.float())
                got = rows.owned_rows(ids)
                assert torch.equal(torch.isnan(got.float()), nan)
                assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
        requested = store.stats()["store"]["rows_requested"]
        assert requested == 0 if tier == "memory" else requested > 0  # in place: nothing read through the store


def test_rows_holding_only_the_shard_are_gathered_at_their_offset(table):
    """Host rows that start at the shard's first row (``first``), as a store of the rank's columns
    holds them: the same rows as SGLang's shard, ids outside it zero."""
    path, raw = table
    layer_id, start, count = 14, 300, 411
    first = CONFIG.layer_row_bases[1] + start
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, CONFIG.rows_per_layer[14], (9, 24)))
    ids[0, :3] = torch.tensor([start - 1, start, start + count])
    with open_table(path, "mmap") as store:
        held = DeviceTable(torch.from_numpy(raw[first: first + count].copy()), "cpu")
        got = plugin.OwnedRows(store, CONFIG, layer_id, start, count, (held, first)).owned_rows(ids)
    want = sglang_owned_rows(*layer_rows(raw, layer_id, start, start + count), ids, start, count)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got[0, 0].abs().sum() == 0 and got[0, 2].abs().sum() == 0 and got[0, 1].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["memory", "pinned"])
def test_the_in_place_gather_replays_in_a_cuda_graph(table, tier):
    """Captured once, replayed with new ids in the same buffer: each replay's rows are SGLang's
    torch path's for those ids (the gather reads host rows over UVA, nothing waits on the host)."""
    path, raw = table
    n, start, count = CONFIG.rows_per_layer[14], 400, 700
    with open_table(path, tier) as store:
        rows = plugin.OwnedRows(store, CONFIG, 14, start, count, plugin._device_table(store, 14, torch.device("cuda")))
        ids = torch.zeros((16, 24), dtype=torch.int64, device="cuda")
        rows.owned_rows(ids)  # warm-up (Triton compiles) outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rows.owned_rows(ids)
        for seed in range(3):
            new = torch.from_numpy(np.random.default_rng(seed).integers(0, n, (16, 24)))
            ids.copy_(new)
            graph.replay()
            want = sglang_owned_rows(*layer_rows(raw, 14, start, start + count), new, start, count)
            got = out.cpu()
            nan = torch.isnan(want.float())
            assert torch.equal(torch.isnan(got.float()), nan)
            assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_ids_must_have_every_column(table):
    path, _ = table
    with open_table(path, "memory") as store:
        with pytest.raises(ValueError) as refused:
            owned_rows(store, 14, 0, 10).owned_rows(torch.zeros((3, 23), dtype=torch.int64))
    assert str(refused.value) == "Engram ids must be [T, 24] (every column of layer 14), got (3, 23)"


@pytest.mark.parametrize("tier", ["direct", "memory"])
def test_scale_byte_0_is_sglangs_not_vllms(table, tier):
    path, raw = table
    ids = torch.zeros((1, 24), dtype=torch.int64)
    ids[0, 0] = 3
    with open_table(path, tier) as store:
        got = owned_rows(store, CONFIG.layer_ids[0], 0, CONFIG.rows_per_layer[1]).owned_rows(ids)[0, 0, :32].float()
    values = torch.from_numpy(raw[3, :32].copy()).view(torch.float8_e4m3fn).float()
    assert torch.equal(got, (values * 2.0 ** -127).to(torch.bfloat16).float())  # vLLM would give 0.0
    assert got.abs().sum() > 0


CONVERT = "convert this checkpoint's table with `engram-offload convert CHECKPOINT TABLE`"


def test_layer_check(table):
    path, _ = table
    bounds = [0, *np.cumsum(CONFIG.head_sizes(14)).tolist()]
    plugin.check_column_bounds(CONFIG, 14, bounds, str(path))
    with pytest.raises(ValueError) as missing:
        plugin.check_column_bounds(CONFIG, 15, bounds, str(path))
    assert str(missing.value) == f"the table {path} has no Engram layer 15 (it has [1, 14]): {CONVERT}"
    with pytest.raises(ValueError) as other:
        plugin.check_column_bounds(CONFIG, 14, [b + 1 for b in bounds], str(path))
    assert str(other.value) == f"the table {path} was converted from another model (layer 14's heads differ): {CONVERT}"


def test_checkpoint_rows_checked(table):
    path, raw = table
    with open_table(path, "mmap") as store:
        n = CONFIG.rows_per_layer[14]
        rows = plugin.OwnedRows(store, CONFIG, 14, 100, 900)
        layer = torch.from_numpy(raw[CONFIG.layer_row_bases[1]: CONFIG.layer_row_bases[1] + n].copy())
        rows.check_checkpoint(layer[:, :256].contiguous().view(torch.float8_e4m3fn), True)
        rows.check_checkpoint(layer[:, 256:].contiguous().view(torch.float8_e8m0fnu), False)
        other = layer.clone()
        other[:, 256:] ^= 2
        with pytest.raises(ValueError) as differs:
            rows.check_checkpoint(other[:, 256:].contiguous().view(torch.float8_e8m0fnu), False)
        assert str(differs.value) == f"the Engram table does not hold this checkpoint's rows (layer 14): {CONVERT}"


@pytest.mark.parametrize("start, count", [(100, 900), (7, 1), (0, 2)])
def test_the_checkpoint_check_reads_the_shards_first_and_last_rows(table, start, count):
    """A checkpoint that differs in the shard's last row alone (or its only row) is refused;
    one that differs only outside the shard is not."""
    path, raw = table
    n = CONFIG.rows_per_layer[14]
    layer = torch.from_numpy(raw[CONFIG.layer_row_bases[1]: CONFIG.layer_row_bases[1] + n].copy())
    with open_table(path, "memory") as store:
        rows = plugin.OwnedRows(store, CONFIG, 14, start, count)
        for row in (start + count, start - 1):  # just outside: not the shard's
            if 0 <= row < n:
                outside = layer.clone()
                outside[row, :256] ^= 1
                rows.check_checkpoint(outside[:, :256].contiguous().view(torch.float8_e4m3fn), True)
        last = layer.clone()
        last[start + count - 1, :256] ^= 1
        with pytest.raises(ValueError, match="does not hold this checkpoint's rows"):
            rows.check_checkpoint(last[:, :256].contiguous().view(torch.float8_e4m3fn), True)


def test_the_checkpoint_check_reads_a_few_rows_of_the_table(table):
    path, raw = table
    n = CONFIG.rows_per_layer[14]
    layer = torch.from_numpy(raw[CONFIG.layer_row_bases[1]: CONFIG.layer_row_bases[1] + n].copy())
    with open_table(path, "memory") as store:
        plugin.OwnedRows(store, CONFIG, 14, 0, n).check_checkpoint(layer[:, 256:].contiguous().view(torch.float8_e8m0fnu),
                                                                     False)
        assert store.stats()["store"]["rows_requested"] == plugin.CHECKED_ROWS  # not the whole shard


def test_the_weight_loaders_check_the_checkpoints_values_and_scales_and_keep_nothing(table):
    path, raw = table
    n = CONFIG.rows_per_layer[14]
    layer = torch.from_numpy(raw[CONFIG.layer_row_bases[1]: CONFIG.layer_row_bases[1] + n].copy())
    values, scales = layer[:, :256].contiguous(), layer[:, 256:].contiguous()
    with open_table(path, "memory") as store:
        rows = plugin.OwnedRows(store, CONFIG, 14, 10, 500)
        param = torch.nn.Parameter(torch.empty(0, 256, dtype=torch.float8_e4m3fn), requires_grad=False)
        plugin._checking_loader(rows, True)(param, values.view(torch.float8_e4m3fn))
        plugin._checking_loader(rows, False)(param, scales.view(torch.float8_e8m0fnu))
        assert param.numel() == 0  # nothing kept
        with pytest.raises(ValueError, match="does not hold this checkpoint's rows"):  # scales read as values
            plugin._checking_loader(rows, True)(param, scales.repeat(1, 32).view(torch.float8_e4m3fn))


def test_a_rank_that_owns_no_row_checks_nothing(table):
    path, raw = table
    with open_table(path, "memory") as store:
        rows = plugin.OwnedRows(store, CONFIG, 14, 50, 0)
        rows.check_checkpoint(torch.zeros((0, 256), dtype=torch.uint8).view(torch.float8_e4m3fn), True)
        assert torch.equal(rows.owned_rows(torch.tensor([49, 50, 51])), torch.zeros((3, 256), dtype=torch.bfloat16))


def test_register_reads_the_environment(monkeypatch, caplog):
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.register()  # inert
    monkeypatch.setenv(plugin.ENV, '{"table": "/t.table", "tier": "nvme"}')
    with pytest.raises(ValueError, match="tier 'nvme' is unknown"):
        plugin.register()
    monkeypatch.setenv(plugin.ENV, "{table}")
    with pytest.raises(ValueError, match="ENGRAM_OFFLOAD_CONFIG is not valid JSON"):
        plugin.register()
    monkeypatch.setenv(plugin.ENV, '{"table": "/t.table", "tier": "direct"}')
    if importlib.util.find_spec("sglang") is None:
        with caplog.at_level(logging.WARNING, "engram_offload.integrations.sglang"):
            plugin.register()  # a warning, nothing patched
        assert "SGLang is not installed; nothing to do" in caplog.text


def fake_distribution(folder, name: str, version: str) -> None:
    """An installed distribution as importlib.metadata finds it (a dist-info folder on sys.path)."""
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def untested(monkeypatch, tmp_path, settings: str, missing: list[str]) -> list[type]:
    """SGLang 0.5.22 as installed (its names ``missing``), ``settings`` set; the classes the plugin registers."""
    fake_distribution(tmp_path, "sglang", "0.5.22")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(plugin.ENV, settings)
    monkeypatch.setattr(plugin, "missing_names", lambda: missing)
    registered: list[type] = []
    monkeypatch.setattr(plugin, "_replace_embedding", registered.append)
    monkeypatch.setattr(plugin, "refusing_class", lambda message: ValueError)
    monkeypatch.setattr(plugin, "embedding_class", lambda settings: object)
    return registered


def test_an_sglang_version_not_tested_is_refused_in_one_line(monkeypatch, caplog, tmp_path):
    registered = untested(monkeypatch, tmp_path, '{"table": "/t.table", "tier": "direct"}', [])
    with pytest.raises(ValueError) as refused:
        plugin.register()
    assert str(refused.value) == (
        'engram-offload was tested with SGLang 0.5.23, not 0.5.22: install one of those, or add '
        '"allow_untested_engine": true to ENGRAM_OFFLOAD_CONFIG to run it anyway (every SGLang name the plugin '
        'uses is there)')
    assert registered == [ValueError]  # the refusing class: the model stops at its first Engram layer


def test_an_untested_sglang_runs_when_allowed_with_a_warning(monkeypatch, caplog, tmp_path):
    registered = untested(monkeypatch, tmp_path, '{"table": "/t.table", "tier": "direct", "allow_untested_engine": true}', [])
    with caplog.at_level(logging.WARNING, "engram_offload.integrations.sglang"):
        plugin.register()
    assert registered == [object]
    assert [r.getMessage() for r in caplog.records] == [
        "engram-offload: running on SGLang 0.5.22, which it was not tested with (0.5.23), because "
        "allow_untested_engine is set; every SGLang name it uses is there"]


def test_an_sglang_without_a_name_the_plugin_uses_is_refused_even_when_allowed(monkeypatch, tmp_path):
    registered = untested(monkeypatch, tmp_path, '{"table": "/t.table", "tier": "direct", "allow_untested_engine": true}',
                          ["sglang.srt.layers.engram.shard_range"])
    with pytest.raises(ValueError) as refused:
        plugin.register()
    assert str(refused.value) == ("SGLang 0.5.22 lacks sglang.srt.layers.engram.shard_range, which engram-offload "
                                  "uses: install SGLang 0.5.23")
    assert registered == [ValueError]


def test_without_sglang_the_warning_names_the_variable(monkeypatch, caplog):
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    monkeypatch.setenv(plugin.ENV, '{"table": "/t.table", "tier": "direct"}')
    with caplog.at_level(logging.WARNING, "engram_offload.integrations.sglang"):
        plugin.register()
    assert [r.getMessage() for r in caplog.records] == [
        "engram-offload: ENGRAM_OFFLOAD_CONFIG is set but SGLang is not installed; nothing to do"]
