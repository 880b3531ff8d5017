"""A rank's share: ``open_table(path, "memory"|"pinned", columns=...)`` loads only its columns' rows."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.rows import encode_rows
from engram_offload.serving.layered import LayeredStore, dram_bytes
from engram_offload.serving.rowserver.client import RowClient
from engram_offload.serving.rowstore import RowStore
from engram_offload.serving.sharding import shard_columns, shard_rows
from engram_offload.serving.store import TableStore
from engram_offload.table import read_header


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(2e-5)  # layers 1 and 14, 24 columns
    x = torch.randn(config.num_rows, config.head_dim)  # [rows, 256]
    path = write_table(tmp_path_factory.mktemp("share") / "v41.tbl", config, x)
    return path, config, encode_rows(x, config.row_format)


def _opened(path, tier, **kwargs):
    """``open_table``, expecting the warning of ``pinned`` on a machine without CUDA."""
    warns = pytest.warns(RuntimeWarning, match="pinned tier") if "pinned" in str(tier) and not torch.cuda.is_available() \
        else contextlib.nullcontext()
    with warns:
        return open_table(path, tier, **kwargs)


def _span(ranges: np.ndarray) -> np.ndarray:
    """Every flat row id of a shard's ranges ``[L, 2]``."""
    return np.concatenate([np.arange(lo, hi) for lo, hi in ranges.tolist()])


def _outside(config: EngramConfig, ranges: np.ndarray) -> list[int]:
    """Ids next to each of the shard's ranges that are not in it (within the table)."""
    span = set(_span(ranges).tolist())
    near = [i for lo, hi in ranges.tolist() for i in (lo - 1, hi)]
    return [i for i in near if 0 <= i < config.num_rows and i not in span]


@pytest.mark.parametrize("tier", ["memory", "pinned"])
def test_each_of_four_ranks_holds_and_serves_only_its_columns_rows(table, tier):
    path, config, raw = table
    rb, rpp = config.row_bytes, read_header(path).layout.rows_per_page
    with open_table(path, "mmap") as whole:
        for rank in range(4):
            columns = shard_columns(config, rank, 4)
            ranges = shard_rows(config, columns).ranges  # [L, 2]
            span = _span(ranges)
            with _opened(path, tier, columns=columns) as store:
                assert isinstance(store, LayeredStore) and store.columns == columns
                assert store.placement == {i: tier for i in config.layer_ids}
                # its columns' rows, widened to whole pages: under a page more at each end of a layer
                held = dram_bytes(store)
                assert span.size * rb <= held < (span.size + 2 * rpp * len(config.layer_ids)) * rb
                assert held <= 0.3 * config.num_rows * rb
                stats = store.stats()
                assert stats["columns"] == list(columns) and stats["dram_bytes"] == held
                assert [stats["layers"][str(i)]["rows"] for i in config.layer_ids] == (ranges[:, 1] - ranges[:, 0]).tolist()
                got = store.read_raw(span)
                assert torch.equal(got, raw[span]) and torch.equal(got, whole.read_raw(span))
                with store.fetch(span) as lease:
                    assert torch.equal(lease.raw, raw[span])
                for outside in _outside(config, ranges):
                    for method, asked in ((store.read_raw, [span[0], outside]), (store.gather, [outside]),
                                          (store.fetch, np.sort([span[-1], outside]))):
                        with pytest.raises(IndexError, match=rf"row {outside} .*columns \[{columns[0]}, {columns[1]}\)"):
                            method(asked)
                for layer_id, (lo, hi) in zip(config.layer_ids, ranges.tolist()):
                    rows, first = store.in_place_rows(layer_id)  # uint8 [R, row_bytes]
                    assert rows.dtype == torch.uint8 and rows.shape[1] == rb and first % rpp == 0
                    assert first <= lo and hi - first <= rows.shape[0]
                    assert torch.equal(rows[lo - first: hi - first], raw[lo:hi])


