"""``open_table``: the store over a tier, decoding rows, counting, with and without caches."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.rows import decode_rows, encode_rows
from engram_offload.errors import TableFormatError
from engram_offload.serving.sharding import shard_columns, shard_rows
from engram_offload.serving.store import TableStore


@pytest.fixture
def v41_table(tmp_path):
    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(2e-5)
    x = torch.randn(config.num_rows, config.head_dim)  # [rows, 256]
    path = write_table(tmp_path / "v41.tbl", config, x)
    return path, config, encode_rows(x, config.row_format)


@pytest.mark.parametrize("tier", ["memory", "mmap", "direct"])
def test_gather_decodes_rows(v41_table, tier):
    path, config, raw = v41_table
    with open_table(path, tier) as store:
        assert store.config == config and store.num_rows == config.num_rows
        base = config.layer_row_base(config.layer_ids[1])
        ids = torch.tensor([[0, base], [base - 1, config.num_rows - 1]])  # [2, 2]
        rows = store.gather(ids, dtype=torch.bfloat16)
        assert rows.shape == (2, 2, 256) and rows.dtype == torch.bfloat16
        want = decode_rows(raw[ids.reshape(-1)], config.row_format, 256, torch.bfloat16)
        assert torch.equal(rows.reshape(4, 256), want)
        assert torch.equal(store.read_raw([3, 3]), raw[[3, 3]])
        stats = store.stats()
        assert stats["store"]["fetches"] == 2 and stats["store"]["rows_requested"] == 6
        assert stats["store"]["rows_unique"] == 5  # read_raw([3, 3]) reads row 3 once
        assert stats["tier"]["tier"] == tier and stats["tier"]["rows"] == 5
        assert stats["tier"]["bytes_read"] >= 5 * 264 and stats["table_bytes"] == path.stat().st_size


def test_cache_bytes_wraps_the_tier_in_a_cached_store(v41_table):
    path, config, raw = v41_table
    with open_table(path, "direct", cache_bytes=1 << 20, policy="lfu") as store:
        ids = torch.tensor([5, 7, 5])
        for _ in range(2):
            assert torch.equal(store.read_raw(ids), raw[ids])
        assert store.stats()["levels"][0]["hits"] == 2
    with pytest.raises(ValueError, match="unknown cache policy"):
        open_table(path, "mmap", cache_bytes=1 << 20, policy="fifo")


def test_unknown_tier_and_bad_files(v41_table, tmp_path):
    with pytest.raises(ValueError, match="unknown tier"):
        open_table(v41_table[0], "floppy")
    (tmp_path / "junk").write_bytes(b"hello world" * 100)
    with pytest.raises(TableFormatError):
        open_table(tmp_path / "junk")


def test_bad_ids(v41_table):
    with open_table(v41_table[0], "memory") as store:
        with pytest.raises(IndexError, match=f"row id {store.num_rows}"):
            store.gather(np.array([store.num_rows]))
        with pytest.raises(TypeError, match="integers"):
            store.gather(np.array([1.5]))
        assert store.gather([]).shape == (0, 256)


STORE_OPTIONS = [
    pytest.param("memory", {}, id="memory"),
    pytest.param("mmap", {}, id="mmap"),
    pytest.param("direct", {}, id="direct"),
    pytest.param("direct", {"cache_bytes": 64 * 264}, id="direct+dram"),
    pytest.param("mmap", {"cache_bytes": 64 * 264, "fast_cache_bytes": 8 * 264, "policy": "lfu"}, id="mmap+fast+dram"),
]


@pytest.mark.parametrize("tier,options", STORE_OPTIONS)
def test_every_store_gathers_empty_and_single_ids_alike(v41_table, tier, options):
    path, config, raw = v41_table
    with open_table(path, tier, **options) as store:
        for _ in range(2):  # cold, then (with caches) warm
            assert store.gather([]).shape == (0, 256)
            assert store.gather(np.array([], np.int64)).shape == (0, 256)
            assert store.read_raw([]).shape == (0, 264)
            one = store.gather(5)
            assert one.shape == (1, 256)
            assert torch.equal(one, decode_rows(raw[[5]], config.row_format, 256))
            assert store.gather(np.int64(5)).shape == (1, 256)
            assert store.gather(torch.tensor(5)).shape == (1, 256)


def test_caches_are_capped_at_the_table_size(v41_table):
    path, config, _ = v41_table
    table_bytes = config.num_rows * config.row_bytes
    with open_table(path, "mmap", cache_bytes=10 << 30, fast_cache_bytes=10 << 30) as store:
        assert [lv.capacity for lv in store.levels] == [config.num_rows, config.num_rows]
        assert all(lv.data.numel() == table_bytes for lv in store.levels)


def test_one_store_type_whatever_the_options(v41_table):
    path, _, _ = v41_table
    with open_table(path, "memory") as plain, open_table(path, "memory", cache_bytes=1 << 20) as cached:
        assert type(plain) is type(cached) is TableStore
        assert plain.device == cached.device == torch.device("cpu")  # where fetched rows are
        assert plain.levels == [] and [lv.name for lv in cached.levels] == ["dram"]
        plain.read_raw([1, 2, 1])
        cached.read_raw([1, 2, 1])
        for s in (plain.stats(), cached.stats()):
            assert s["store"]["rows_requested"] == 3 and s["store"]["rows_unique"] == 2
            assert s["levels"][-1]["level"] == "tier" and s["levels"][-1]["rows"] == 2
            assert s["tier"]["rows"] == 2  # the tier's own count: each row read once, counted once


# ---------------------------------------------------------------------- rows delivered to a device
DEVICE_STORES = [
    pytest.param("direct", {"cache_bytes": 40 * 264, "fast_cache_bytes": 16 * 264}, id="direct+hbm+dram"),
    pytest.param("mmap", {"fast_cache_bytes": 16 * 264, "policy": "lfu"}, id="mmap+hbm"),
    pytest.param("mmap", {"admission": True, "fast_cache_bytes": 16 * 264}, id="mmap+hbm+admission"),
    pytest.param("direct", {"cache_bytes": 40 * 264}, id="direct+dram, no hbm"),
    pytest.param("memory", {"fast_cache_bytes": 16 * 264}, id="memory over uva+hbm"),
    pytest.param("memory", {}, id="memory over uva"),
]


@pytest.mark.parametrize("tier,options", DEVICE_STORES)
def test_a_store_with_a_device_returns_the_tiers_rows_bit_for_bit(v41_table, tier, options):
    """Random steps with hits and misses in every level; the tracing sync checks that no
    staging buffer, HBM slot or result is touched before the work it depends on."""
    from tracing_sync import TracingSync

    path, config, raw = v41_table
    sync = TracingSync()
    rng = np.random.default_rng(7)
    hot = rng.choice(config.num_rows, 24, replace=False)
    with open_table(path, tier, device="cpu", sync=sync, staging_bytes=5 * 264, **options) as store:
        assert store.device == torch.device("cpu") and store.sync is sync
        for step in range(12):
            ids = np.r_[rng.choice(hot, 20), rng.integers(0, config.num_rows, 12)]
            with store.fetch(np.unique(ids), requested=ids.size) as lease:
                sync.wait("main", lease.ready)
                assert torch.equal(lease.raw, raw[np.unique(ids)]), f"step {step}"
            assert torch.equal(store.read_raw(ids), raw[ids])
        stats = store.stats()
        names = [lv["level"] for lv in stats["levels"]]
        assert names[-1] == "tier" and ("hbm" in names) == ("fast_cache_bytes" in options)
        assert stats["store"]["fetches"] == 24 and stats["levels"][-1]["rows"] > 0
        if store.hbm is not None:
            hbm = stats["levels"][0]
            assert hbm["hits"] > 0 and hbm["misses"] > 0 and hbm["rows"] == stats["store"]["rows_unique"]
            assert hbm["resident_rows"] == 16 and 0 < stats["store"]["hit_rate"] < 1
        if tier != "memory":  # rows left the host only from the staging ring's pinned buffers (ids from the upload ring's)
            from tracing_sync import upload_buffers
            ring = store._device_rows.ring
            rows_copied = [src for _, src in sync.copies if any(_within(src, b) for b in ring.buffers)]
            assert rows_copied and all(any(_within(src, b) for b in ring.buffers + upload_buffers(sync))
                                       for _, src in sync.copies)


def _within(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() <= start + buffer.numel()


def test_a_device_store_refuses_a_dram_cache_over_a_dram_table(v41_table):
    with pytest.raises(ValueError, match=r"^the memory tier holds the table in DRAM and the device reads it there: "
                                         r"drop cache_bytes \(fast_cache_bytes sizes the HBM cache\)$"):
        open_table(v41_table[0], "memory", device="cpu", cache_bytes=1 << 20)


def test_a_device_store_decodes_like_the_host_store(v41_table):
    path, config, raw = v41_table
    ids = torch.tensor([[0, 9], [config.num_rows - 1, 9]])
    with open_table(path, "mmap") as host, open_table(path, "direct", device="cpu", fast_cache_bytes=4 * 264) as dev:
        for _ in range(2):
            assert torch.equal(dev.gather(ids, torch.bfloat16), host.gather(ids, torch.bfloat16))
        assert dev.gather([]).shape == (0, 256) and dev.read_raw([]).shape == (0, 264)
        with pytest.raises(IndexError):
            dev.read_raw([config.num_rows])
        assert "hbm:4 rows" in repr(dev)


# ---------------------------------------------------------------------- column shards
@pytest.mark.parametrize("tier, options", [("memory", {}), ("mmap", {"cache_bytes": 1 << 20}),
                                           ("direct", {"cache_bytes": 1 << 20, "engine": "threads"})])
@pytest.mark.parametrize("world", [2, 5])  # C = 24: 12 + 12; 5 + 5 + 5 + 5 + 4 (the last rank fewer)
def test_a_sharded_store_serves_its_columns_rows_and_refuses_others(v41_table, tier, options, world):
    path, config, raw = v41_table
    rng = np.random.default_rng(world)
    with open_table(path, tier, **options) as whole:
        for rank in range(world):
            columns = shard_columns(config, rank, world)
            owned = shard_rows(config, columns)
            with open_table(path, tier, columns=columns, **options) as store:
                assert store.columns == columns and store.stats()["columns"] == list(columns)
                span = np.concatenate([np.arange(lo, hi) for lo, hi in owned.ranges])  # every row it owns
                ids = rng.choice(span, (7, 9))  # [7, 9] with repeats
                assert torch.equal(store.gather(ids), whole.gather(ids))
                assert torch.equal(store.read_raw(ids), raw[torch.from_numpy(ids.reshape(-1))])
                unique = np.unique(ids)
                with store.fetch(unique) as lease:
                    assert torch.equal(lease.raw, raw[torch.from_numpy(unique)])
                others = np.setdiff1d(np.arange(config.num_rows), span)
                outside = int(rng.choice(others))
                asks = ((store.gather, [span[0], outside]), (store.read_raw, [outside]),
                        (store.fetch, np.sort([span[0], outside])))
                for method, asked in asks:
                    with pytest.raises(IndexError, match=rf"row {outside} .*columns \[{columns[0]}, {columns[1]}\)"):
                        method(asked)
                for level in store.levels:  # the caches: sized for the shard, holding its rows only
                    assert level.capacity <= owned.num_rows and level.pinned() == 0
                    assert all(int(i) in level for i in unique) and not any(int(i) in level for i in others[:200])


def test_a_sharded_stores_caches_are_capped_at_the_shard(v41_table):
    path, config, _ = v41_table
    columns = shard_columns(config, 1, 4)
    with open_table(path, "mmap", cache_bytes=10 << 30, fast_cache_bytes=10 << 30, columns=columns) as store:
        assert [lv.capacity for lv in store.levels] == [shard_rows(config, columns).num_rows] * 2


def test_bad_columns_are_refused(v41_table):
    path, config, _ = v41_table
    with pytest.raises(ValueError, match="columns must satisfy"):
        open_table(path, "mmap", columns=(3, config.cols_per_layer + 1))


# ---------------------------------------------------------------------- fetch, decode, counters, repr
def test_fetch_leases_the_ids_it_was_given_and_counts_what_they_stand_for(v41_table):
    path, config, raw = v41_table
    with open_table(path, "mmap", cache_bytes=64 * 264) as store:
        for ids in ([1, 5, 9], np.array([2, 6, 7], np.int64)):  # a list, an array
            with store.fetch(ids, requested=10) as lease:
                assert lease.ids.tolist() == list(ids) and torch.equal(lease.raw, raw[list(ids)])
                assert store.levels[0].pinned() == 3  # held until released
            assert store.levels[0].pinned() == 0
        s = store.stats()["store"]
        assert (s["fetches"], s["rows_requested"], s["rows_unique"], s["unique_ratio"]) == (2, 20, 6, 0.3)
        store.read_raw([3, 3, 4])
        assert store.stats()["store"]["unique_ratio"] == 8 / 23
        store.reset_stats()
        s = store.stats()
        assert (s["store"]["fetches"], s["store"]["rows_requested"], s["store"]["rows_unique"]) == (0, 0, 0)
        assert s["store"]["unique_ratio"] == 1.0 and s["levels"][0]["rows"] == 0 and s["levels"][-1]["rows"] == 0
        assert s["store"]["hit_rate"] == 0.0 and s["table"] == str(path)
        store.read_raw([3])
        assert store.stats()["store"]["fetches"] == 1 and store.stats()["store"]["rows_requested"] == 1


def test_a_fetch_the_cache_serves_whole_holds_a_numpy_array_until_a_tensor_is_asked_for(v41_table):
    path, config, raw = v41_table
    ids = np.array([3, 8, 9], np.int64)
    with open_table(path, "mmap", cache_bytes=64 * 264) as store:
        store.fetch(ids, hold=False)  # misses: read and cached
        with store.fetch(ids) as lease:  # every row a hit
            assert isinstance(lease._raw, np.ndarray)  # no tensor made on the way
            assert np.array_equal(lease.host_raw, raw[ids].numpy())
            assert torch.equal(lease.raw, raw[ids]) and lease.raw is lease.raw
            assert store.levels[0].pinned() == 3
        assert store.stats()["levels"][0]["hits"] == 3
        got = store.decode(lease.host_raw, torch.float32, index=np.array([2, 0], np.int64), shape=(1, 2))
        assert got.shape == (1, 2, 256)
        assert torch.equal(got[0], decode_rows(raw[[9, 3]], config.row_format, 256, torch.float32))


def test_decode_takes_the_rows_an_index_names(v41_table):
    path, config, raw = v41_table
    with open_table(path, "memory") as store:
        rows = raw[[4, 8, 15]]
        index = np.array([2, 0, 2], np.int64)
        got = store.decode(rows, torch.bfloat16, index=index)
        assert got.shape == (3, 256) and got.dtype == torch.bfloat16
        assert torch.equal(got, decode_rows(rows[[2, 0, 2]], config.row_format, 256, torch.bfloat16))


@pytest.mark.parametrize("repeats", [1, 8], ids=["few repeats", "many repeats"])
def test_gather_decodes_to_the_dtype_asked_for_on_both_paths(v41_table, repeats):
    path, config, raw = v41_table
    ids = np.repeat(np.array([3, 9, 27], np.int64), repeats)  # unique/requested: 1 or 1/8
    with open_table(path, "mmap") as store:
        got = store.gather(ids, torch.bfloat16)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, decode_rows(raw[ids], config.row_format, 256, torch.bfloat16))


def test_repr_names_the_file_the_levels_the_tier_and_the_shard(v41_table):
    path, config, _ = v41_table
    with open_table(path) as plain, \
            open_table(path, "direct", cache_bytes=64 * 264, fast_cache_bytes=8 * 264) as cached, \
            open_table(path, "mmap", columns=(0, 12)) as shard, open_table(path, "memory", columns=(0, 12)) as share:
        assert repr(plain) == f"TableStore({str(path)!r}, [no cache] over MmapTier, rows=22,830)"
        assert repr(cached) == f"TableStore({str(path)!r}, [fast:8 rows, dram:64 rows] over DirectTier, rows=22,830)"
        assert repr(shard) == f"TableStore({str(path)!r}, [no cache] over MmapTier, rows=22,830, columns=(0, 12))"
        assert repr(share) == f"LayeredStore({str(path)!r}, 1=memory/14=memory, rows=22,830, columns=(0, 12))"
        bare = TableStore(plain.tier, config)  # no header: no file to name
        assert repr(bare) == "TableStore([no cache] over MmapTier, rows=22,830)"
        assert bare.stats()["table"] is None and plain.stats()["table"] == str(path)


def test_a_device_stores_hbm_level_is_wired_to_its_options(v41_table):
    from tracing_sync import TracingSync

    path, config, _ = v41_table
    sync = TracingSync()
    with open_table(path, "mmap", device="cpu", sync=sync, fast_cache_bytes=64 * 264, policy="lru",
                    admission=True) as store:
        hbm = store.hbm
        assert hbm.sync is sync and hbm.policy.name == "lru" and hbm.capacity == 64
        assert hbm.admission is not None and hbm.admission.width == 256  # 4 counters a row, at least 256
        assert store.stats()["levels"][0]["admission"] is True
    with open_table(path, "mmap", device="cpu", fast_cache_bytes=100 * 264) as store:
        assert store.hbm.admission is None and store.hbm.policy.name == "lfu"  # the default
    with open_table(path, "mmap", device="cpu", fast_cache_bytes=100 * 264, admission=True) as store:
        assert store.hbm.admission.width == 512
    with open_table(path, "mmap", device="cpu", fast_cache_bytes=10 << 30) as store:
        assert store.hbm.capacity == config.num_rows  # capped at the table


def test_a_device_store_holds_and_resets_what_it_says(v41_table):
    from tracing_sync import TracingSync

    path, config, raw = v41_table
    sync = TracingSync()
    with open_table(path, "direct", device="cpu", sync=sync, cache_bytes=40 * 264, fast_cache_bytes=16 * 264,
                    staging_bytes=5 * 264) as store:
        assert [b.numel() for b in store._device_rows.ring.buffers] == [5 * 264] * len(store._device_rows.ring.buffers)
        ids = np.array([2, 11, 40], np.int64)
        lease = store.fetch(ids)  # misses: read through the DRAM level and staged
        assert lease.ready is not None  # the rows are the device's after the staging copy
        assert store.levels[0].pinned() == 3  # the DRAM level holds them for the lease
        lease.release()
        assert store.levels[0].pinned() == 0
        store.read_raw(ids)  # hits in the HBM level now
        assert store.stats()["levels"][0]["hits"] == 3
        store.reset_stats()
        assert store.stats()["levels"][0]["rows"] == 0 and store.stats()["store"]["fetches"] == 0


def test_a_device_reads_a_dram_table_in_place(v41_table):
    from tracing_sync import TracingSync

    path, config, raw = v41_table
    sync = TracingSync()
    with open_table(path, "memory", device="cpu", sync=sync) as store:
        assert store._device_rows.ring is None
        with store.fetch(np.array([1, 5, 9], np.int64)) as lease:
            sync.wait("main", lease.ready)
            assert torch.equal(lease.raw, raw[[1, 5, 9]])
        from tracing_sync import upload_buffers
        # nothing staged: the device read the table where it is (only the ids were uploaded)
        assert all(any(_within(src, b) for b in upload_buffers(sync)) for _, src in sync.copies)
        tier = store.stats()["levels"][-1]
        assert (tier["rows"], tier["hits"], tier["bytes_read"], tier["read_seconds"]) == (3, 0, 3 * 264, 0.0)


def test_a_closed_store_refuses_reads(v41_table):
    store = open_table(v41_table[0], "mmap")
    store.close()
    with pytest.raises(ValueError, match=r"^this store is closed: open the table again$"):
        store.read_raw([1])


def test_open_table_passes_tier_options_and_admission_on(v41_table, tmp_path):
    path, config, _ = v41_table
    with open_table(path, "direct", engine="threads") as store:
        assert store.stats()["tier"]["engine"] == "threads"
    with open_table(path, "mmap", cache_bytes=64 * 264, fast_cache_bytes=8 * 264, admission=True) as store:
        assert [lv.sketch is not None for lv in store.levels] == [True, True]
    with open_table(path, "mmap", cache_bytes=64 * 264) as store:
        assert store.levels[0].sketch is None  # admission is off by default
    with pytest.raises(ValueError, match=r"^redis://127\.0\.0\.1:1/abc is a pool URL: open it with tier='remote'$"):
        open_table("redis://127.0.0.1:1/abc", "mmap")


def test_every_level_counts_every_fetch_and_only_what_it_served(v41_table):
    """All hits in the first level: the levels below count the fetch, with nothing asked of them."""
    path, config, raw = v41_table
    with open_table(path, "mmap", cache_bytes=64 * 264, fast_cache_bytes=8 * 264) as store:
        ids = np.array([3, 4, 5], np.int64)
        store.read_raw(ids)  # misses: filled into the DRAM level
        store.read_raw(ids)  # DRAM hits: promoted into the fast level
        store.reset_stats()
        start = time.perf_counter()
        assert torch.equal(store.read_raw(ids), raw[ids])
        elapsed = time.perf_counter() - start
        fast, dram, tier = store.stats()["levels"]
        assert (fast["requests"], fast["rows"], fast["hits"], fast["bytes_read"]) == (1, 3, 3, 3 * 264)
        assert 0 < fast["read_seconds"] <= elapsed
        assert (dram["requests"], dram["rows"], dram["hits"], dram["bytes_read"], dram["read_seconds"]) == (1, 0, 0, 0, 0.0)
        assert tier["rows"] == 0


def test_a_tier_failure_after_some_hits_lets_go_of_every_pin(v41_table):
    from engram_offload.errors import TierError

    path, config, raw = v41_table
    with open_table(path, "mmap", cache_bytes=64 * 264, fast_cache_bytes=8 * 264) as store:
        store.read_raw([1, 2])  # cached in the DRAM level,
        store.read_raw([1, 2])  # then promoted into the fast one
        with store.fetch(np.array([1, 2], np.int64), hold=False) as lease:  # all hits, nothing held
            assert torch.equal(lease.raw, raw[[1, 2]]) and store.levels[0].pinned() == 0
        real = store.tier.read_rows

        def failing(ids, out):
            raise TierError("disk went away")

        store.tier.read_rows = failing
        with pytest.raises(TierError, match="disk went away"):
            store.fetch(np.array([1, 2, 30], np.int64))  # two hits in the fast level, one miss everywhere
        assert [lv.pinned() for lv in store.levels] == [0, 0]
        store.tier.read_rows = real
        with store.fetch(np.array([1, 2, 30], np.int64)) as lease:
            assert torch.equal(lease.raw, raw[[1, 2, 30]])


def test_one_cache_level_with_some_misses_keeps_its_pins_straight(v41_table):
    """The single-level path (native calls, NumPy buffers): hits and misses in one fetch come
    back in order, held pins last until the lease goes, and a tier failure lets go of the
    hits' pins."""
    from engram_offload.errors import TierError

    path, config, raw = v41_table
    with open_table(path, "mmap", cache_bytes=64 * 264) as store:
        level = store.levels[0]
        store.read_raw([3, 9])
        with store.fetch(np.array([1, 3, 9, 40], np.int64)) as lease:  # 2 hits, 2 misses, held
            assert torch.equal(lease.raw, raw[[1, 3, 9, 40]])
            assert level.pinned() == 4  # the hits' pins taken over, the filled slots pinned
        assert level.pinned() == 0 and 40 in level and 1 in level
        assert torch.equal(store.read_raw([40, 2, 1]), raw[[40, 2, 1]])  # not held: no pin left
        assert level.pinned() == 0
        store.tier.read_rows = lambda ids, out: (_ for _ in ()).throw(TierError("disk went away"))
        with pytest.raises(TierError, match="disk went away"):
            store.fetch(np.array([1, 3, 50], np.int64))
        assert level.pinned() == 0 and 50 not in level
        level.check()


