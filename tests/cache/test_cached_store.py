"""A store with cache levels: cached gathers equal uncached ones under any interleaving; misses fetch or raise."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_offload.cache import RowCache, build_levels
from engram_offload.engram.rows import decode_rows
from engram_offload.errors import TierError
from engram_offload.serving.dedup import dedup
from engram_offload.serving.store import TableStore

from cache_fakes import FakeTier, hammer, small_config

CONFIG = small_config()
RB = CONFIG.row_bytes


def make_store(tier: FakeTier, dram_rows: int = 64, fast_rows: int = 0, policy: str = "lru",
               admission: bool | None = None) -> TableStore:
    levels = build_levels(RB, dram_rows * RB, policy, fast_cache_bytes=fast_rows * RB,
                          fast_device="cpu", admission=admission)
    for level in levels:
        level.evict_batch = 1
    return TableStore(tier, CONFIG, levels)


def expected_raw(tier: FakeTier, ids) -> torch.Tensor:
    return tier.rows[torch.as_tensor(np.asarray(ids, np.int64).reshape(-1))]


def test_gather_matches_decoding_the_tier(fake_tier):
    store = make_store(fake_tier)
    ids = torch.tensor([[5, 9, 5], [100, 9, 3000]])
    for _ in range(2):  # cold, then warm
        got = store.gather(ids, torch.float32)
        assert got.shape == (2, 3, CONFIG.head_dim)
        want = decode_rows(expected_raw(fake_tier, ids), CONFIG.row_format, CONFIG.head_dim)
        assert torch.equal(got.reshape(-1, CONFIG.head_dim), want)
    s = store.stats()
    assert s["store"]["rows_requested"] == 12 and s["store"]["rows_unique"] == 8
    dram = s["levels"][0]
    assert dram["hits"] == 4 and dram["misses"] == 4 and dram["hit_rate"] == 0.5
    assert s["levels"][-1]["rows"] == 4  # the tier read each row once


def test_out_of_range_ids_raise(fake_tier):
    store = make_store(fake_tier)
    with pytest.raises(IndexError, match="out of range"):
        store.read_raw([0, CONFIG.num_rows])
    with pytest.raises(ValueError, match="sorted distinct"):
        store.fetch(np.array([3, 1], np.int64))


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.lists(st.integers(0, CONFIG.num_rows - 1), min_size=0, max_size=40), min_size=1, max_size=25),
    dram_rows=st.integers(1, 48),
    fast_rows=st.sampled_from([0, 4, 16]),
    policy=st.sampled_from(["lru", "lfu"]),
    hold=st.lists(st.booleans(), min_size=25, max_size=25),
)
def test_cached_equals_uncached_under_random_steps(steps, dram_rows, fast_rows, policy, hold):
    tier = FakeTier(CONFIG.num_rows, RB)
    store = make_store(tier, dram_rows, fast_rows, policy)
    leases = []
    for i, step in enumerate(steps):
        d = dedup(np.array(step, np.int64))
        lease = store.fetch(d.unique, hold=hold[i])
        assert torch.equal(lease.raw, expected_raw(tier, d.unique))
        if hold[i]:
            leases.append(lease)
        if len(leases) > 3:  # steps overlap: a few stay in flight
            leases.pop(0).release()
        for level in store.levels:
            level.check()
    for lease in leases:
        lease.release()
    assert all(level.pinned() == 0 for level in store.levels)


def test_concurrent_threads_read_the_right_bytes(fake_tier):
    store = make_store(fake_tier, dram_rows=40, fast_rows=8, policy="lfu")

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(150):
            ids = rng.zipf(1.3, size=rng.integers(1, 30)) % CONFIG.num_rows
            assert torch.equal(store.read_raw(ids), expected_raw(fake_tier, ids))

    hammer(worker, 4)
    for level in store.levels:
        level.check()
        assert level.pinned() == 0


def test_eviction_cannot_race_a_reader_between_lookup_and_copy(fake_tier):
    """Time of check / time of use: another thread evicts while a reader sits between its
    lookup and its copy. The reader's rows are pinned, so eviction skips them and the reader
    copies the right bytes; the evictor's rows become misses served by the tier. (The reader
    also asks for one uncached row: when every row hits, the C hit path copies them before
    the lookup lets go of the lock, and there is no such gap.)"""
    cache = RowCache(4 * RB, RB, evict_batch=1)
    store = TableStore(fake_tier, CONFIG, [cache])
    first = np.arange(4, dtype=np.int64)
    store.fetch(first, hold=False)  # cache now full with rows 0..3
    looked_up = threading.Barrier(2, timeout=10)
    evicted = threading.Barrier(2, timeout=10)
    result = {}

    def then_wait(lookup):
        def acquire_then_wait(*args):
            found = lookup(*args)
            if threading.current_thread().name == "reader" and not result.get("waited"):
                result["waited"] = True  # once (acquire_into may go through acquire_counted)
                looked_up.wait()  # the reader holds its slots ...
                evicted.wait()  # ... while the evictor runs
            return found
        return acquire_then_wait

    cache.acquire_counted = then_wait(cache.acquire_counted)  # the store's lookups
    cache.acquire_into = then_wait(cache.acquire_into)
    wanted = np.array([0, 1, 2, 3, 50], np.int64)

    def reader():
        result["raw"] = store.fetch(wanted, hold=False).raw

    def evictor():
        looked_up.wait()
        other = np.arange(100, 104, dtype=np.int64)
        result["other"] = store.fetch(other, hold=False).raw
        evicted.wait()

    threads = [threading.Thread(target=reader, name="reader"), threading.Thread(target=evictor, name="evictor")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert torch.equal(result["raw"], expected_raw(fake_tier, wanted))
    assert torch.equal(result["other"], expected_raw(fake_tier, np.arange(100, 104)))
    assert all(int(i) in cache for i in first)  # nothing pinned was evicted
    cache.check()


def test_a_miss_is_fetched_or_raises_never_zeros(fake_tier):
    store = make_store(fake_tier, dram_rows=8)
    ids = np.array([1, 2, 3], np.int64)
    fake_tier.fail_next = 1
    with pytest.raises(TierError, match="injected"):
        store.fetch(ids)
    for level in store.levels:
        assert len(level) == 0 and level.pinned() == 0  # nothing half-cached
    fake_tier.rows[ids] = 7  # whatever the failed read left behind, only tier bytes are served
    lease = store.fetch(ids)  # the next read works and caches
    assert (lease.raw == 7).all()
    lease.release()
    assert (store.read_raw(ids) == 7).all()  # now from the cache
    assert store.stats()["levels"][0]["hits"] == 3


def test_leases_pin_until_released(fake_tier):
    store = make_store(fake_tier, dram_rows=4)
    lease = store.fetch(np.arange(4, dtype=np.int64), hold=True)
    assert store.levels[0].pinned() == 4
    store.fetch(np.arange(10, 14, dtype=np.int64), hold=False)  # cannot evict the held rows
    assert all(i in store.levels[0] for i in range(4))
    lease.release()
    lease.release()
    store.fetch(np.arange(10, 14, dtype=np.int64), hold=False)
    assert all(i in store.levels[0] for i in range(10, 14))


def test_hot_rows_are_promoted_to_the_fast_level(fake_tier):
    store = make_store(fake_tier, dram_rows=32, fast_rows=4)
    ids = np.array([1, 2], np.int64)
    store.fetch(ids, hold=False)  # tier -> dram
    assert 1 not in store.levels[0] and 1 in store.levels[1]
    store.fetch(ids, hold=False)  # dram hit -> promoted
    assert 1 in store.levels[0]
    store.fetch(ids, hold=False)
    assert store.stats()["levels"][0]["hits"] == 2


def test_stats_table_renders(fake_tier):
    from engram_offload.cache.report import format_stats_table

    store = make_store(fake_tier, dram_rows=8, fast_rows=4)
    store.read_raw([1, 2, 1])
    store.read_raw([1, 2])
    text = format_stats_table(store.stats())
    assert "fast" in text and "dram" in text and "tier" in text and "unique 4" in text


@pytest.mark.parametrize("num_rows", [None, "table"])
def test_gather_with_many_or_few_repeats_and_every_hit_path(fake_tier, num_rows):
    levels = build_levels(RB, 64 * RB, "lfu", fast_cache_bytes=8 * RB, fast_device="cpu",
                          num_rows=CONFIG.num_rows if num_rows else None)
    store = TableStore(fake_tier, CONFIG, levels)
    few = np.array([[9, 2, 40], [33, 5, 7]], np.int64)  # no repeats: raw rows ordered before decoding
    many = np.array([[9, 9, 9], [2, 9, 2]], np.int64)  # mostly repeats: decoded rows expanded
    for ids in (few, many, few, few[:, :1], many):  # misses, partial hits, all hits in one level
        want = decode_rows(expected_raw(fake_tier, ids), CONFIG.row_format, CONFIG.head_dim)
        got = store.gather(ids)  # random bytes hold NaNs: compare bits
        assert torch.equal(got.view(torch.int32), want.reshape(*ids.shape, -1).view(torch.int32))
        assert torch.equal(store.read_raw(ids), expected_raw(fake_tier, ids))
    lease = store.fetch(np.array([2, 9], np.int64))
    assert torch.equal(lease.raw, expected_raw(fake_tier, [2, 9]))
    lease.release()
    for level in levels:
        level.check()
        assert level.pinned() == 0


def test_a_store_without_caches_reads_the_tier_directly(fake_tier):
    store = TableStore(fake_tier, CONFIG, [])
    ids = np.array([4, 1, 4], np.int64)
    assert torch.equal(store.read_raw(ids), expected_raw(fake_tier, ids))
    assert store.stats()["store"]["hit_rate"] == 0.0