def test_tp1_holds_the_whole_table(table):
    path, config, raw = table
    columns = shard_columns(config, 0, 1)
    everything = np.arange(config.num_rows)
    with open_table(path, "memory", columns=columns) as store, open_table(path, "memory") as whole:
        assert torch.equal(store.read_raw(everything), raw) and torch.equal(whole.read_raw(everything), raw)
        rpp = read_header(path).layout.rows_per_page
        assert dram_bytes(whole) <= dram_bytes(store) <= dram_bytes(whole) + rpp * config.row_bytes  # a shared page
        for layer_id in config.layer_ids:
            rows, first = store.in_place_rows(layer_id)
            base = config.layer_row_base(layer_id)
            count = config.rows_per_layer[layer_id]
            assert torch.equal(rows[base - first: base - first + count], raw[base: base + count])


def test_a_placement_with_columns_slices_every_layer_to_the_shard(table, tmp_path):
    path, config, raw = table
    first, second = config.layer_ids
    columns = shard_columns(config, 2, 4)
    ranges = dict(zip(config.layer_ids, shard_rows(config, columns).ranges.tolist()))
    span = _span(shard_rows(config, columns).ranges)
    with open_table(path, f"{first}=memory/{second}=direct", columns=columns, cache_bytes=10**9) as store:
        resident, cached = store.layers
        (lo, hi), (lo2, hi2) = ranges[first], ranges[second]
        assert (resident.base, resident.count, cached.base, cached.count) == (lo, hi - lo, lo2, hi2 - lo2)
        assert resident.resident.num_rows < 0.3 * config.rows_per_layer[first]
        assert [lv.capacity for lv in cached.store.levels] == [hi2 - lo2]  # the cache: the shard's rows of the layer
        for _ in range(2):  # cold, then through the warm cache
            assert torch.equal(store.read_raw(span), raw[span])
        assert store.in_place_rows(second) is None
        rows, at = store.in_place_rows(first)
        assert torch.equal(rows[lo - at: hi - at], raw[lo:hi])
        with pytest.raises(IndexError, match="columns"):
            store.read_raw([lo2 - 1])
        with pytest.raises(KeyError, match="not an Engram layer"):
            store.in_place_rows(2)
    # a shared layer keeps the whole layer (one copy a machine); a pinned one the shard's pages
    with _opened(path, f"{first}=shared/{second}=pinned", columns=columns, shm_dir=tmp_path) as store:
        shared, pinned = store.layers
        assert shared.resident.num_rows >= config.rows_per_layer[first]
        assert pinned.resident.num_rows < 0.3 * config.rows_per_layer[second]
        assert torch.equal(store.read_raw(span), raw[span])
        for layer_id in config.layer_ids:
            lo, hi = ranges[layer_id]
            rows, at = store.in_place_rows(layer_id)
            assert torch.equal(rows[lo - at: hi - at], raw[lo:hi])


def test_a_rank_past_the_last_column_holds_nothing(table):
    path, config, _ = table
    columns = shard_columns(config, 31, 32)  # 24 columns: ranks 24..31 own none
    assert columns[0] == columns[1]
    with open_table(path, "memory", columns=columns) as store:
        assert dram_bytes(store) == 0 and store.read_raw([]).shape == (0, config.row_bytes)
        assert all(store.in_place_rows(i) is None for i in config.layer_ids)
        with pytest.raises(IndexError, match="columns"):
            store.read_raw([0])


def test_in_place_rows_of_whole_table_stores(table, tmp_path):
    path, config, raw = table
    layer = config.layer_ids[1]
    with open_table(path, "memory") as memory, open_table(path, "mmap") as mmap, \
            open_table(path, "shared", columns=(0, 6), shm_dir=tmp_path) as shared:
        rows, first = memory.in_place_rows(layer)
        assert first == 0 and torch.equal(rows, raw)
        assert isinstance(shared, TableStore)  # shared: still one whole copy a machine
        rows, first = shared.in_place_rows(layer)
        assert first == 0 and torch.equal(rows, raw) and dram_bytes(shared) == config.num_rows * config.row_bytes
        assert mmap.in_place_rows(layer) is None
        with pytest.raises(KeyError, match="not an Engram layer"):
            memory.in_place_rows(2)
    assert RowClient.in_place_rows is RowStore.in_place_rows  # a row server's rows are not this process's


def test_a_ranks_share_refuses_a_device(table):
    path, config, _ = table
    with pytest.raises(ValueError, match=r"^a rank's share of the memory tier serves host rows from this process: "
                                         r"drop device \(.*in_place_rows\)$"):
        open_table(path, "memory", columns=shard_columns(config, 0, 4), device="cpu")