def test_the_store_refuses_levels_that_do_not_fit_the_table(v41_table):
    from engram_offload.cache import RowCache

    path, config, _ = v41_table
    with open_table(path, "mmap") as store, open_table(path, "mmap", device="cpu") as on_device:
        with pytest.raises(ValueError, match=r"^the tier's rows are 264 bytes, the config's 66$"):
            TableStore(store.tier, config.replace(head_dim=64))
        with pytest.raises(ValueError, match=r"^cache 'dram' holds 100-byte rows, the table has 264$"):
            TableStore(store.tier, config, [RowCache(800, 100)])
        with pytest.raises(ValueError, match=r"^with a device the fast level is the HBM cache: give only host \(DRAM\) "
                                             r"levels$"):
            TableStore(store.tier, config, [RowCache(4 * 264, 264, device="meta")], device_rows=on_device._device_rows)


def test_three_levels_walk_fill_and_count(v41_table):
    """Rows missed above and found below are promoted; a level below every row's finder is
    asked nothing and counts just the fetch; each level counts the bytes it served."""
    from engram_offload.cache import RowCache

    path, config, raw = v41_table
    with open_table(path, "mmap") as plain:
        levels = [RowCache(8 * 264, 264, name=n) for n in ("a", "b", "c")]
        store = TableStore(plain.tier, config, levels)
        levels[1].fill(np.array([4, 5], np.int64), raw[[4, 5]])  # b holds 4 and 5; a and c nothing
        levels[2].fill(np.array([6], np.int64), raw[[6]])  # c holds 6
        start = time.perf_counter()
        with store.fetch(np.array([4, 5, 9], np.int64)) as lease:  # 4, 5 from b; c is asked for 9 only
            assert torch.equal(lease.raw, raw[[4, 5, 9]])
        elapsed = time.perf_counter() - start
        a, b, c, tier = store.stats()["levels"]
        assert (a["rows"], a["hits"], b["rows"], b["hits"], b["bytes_read"]) == (3, 0, 3, 2, 2 * 264)
        assert (c["rows"], c["hits"], tier["rows"], tier["hits"], tier["bytes_read"]) == (1, 0, 1, 0, 264)
        assert all(0 <= lv["read_seconds"] <= elapsed for lv in (a, b, c, tier))
        assert 4 in levels[0] and 5 in levels[0] and 9 in levels[2] and 9 not in levels[0]
        store.reset_stats()
        with store.fetch(np.array([4, 5, 9], np.int64)) as lease:  # 4, 5 from a, 9 from c: b is asked for 9
            assert torch.equal(lease.raw, raw[[4, 5, 9]])
        store.reset_stats()
        levels[1].fill(np.array([9], np.int64), raw[[9]])
        with store.fetch(np.array([7, 9], np.int64)) as lease:  # 9 from b, 7 from the tier: c asked for 7
            assert torch.equal(lease.raw, raw[[7, 9]])
        store.reset_stats()
        with store.fetch(np.array([9, 6], np.int64)[::-1].copy()) as lease:  # 6 in c, 9 in a now
            assert torch.equal(lease.raw, raw[[6, 9]])
        a, b, c, tier = store.stats()["levels"]
        assert (a["hits"], b["rows"], c["rows"], c["hits"], tier["rows"]) == (1, 1, 1, 1, 0)
        levels[2].fill(np.array([11], np.int64), raw[[11]])
        levels[1].fill(np.array([12], np.int64), raw[[12]])
        store.reset_stats()
        with store.fetch(np.array([12, 13], np.int64)) as lease:  # 12 from b, 13 from the tier
            assert torch.equal(lease.raw, raw[[12, 13]])
        store.reset_stats()
        with store.fetch(np.array([12], np.int64)) as lease:  # promoted into a: b and c asked nothing
            assert torch.equal(lease.raw, raw[[12]])
        a, b, c, tier = store.stats()["levels"]
        assert [(lv["requests"], lv["rows"], lv["hits"], lv["bytes_read"], lv["read_seconds"]) for lv in (b, c)] \
            == [(1, 0, 0, 0, 0.0)] * 2
        with store.fetch(np.array([0, 11], np.int64)) as lease:  # 11 found in c, b asked for both, c for both
            assert torch.equal(lease.raw, raw[[0, 11]])
        levels[1].fill(np.array([20], np.int64), raw[[20]])
        store.reset_stats()
        start = time.perf_counter()
        with store.fetch(np.array([12, 20], np.int64)) as lease:  # 12 from a, 20 from b: c is asked nothing
            assert torch.equal(lease.raw, raw[[12, 20]])
        elapsed = time.perf_counter() - start
        a, b, c, tier = store.stats()["levels"]
        assert (a["hits"], b["rows"], b["hits"], b["bytes_read"]) == (1, 1, 1, 264)
        assert (c["requests"], c["rows"], c["hits"], c["bytes_read"], tier["rows"]) == (1, 0, 0, 0, 0)
        assert 0 <= c["read_seconds"] <= elapsed
        assert 20 in levels[0]  # promoted past the level asked nothing
        for level in levels:
            assert level.pinned() == 0
            level.check()


