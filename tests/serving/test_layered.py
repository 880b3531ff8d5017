"""Per-layer placements: each Engram layer of a real table file on its own tier."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.rows import encode_rows
from engram_offload.pool.publish import publish_table
from engram_offload.serving.layered import LayeredStore, dram_bytes, parse_placement, placement_text, window_header
from engram_offload.table import read_header

from redis_servers import redis_single, skip_without_redis  # noqa: F401 (fixtures)

LOCAL_TIERS = ("memory", "pinned", "shared", "mmap", "direct")
TIERS = (*LOCAL_TIERS, "remote")


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(2e-5)  # layers 1 and 14
    x = torch.randn(config.num_rows, config.head_dim)  # [rows, 256]
    path = write_table(tmp_path_factory.mktemp("layered") / "v41.tbl", config, x)
    return path, config, encode_rows(x, config.row_format)


@pytest.fixture(scope="module")
def pool_url(table, redis_single):  # noqa: F811 (the fixture)
    publish_table(table[0], redis_single.url, extent_rows=97, progress=False)
    return redis_single.url


def _edges_and_random(config: EngramConfig, seed: int) -> np.ndarray:
    """Both layers' first and last rows, then random ids over the whole table (repeats included)."""
    edges = []
    for layer in config.layer_ids:
        base = config.layer_row_base(layer)
        edges += [base, base + config.rows_per_layer[layer] - 1]
    rng = np.random.default_rng(seed)
    return np.concatenate([np.array(edges, np.int64), rng.integers(0, config.num_rows, 3000)])


@pytest.mark.parametrize("first,second", list(itertools.product(TIERS, TIERS)))
def test_a_layered_store_returns_the_rows_of_memory(table, request, tmp_path, first, second):
    path, config, raw = table
    options = {"shm_dir": tmp_path} if "shared" in (first, second) else {}
    if "remote" in (first, second):
        skip_without_redis()
        options["pool"] = request.getfixturevalue("pool_url")
    spec = f"{config.layer_ids[0]}={first}/{config.layer_ids[1]}={second}"
    ids = _edges_and_random(config, seed=len(spec))
    with pytest.warns(RuntimeWarning) if "pinned" in (first, second) and not torch.cuda.is_available() \
            else _nothing(), open_table(path, spec, cache_bytes=20 * config.row_bytes, **options) as store, \
            open_table(path, "memory") as memory:
        assert isinstance(store, LayeredStore)
        assert torch.equal(store.read_raw(ids), raw[ids])
        assert torch.equal(store.read_raw(ids), memory.read_raw(ids))  # again: through warm caches
        assert torch.equal(store.gather(ids.reshape(-1, 4), torch.bfloat16),
                           memory.gather(ids.reshape(-1, 4), torch.bfloat16))
        unique = np.unique(ids)
        with store.fetch(unique) as lease:
            assert torch.equal(lease.raw, raw[unique])
        stats = store.stats()
        assert stats["placement"] == spec and set(stats["layers"]) == {str(i) for i in config.layer_ids}
        assert stats["store"]["fetches"] == 4 and stats["store"]["rows_requested"] == 3 * ids.size + unique.size
        for layer in config.layer_ids:
            own = stats["layers"][str(layer)]
            in_layer = (unique >= own["row_base"]) & (unique < own["row_base"] + own["rows"])
            assert own["rows"] == config.rows_per_layer[layer]
            assert own["store"]["rows_unique"] == 4 * in_layer.sum()  # read_raw twice, gather, fetch


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_resident_layer_loads_only_its_slice_and_the_cache_goes_to_the_other(table):
    path, config, raw = table
    first, second = config.layer_ids
    rb = config.row_bytes
    with open_table(path, {first: "memory", second: "direct"}, cache_bytes=10**9) as store:
        resident, cached = store.layers
        assert resident.store.levels == [] and resident.resident is not None
        # its slice widened to whole pages: at most one page of rows more at each end
        rpp = read_header(path).layout.rows_per_page
        assert config.rows_per_layer[first] <= resident.resident.num_rows <= config.rows_per_layer[first] + 2 * rpp
        assert resident.resident.num_rows < config.num_rows
        # the cache budget (capped at the layer's rows) goes to the direct layer only
        assert [lv.capacity for lv in cached.store.levels] == [config.rows_per_layer[second]]
        assert dram_bytes(store) == (resident.resident.num_rows + config.rows_per_layer[second]) * rb
        assert store.stats()["dram_bytes"] == dram_bytes(store)
    with open_table(path, "memory") as memory:
        assert dram_bytes(memory) == config.num_rows * rb


