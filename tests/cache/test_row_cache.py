"""RowCache bookkeeping: pins block eviction, reservations hide half-written rows, admission."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload.cache import RowCache
from engram_offload.cache.row_cache import native_hitpath

RB = 8


def rows_for(ids: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((ids[:, None] * 7 + np.arange(RB)[None]).astype(np.uint8))


def test_fill_then_hit_returns_the_bytes():
    cache = RowCache(10 * RB, RB)
    ids = np.array([3, 9, 12], np.int64)
    assert cache.fill(ids, rows_for(ids)) == 3
    slots = cache.acquire(ids)
    assert (slots >= 0).all()
    out = torch.empty(3, RB, dtype=torch.uint8)
    cache.read(slots, out)
    assert torch.equal(out, rows_for(ids))
    cache.release(slots)
    cache.check()


def test_pinned_rows_are_never_evicted():
    cache = RowCache(4 * RB, RB, evict_batch=1)
    first = np.array([0, 1, 2, 3], np.int64)
    cache.fill(first, rows_for(first))
    pinned = cache.acquire(first[:2])  # a reader holds rows 0 and 1
    more = np.array([10, 11, 12], np.int64)
    cache.fill(more, rows_for(more))  # only 2 and 3 may make room
    assert 0 in cache and 1 in cache
    assert cache.pinned() == 2
    cache.release(pinned)
    cache.check()


def test_all_pinned_means_not_cached_rather_than_evicted():
    cache = RowCache(2 * RB, RB)
    ids = np.array([0, 1], np.int64)
    cache.fill(ids, rows_for(ids))
    held = cache.acquire(ids)
    assert cache.fill(np.array([5], np.int64), rows_for(np.array([5]))) == 0
    assert 0 in cache and 1 in cache and 5 not in cache
    cache.release(held)
    assert cache.fill(np.array([5], np.int64), rows_for(np.array([5]))) == 1


def test_reserved_rows_are_misses_until_published():
    cache = RowCache(4 * RB, RB)
    ids = np.array([7], np.int64)
    slots = cache.reserve(ids)
    assert slots[0] >= 0
    assert cache.acquire(ids)[0] == -1  # not yet written: a miss, never stale bytes
    assert cache.reserve(ids)[0] == -1  # and a second filler does not take it twice
    cache.write(slots, rows_for(ids))
    cache.publish(slots)
    got = cache.acquire(ids)
    assert got[0] == slots[0]
    cache.release(got)
    cache.check()


def test_abandoned_reservation_frees_the_slot():
    cache = RowCache(1 * RB, RB)
    slots = cache.reserve(np.array([4], np.int64))
    cache.abandon(slots)
    assert 4 not in cache and len(cache) == 0
    cache.check()


def test_admission_turns_away_one_off_rows_when_full():
    cache = RowCache(4 * RB, RB, policy="lfu", admission=True, admit_min=2, evict_batch=1)
    hot = np.array([0, 1, 2, 3], np.int64)
    for _ in range(3):
        got = cache.acquire(hot)
        cache.release(got)
        cache.fill(hot, rows_for(hot))
    cold = np.array([50], np.int64)
    cache.release(cache.acquire(cold))
    assert cache.fill(cold, rows_for(cold)) == 0  # seen once: not admitted into a full cache
    assert cache.rejected >= 1
    for _ in range(2):
        cache.release(cache.acquire(cold))
    assert cache.fill(cold, rows_for(cold)) == 1


def test_release_more_than_pinned_is_an_error():
    cache = RowCache(2 * RB, RB)
    ids = np.array([1], np.int64)
    cache.fill(ids, rows_for(ids))
    slots = cache.acquire(ids)
    cache.release(slots)
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(slots)


def test_too_small_cache_is_refused():
    with pytest.raises(ValueError, match="holds no"):
        RowCache(RB - 1, RB)


@pytest.mark.parametrize("index", ["hash", "direct"])
def test_both_index_kinds_serve_the_same_rows(index):
    cache = RowCache(8 * RB, RB, num_rows=100, index=index)
    ids = np.array([3, 17, 99], np.int64)
    assert cache.fill(ids, rows_for(ids)) == 3
    slots = cache.acquire(np.array([3, 50, 99], np.int64))
    assert slots[1] == -1 and (slots[[0, 2]] >= 0).all()
    out = torch.empty((2, RB), dtype=torch.uint8)
    cache.read(slots[[0, 2]], out)
    assert torch.equal(out, rows_for(np.array([3, 99], np.int64)))
    cache.release(slots)
    assert 17 in cache and 50 not in cache and 1000 not in cache and -1 not in cache
    cache.check()


def test_a_slot_being_filled_is_a_miss_until_published():
    cache = RowCache(4 * RB, RB)
    ids = np.array([7], np.int64)
    slots = cache.reserve(ids)
    assert cache.acquire(ids)[0] == -1
    cache.write(slots, rows_for(ids))
    cache.publish(slots)
    got = cache.acquire(ids)
    assert got[0] == slots[0]
    cache.release(got)
    assert cache.pinned() == 0


@pytest.fixture(params=["native", "numpy"])
def hit_path(request, monkeypatch):
    """Run a test through the C hit path (skipped when it is not built) and through NumPy."""
    if request.param == "numpy":
        monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    elif native_hitpath() is None:
        pytest.skip("cache._hitpath not built (or disabled)")
    return request.param


def slots_of(cache: RowCache, ids) -> np.ndarray:
    return cache.index.lookup(np.asarray(ids, np.int64))


def test_hits_are_pinned_until_released(hit_path):
    cache = RowCache(8 * RB, RB)
    assert cache.native is (hit_path == "native")
    ids = np.array([4, 5, 6], np.int64)
    cache.fill(ids, rows_for(ids))
    slots = cache.acquire(np.array([5, 6, 99], np.int64))
    assert slots[2] == -1 and (slots[:2] == slots_of(cache, [5, 6])).all()
    assert cache.pins[slots_of(cache, [4, 5, 6])].tolist() == [0, 1, 1]
    again = cache.acquire(np.array([6], np.int64))
    assert cache.pins[again].tolist() == [2]
    cache.release(slots)
    cache.release(again)
    assert cache.pinned() == 0
    cache.check()


def test_lru_hits_make_rows_recent(hit_path):
    cache = RowCache(3 * RB, RB, "lru", evict_batch=1)
    ids = np.array([1, 2, 3], np.int64)
    cache.fill(ids, rows_for(ids))
    before = cache.policy.stamp[slots_of(cache, [1])][0]
    cache.release(cache.acquire(np.array([1], np.int64)))  # 1 is now the most recent; 2 the least
    assert cache.policy.stamp[slots_of(cache, [1])][0] > before
    assert cache.policy.stamp[slots_of(cache, [1])][0] > cache.policy.stamp[slots_of(cache, [3])][0]
    cache.fill(np.array([4], np.int64), rows_for(np.array([4], np.int64)))
    assert 2 not in cache and all(i in cache for i in (1, 3, 4))


def test_lfu_hits_count(hit_path):
    cache = RowCache(3 * RB, RB, "lfu", evict_batch=1)
    ids = np.array([1, 2, 3], np.int64)
    cache.fill(ids, rows_for(ids))
    for _ in range(3):
        cache.release(cache.acquire(np.array([1, 3], np.int64)))
    cache.release(cache.acquire(np.array([2, 3], np.int64)))
    assert cache.policy.count[slots_of(cache, [1, 2, 3])].tolist() == [4, 2, 5]
    cache.fill(np.array([4], np.int64), rows_for(np.array([4], np.int64)))
    assert 2 not in cache and all(i in cache for i in (1, 3, 4))


def test_lfu_starts_an_admitted_row_at_its_sketched_frequency(hit_path):
    """A row asked for often before it could be cached does not go first for being new."""
    cache = RowCache(3 * RB, RB, "lfu", admission=True, evict_batch=1)
    hot = np.array([50], np.int64)
    for _ in range(6):
        assert cache.acquire(hot)[0] == -1  # misses: the sketch counts them
    old = np.array([1, 2, 3], np.int64)
    cache.fill(old, rows_for(old))
    for _ in range(2):
        cache.release(cache.acquire(old))  # each old row: count 1 + 2 hits = 3
    estimate = int(cache.sketch.estimate(hot)[0])
    assert estimate >= 6
    cache.fill(hot, rows_for(hot))  # evicts an old row
    assert cache.policy.count[slots_of(cache, hot)].tolist() == [estimate]
    newer = np.array([60], np.int64)
    for _ in range(3):
        cache.acquire(newer)
    cache.fill(newer, rows_for(newer))  # evicts the least frequent: an old row, not the hot one
    assert 50 in cache and 60 in cache