def test_a_single_missed_row_is_cached_and_a_failed_write_gives_its_slots_back(v41_table):
    path, config, raw = v41_table
    with open_table(path, "mmap", cache_bytes=8 * 264) as store:
        assert store.fetch([]).raw.dtype == torch.uint8 and store.fetch([]).ready is None
        store.read_raw([7])
        store.read_raw([7])
        assert store.stats()["levels"][0]["hits"] == 1
        with store.fetch(np.array([7], np.int64)) as lease:
            assert lease.ready is None  # on the host: the rows are there when fetch returns
        level = store.levels[0]

        def broken(slots, rows, positions=None):
            raise MemoryError("no room for the copy")

        level.write = broken
        with pytest.raises(MemoryError, match="no room for the copy"):
            store.read_raw([8])
        assert level.pinned() == 0 and 8 not in level
        level.check()


def test_fetch_latencies_are_those_of_the_calls(v41_table):
    path, config, _ = v41_table
    with open_table(path, "mmap") as store:
        start = time.perf_counter()
        for i in range(5):
            store.read_raw([i])
        elapsed_ms = (time.perf_counter() - start) * 1e3
        s = store.stats()
        assert all(0 < s["store"][k] <= elapsed_ms for k in ("fetch_p50_ms", "fetch_p90_ms", "fetch_p99_ms"))
        tier = s["levels"][-1]
        assert (tier["rows"], tier["hits"], tier["bytes_read"]) == (5, 0, 5 * 264) and 0 < tier["read_seconds"] * 1e3 <= elapsed_ms