def test_two_layers_on_direct_share_one_cache_budget_by_their_rows(table):
    path, config, _ = table
    first, second = config.layer_ids
    budget = 1000 * config.row_bytes
    with open_table(path, f"{first}=direct/{second}=direct", cache_bytes=budget) as store:
        caps = [lay.store.levels[0].capacity for lay in store.layers]
        assert sum(caps) <= 1000 and sum(caps) >= 998
        assert len({id(lay.store.tier.tier) for lay in store.layers}) == 1  # one descriptor, one tier


def test_a_window_header_covers_whole_pages_and_its_own_fingerprint(table):
    path, config, _ = table
    header = read_header(path)
    rpp = header.layout.rows_per_page
    window = window_header(header, rpp + 1, 3 * rpp - 1)
    assert window.first_row == rpp and window.layout.num_rows == 2 * rpp
    assert window.layout.data_offset == header.layout.data_offset + header.layout.page_bytes
    assert np.array_equal(window.page_sums, header.page_sums[1:3])
    assert window.fingerprint() != header.fingerprint()
    with pytest.raises(ValueError, match="not a slice"):
        window_header(header, 5, config.num_rows + 1)


@pytest.mark.parametrize("spec,message", [
    ("1=memory", "misses layer(s) 14"),
    ({1: "memory"}, "misses layer(s) 14"),
    ("1=memory/14=nvme", "unknown tier 'nvme' for layer 14"),
    ("1=memory/14=direct/2=mmap", "names layer(s) 2 the table does not have"),
    ("1=memory/1=direct", "layer 1 is named twice"),
    ("1=memory/direct", "'direct' is not LAYER=TIER"),
    ("one=memory/14=direct", "layer 'one' is not a layer id"),
    ({1: ["memory"], 14: "direct"}, "unknown tier ['memory'] for layer 1"),
])
def test_a_bad_placement_is_refused_in_one_line(table, spec, message):
    path, _, _ = table
    with pytest.raises(ValueError) as info:
        open_table(path, spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_placement_refuses_what_it_cannot_serve(table):
    path, _, _ = table
    with pytest.raises(ValueError, match="drop device"):
        open_table(path, "1=memory/14=direct", device="cpu")
    with pytest.raises(ValueError, match="takes option"):
        open_table(path, "1=memory/14=memory", queue_depth=8)


def test_placement_text_round_trips():
    assert parse_placement("14=direct/1=memory") == {14: "direct", 1: "memory"}
    assert placement_text({14: "direct", 1: "memory"}) == "1=memory/14=direct"
    assert parse_placement({1: "shared", 14: "remote"}, (1, 14)) == {1: "shared", 14: "remote"}


def test_a_closed_layered_store_refuses_reads(table):
    path, _, _ = table
    store = open_table(path, "1=memory/14=direct")
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.read_raw([0])


def test_a_fetch_in_place_of_one_cached_layer_leaves_its_rows_in_that_layers_cache(table):
    """Ids of one layer: its store's rows left where its cache holds them (the arena's slots,
    the layer's own); ids of both layers: one copy, as without ``in_place``."""
    path, config, raw = table
    first, second = config.layer_ids
    base = config.layer_row_base(second)
    ids = np.array([base, base + 5, base + 9], np.int64)
    with open_table(path, {first: "memory", second: "direct"}, cache_bytes=10**9) as store:
        cache = store.layers[1].store.levels[0]
        store.fetch(ids, hold=False)  # read and cached
        with store.fetch(ids, in_place=True) as lease:
            rows = lease.in_place
            assert rows is not None and rows.arena.ctypes.data == cache.host_rows.ctypes.data
            assert np.array_equal(rows.arena[rows.slots], raw[ids].numpy()) and cache.pinned() == 3
        assert cache.pinned() == 0
        both = np.array([1, *ids], np.int64)
        with store.fetch(both, in_place=True) as lease:
            assert lease.in_place is None and torch.equal(lease.raw, raw[both])
        with pytest.raises(ValueError, match=r"^fetch\(in_place=True\) needs hold=True"):
            store.fetch(ids, hold=False, in_place=True)
