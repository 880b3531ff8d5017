"""RowCache bookkeeping: pins block eviction, reservations hide half-written rows, admission."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from engram_offload.cache import RowCache
from engram_offload.cache.row_cache import native_hitpath

from cache_fakes import ROW_BYTES, rows_for

RB = ROW_BYTES


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
    assert 17 in cache and 50 not in cache and 100 not in cache and 1000 not in cache and -1 not in cache
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


# ---------------------------------------------------------------------- configuration, counters, checks
def test_describe_reports_the_level_its_layout_and_its_counters():
    cache = RowCache(4 * RB + 3, RB, "lfu", admission=True, evict_batch=1, num_rows=10, index="hash", name="fast")
    want = {"level": "fast", "device": "cpu", "capacity_rows": 4, "capacity_bytes": 4 * RB, "resident_rows": 0,
            "evictions": 0, "rejected": 0, "admission": True, "index": "RowIndex", "policy": "lfu",
            "aging_period": cache.policy.aging_period}
    assert cache.describe() == want
    assert cache.stats.as_dict()["level"] == "fast"
    plain = RowCache(2 * RB, RB, num_rows=20)  # the defaults: LFU, no admission, a "dram" level, auto index
    assert plain.describe() == {"level": "dram", "device": "cpu", "capacity_rows": 2, "capacity_bytes": 2 * RB,
                                "resident_rows": 0, "evictions": 0, "rejected": 0, "admission": False,
                                "index": "DirectIndex", "policy": "lfu", "aging_period": plain.policy.aging_period}
    assert RowCache(2 * RB, RB, "lru", num_rows=20).describe()["policy"] == "lru"
    assert plain.stats.as_dict()["level"] == "dram"
    for round_ in range(1, 4):  # counters add up over calls
        ids = np.arange(3, dtype=np.int64) + 3 * round_
        assert plain.fill(ids, rows_for(ids)) == 2  # two slots: one of the three is turned away
        d = plain.describe()
        assert (d["resident_rows"], d["evictions"], d["rejected"]) == (2, 2 * (round_ - 1), round_)


def test_unknown_policy_names_are_refused():
    with pytest.raises(ValueError, match=r"^unknown cache policy 'fifo'; choose one of: lru, lfu$"):
        RowCache(4 * RB, RB, "fifo")


@pytest.mark.parametrize("capacity, batch", [(10, 1), (128, 2), (640, 10)])
def test_a_full_cache_frees_a_64th_of_its_slots_at_a_time_by_default(capacity, batch):
    cache = RowCache(capacity * RB, RB)
    ids = np.arange(capacity, dtype=np.int64)
    assert cache.fill(ids, rows_for(ids)) == capacity
    assert cache.evict_batch == batch
    assert cache.fill(np.array([capacity], np.int64), rows_for(np.array([capacity]))) == 1
    assert cache.evictions == batch and len(cache) == capacity - batch + 1
    assert capacity in cache and sum(i in cache for i in range(capacity)) == capacity - batch
    cache.check()


def test_eviction_frees_only_what_the_new_rows_need_beyond_the_free_slots():
    cache = RowCache(4 * RB, RB, evict_batch=1)
    old = np.array([1, 2, 3], np.int64)
    cache.fill(old, rows_for(old))  # one slot still free
    new = np.array([7, 8, 9], np.int64)
    assert cache.fill(new, rows_for(new)) == 3
    assert cache.evictions == 2 and len(cache) == 4
    assert 3 in cache and 1 not in cache and 2 not in cache
    cache.check()


def test_rows_turned_away_for_want_of_unpinned_slots_are_counted():
    cache = RowCache(2 * RB, RB)
    first = np.array([0], np.int64)
    cache.fill(first, rows_for(first))
    held = cache.acquire(first)  # one slot pinned, one free
    got = cache.reserve(np.array([5, 6, 7], np.int64))
    assert got.dtype == np.int64 and (got >= 0).tolist() == [True, False, False]
    assert cache.rejected == 2 and cache.evictions == 0
    cache.abandon(got)
    cache.acquire(np.array([0], np.int64))  # pinned twice now; the other slot stays free
    taken = cache.reserve(np.array([8, 9], np.int64))
    assert (taken >= 0).tolist() == [True, False] and cache.rejected == 3
    cache.abandon(taken)
    cache.release(held)
    cache.release(held)
    cache.check()


def test_admission_gives_the_free_slots_to_rows_it_would_turn_away():
    """Admission filters only what would need an eviction: free slots take infrequent rows too."""
    cache = RowCache(4 * RB, RB, admission=True, evict_batch=1)
    old = np.array([1, 2, 3], np.int64)
    cache.fill(old, rows_for(old))  # not full: no admission check
    cold = np.array([50, 51], np.int64)  # never asked for: estimate 0
    assert cache.reserve(cold).tolist()[1] == -1
    assert len(cache) == 4 and 50 in [int(i) for i in cache.slot_id] and cache.rejected == 1
    assert cache.evictions == 0


@pytest.mark.parametrize("admit_min", [None, 3])
def test_a_full_cache_admits_a_row_once_it_was_asked_for_admit_min_times(admit_min):
    need = admit_min or 2  # the default
    cache = RowCache(2 * RB, RB, admission=True, evict_batch=1, **({} if admit_min is None else {"admit_min": admit_min}))
    full = np.array([0, 1], np.int64)
    cache.fill(full, rows_for(full))
    cold = np.array([50], np.int64)
    for seen in range(1, need + 1):
        assert cache.acquire(cold)[0] == -1  # a miss, which the sketch counts
        assert int(cache.sketch.estimate(cold)[0]) == seen
        assert cache.fill(cold, rows_for(cold)) == (seen == need)
    assert cache.rejected == need - 1 and 50 in cache


@pytest.mark.parametrize("capacity, width", [(1, 256), (64, 256), (65, 512), (1000, 4096)])
def test_the_admission_sketch_has_four_counters_a_row_and_at_least_256(capacity, width):
    assert RowCache(capacity * RB, RB, admission=True).sketch.width == width


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_slots_policy_state_and_pins_share_one_aligned_record(policy):
    """The hit path writes a slot's stamp, count and pins: one 32-byte record per slot, records
    starting on a 64-byte cache line (for every capacity, whatever the allocator returns)."""
    for capacity in range(1, 65):
        cache = RowCache(capacity * RB, RB, policy)
        stamp = cache.policy.stamp
        assert stamp.ctypes.data % 64 == 0 and stamp.strides == (32,)
        assert cache.pins.ctypes.data == stamp.ctypes.data + 16 and cache.pins.strides == (32,)
        if policy == "lfu":
            assert cache.policy.count.ctypes.data == stamp.ctypes.data + 8
        assert (stamp == 0).all() and (cache.pins == 0).all()


def test_ids_beyond_float_precision_are_evicted_exactly():
    """Row ids above 2**53 (hash index): an evicted id leaves the index, the others keep their bytes."""
    cache = RowCache(2 * RB, RB, evict_batch=1)
    ids = 2**60 + np.array([1, 3, 5], np.int64)
    rows = torch.arange(3 * RB, dtype=torch.uint8).view(3, RB)
    cache.fill(ids[:2], rows[:2])
    cache.fill(ids[2:], rows[2:])  # evicts ids[0], the least recent
    assert int(ids[0]) not in cache and int(ids[1]) in cache and int(ids[2]) in cache
    slots = cache.acquire(ids)
    assert slots[0] == -1
    out = torch.empty(2, RB, dtype=torch.uint8)
    cache.read(slots[1:], out)
    assert torch.equal(out, rows[1:])
    cache.release(slots)
    cache.check()


def test_the_policy_hears_of_every_dropped_slot():
    from engram_offload.cache import LRUPolicy

    class Recording(LRUPolicy):
        def __init__(self, capacity: int) -> None:
            super().__init__(capacity)
            self.removed: list[list[int]] = []

        def remove(self, slots: np.ndarray) -> None:
            self.removed.append(sorted(int(s) for s in slots))

    policy = Recording(2)
    cache = RowCache(2 * RB, RB, policy, evict_batch=1)
    assert cache.policy is policy
    ids = np.array([1, 2], np.int64)
    cache.fill(ids, rows_for(ids))
    first = int(slots_of(cache, [1])[0])
    cache.fill(np.array([3], np.int64), rows_for(np.array([3])))  # evicts 1
    reserved = cache.reserve(np.array([4], np.int64))  # evicts 2
    second = int(reserved[0])
    cache.abandon(reserved)
    assert policy.removed == [[first], [second], [second]]


@pytest.mark.parametrize("corrupt, message", [
    (lambda c: setattr(c, "_nfree", c._nfree - 1), "index size != occupied slots"),
    (lambda c: c.slot_id.__setitem__(int(slots_of(c, [1])[0]), 9), "index and slot table disagree"),
    (lambda c: c.pins.__setitem__(0, -1), "negative pin count"),
    (lambda c: c.slot_id.__setitem__(int(c._free[0]), 9), "a free slot holds a row"),
    (lambda c: c._free.__setitem__(0, c._free[1]), "a slot is free twice"),
], ids=["size", "slot table", "pins", "free slot", "free twice"])
def test_check_names_the_inconsistency(corrupt, message):
    cache = RowCache(4 * RB, RB)
    ids = np.array([1, 2], np.int64)
    cache.fill(ids, rows_for(ids))
    cache.check()
    corrupt(cache)
    with pytest.raises(AssertionError, match=f"^{re.escape(message)}$"):
        cache.check()


def test_ids_and_slots_of_other_integer_types_and_strides(hit_path):
    """acquire and release take any 1-d integer array, strided or not, through either hit path."""
    cache = RowCache(8 * RB, RB)
    ids = np.array([4, 5, 6, 7], np.int64)
    cache.fill(ids, rows_for(ids))
    want = slots_of(cache, ids)
    got = cache.acquire(ids.astype(np.int32))
    assert got.tolist() == want.tolist()
    wide = np.array([4, -9, 6, -9], np.int64)[::2]  # ids 4 and 6, strided
    again = cache.acquire(wide)
    assert again.tolist() == want[[0, 2]].tolist()
    assert cache.pins[want].tolist() == [2, 1, 2, 1]
    cache.release(got.astype(np.int32))
    spread = np.full(4, -1, np.int64)
    spread[::2] = again
    cache.release(spread[::2])  # a strided view of the slots
    assert cache.pins[want].tolist() == [0, 0, 0, 0]
    cache.check()


def test_acquire_into_pins_unless_told_not_to(hit_path):
    cache = RowCache(4 * RB, RB)
    ids = np.array([2, 3], np.int64)
    cache.fill(ids, rows_for(ids))
    out = np.empty((2, RB), np.uint8)
    slots, hits = cache.acquire_into(ids, out)
    assert hits == 2 and torch.equal(torch.from_numpy(out), rows_for(ids))
    assert cache.pins[slots].tolist() == [1, 1]
    out[:] = 0
    cache.acquire_into(ids, out, pin=False)
    assert torch.equal(torch.from_numpy(out), rows_for(ids)) and cache.pins[slots].tolist() == [1, 1]
    cache.release(slots)
    assert cache.pinned() == 0