def test_a_row_server_store_refuses_every_local_option_it_is_given(v41_table, tmp_path):
    """Checked before the server is asked: no server needs to listen on the socket."""
    from engram_offload.gpu import ImmediateSync

    with pytest.raises(ValueError, match=r"^the row server owns the tier and the cache: drop cache_bytes, device, "
                                         r"fast_cache_bytes, sync \(size the server's cache with "
                                         r"start_row_server\(\.\.\., cache_bytes=\)\)$"):
        open_table(v41_table[0], "direct", row_server=tmp_path / "none.sock", cache_bytes=1 << 20,
                   fast_cache_bytes=1 << 20, device="cpu", sync=ImmediateSync())


def test_a_fetch_in_place_leaves_the_rows_a_cache_holds_where_it_holds_them(v41_table):
    """``fetch(in_place=True)``: rows the first cache holds every one of stay in its arena,
    pinned, and the lease names them (a decoder reads them there; ``host_raw`` copies them out
    while pinned); one miss and the rows come as a copy, as without it."""
    path, config, raw = v41_table
    ids = np.array([3, 8, 9], np.int64)
    with open_table(path, "mmap", cache_bytes=64 * 264) as store:
        level = store.levels[0]
        store.fetch(ids, hold=False)  # misses: read and cached
        lease = store.fetch(ids, in_place=True)  # every row a hit
        rows = lease.in_place
        assert rows is not None and rows.arena.ctypes.data == level.host_rows.ctypes.data
        assert np.array_equal(rows.arena[rows.slots], raw[ids].numpy()) and level.pinned() == 3
        assert store.stats()["levels"][0]["hits"] == 3
        got = store.decode(rows.arena, torch.float32, index=np.array([[2, 0]], np.int64), shape=(1, 2),
                           slots=rows.slots)
        assert torch.equal(got[0], decode_rows(raw[[9, 3]], config.row_format, 256, torch.float32))
        lease.release()
        assert level.pinned() == 0
        with pytest.raises(RuntimeError, match="^this lease was released: its rows, left in the cache, may be gone"):
            _ = lease.host_raw
        with store.fetch(ids, in_place=True) as lease:
            assert np.array_equal(lease.host_raw, raw[ids].numpy()) and torch.equal(lease.raw, raw[ids])
        with store.fetch(np.array([3, 9, 40], np.int64), in_place=True) as lease:  # one miss: a copy
            assert lease.in_place is None and torch.equal(lease.raw, raw[[3, 9, 40]])
            assert level.pinned() == 3
        assert level.pinned() == 0
        with pytest.raises(ValueError, match=r"^fetch\(in_place=True\) needs hold=True"):
            store.fetch(ids, hold=False, in_place=True)
        level.check()


def test_a_fetch_in_place_without_a_host_cache_copies_as_before(v41_table):
    path, config, raw = v41_table
    with open_table(path, "memory") as store, store.fetch(np.array([2, 5], np.int64), in_place=True) as lease:
        assert lease.in_place is None and torch.equal(lease.raw, raw[[2, 5]])
