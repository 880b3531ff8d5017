"""Eviction policies: exact scores, victims, aging and the admission estimate at insert."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.cache.policy import LFUPolicy, LRUPolicy, make_policy

ALL4 = np.ones(4, bool)


def slots(*xs: int) -> np.ndarray:
    return np.array(xs, np.int64)


def test_lfu_starts_a_new_row_at_its_admission_estimate():
    p = LFUPolicy(4, aging_period=1000)
    p.insert(slots(0), frequency=slots(5))  # admitted after five recent asks
    p.insert(slots(1, 2, 3))  # no estimate: one each, and newer than slot 0
    p.touch(slots(1, 2, 3))
    assert p.count.tolist() == [5, 2, 2, 2]
    # slot 0 is the least recent, yet its estimate keeps it: a policy that ignored the
    # sketch would start it at one and evict it first
    assert sorted(p.victims(3, ALL4).tolist()) == [1, 2, 3]


def test_lfu_clips_the_estimate_to_one_and_max_count():
    p = LFUPolicy(3, aging_period=1000, max_count=7)
    p.insert(slots(0, 1, 2), frequency=slots(0, 3, 1_000))
    assert p.count.tolist() == [1, 3, 7]


def test_lfu_counts_hits_up_to_max_count():
    p = LFUPolicy(2, aging_period=1000, max_count=3)
    p.insert(slots(0, 1))
    for _ in range(5):
        p.touch(slots(0))
    p.touch(slots(1))
    assert p.count.tolist() == [3, 2]
    assert p.stamp.tolist() == [6, 7] and p.clock == 7


def test_lfu_halves_every_count_after_exactly_aging_period_accesses():
    p = LFUPolicy(4, aging_period=6)
    p.insert(slots(0, 1, 2, 3), frequency=slots(8, 8, 5, 1))  # 4 accesses
    p.touch(slots(0))  # 5
    assert p.count.tolist() == [9, 8, 5, 1]
    p.touch(slots(1))  # 6: halve
    assert p.count.tolist() == [4, 4, 2, 0]
    p.touch(slots(0, 1, 2, 3))
    p.touch(slots(0))  # 5 more: not yet a second period
    assert p.count.tolist() == [6, 5, 3, 1]
    p.touch(slots(3))  # 6 since the last halving
    assert p.count.tolist() == [3, 2, 1, 1]


def test_lfu_default_aging_period_and_description():
    assert LFUPolicy(10).aging_period == 64
    assert LFUPolicy(100).aging_period == 400
    assert LFUPolicy(10, aging_period=7).describe() == {"policy": "lfu", "aging_period": 7}
    assert LFUPolicy(2).max_count == 1 << 15
    p = LFUPolicy(1)
    p.insert(slots(0), frequency=slots(10**9))
    assert p.count[0] == 1 << 15


def test_lfu_score_is_count_first_then_recency():
    p = LFUPolicy(4, aging_period=1000)
    for s in (0, 1, 2, 3):  # stamps 1, 2, 3, 4: a mask dropping low bits would misorder 3 and 4
        p.insert(slots(s))
    assert p.scores().tolist() == [(1 << 40) | 1, (1 << 40) | 2, (1 << 40) | 3, (1 << 40) | 4]
    assert p.victims(1, ALL4).tolist() == [0]
    p.touch(slots(0))  # count 2 beats any stamp
    assert sorted(p.victims(3, ALL4).tolist()) == [1, 2, 3]
    assert p.victims(1, np.array([False, False, True, True])).tolist() == [2]


def test_lfu_stamps_past_40_bits_never_outweigh_the_count():
    p = LFUPolicy(2, aging_period=1000)
    p.count[:] = [2, 3]
    p.stamp[:] = [(1 << 40) + 5, 1]
    assert p.victims(1, np.ones(2, bool)).tolist() == [0]


def test_victims_are_exactly_the_lowest_scores():
    rng = np.random.default_rng(3)
    p = LRUPolicy(1000)
    for s in rng.permutation(1000):
        p.touch(slots(s))
    evictable = rng.random(1000) < 0.7
    order = np.flatnonzero(evictable)[np.argsort(p.scores()[evictable])]
    for count in (1, 2, 10, 100, 499):
        assert sorted(p.victims(count, evictable).tolist()) == sorted(order[:count].tolist()), count


def test_lru_scores_are_the_clock_at_the_last_access():
    p = LRUPolicy(4)
    p.insert(slots(0, 1))
    p.insert(slots(2, 3))
    p.touch(slots(0))
    assert p.scores().tolist() == [3, 1, 2, 2] and p.clock == 3
    assert sorted(p.victims(1, ALL4).tolist()) == [1]
    assert sorted(p.victims(3, ALL4).tolist()) == [1, 2, 3]
    assert p.describe() == {"policy": "lru"}


def test_victims_at_the_edges_of_count():
    p = LRUPolicy(4)
    p.insert(slots(3, 2, 1, 0))
    p.touch(slots(3))
    assert p.victims(0, ALL4).size == 0 and p.victims(0, ALL4).dtype == np.int64
    assert p.victims(1, np.array([False, False, True, False])).tolist() == [2]  # the only candidate
    assert p.victims(-1, ALL4).size == 0
    assert p.victims(2, np.zeros(4, bool)).size == 0
    assert sorted(p.victims(4, ALL4).tolist()) == [0, 1, 2, 3]
    assert sorted(p.victims(9, np.array([True, False, True, False])).tolist()) == [0, 2]
    assert sorted(p.victims(3, ALL4).tolist()) == [0, 1, 2]
    assert p.victims(1, np.array([False, True, True, True])).tolist() == [1]


def test_policies_write_into_arrays_they_are_handed_and_zero_them():
    records = np.ones(4, dtype=[("stamp", np.int64), ("count", np.int64), ("other", np.int64)])
    p = LFUPolicy(4, aging_period=1000, stamp=records["stamp"], count=records["count"])
    assert records["stamp"].tolist() == [0] * 4 and records["count"].tolist() == [0] * 4
    p.insert(slots(2), frequency=slots(6))
    assert records["count"].tolist() == [0, 0, 6, 0] and records["stamp"].tolist() == [0, 0, 1, 0]
    assert records["other"].tolist() == [1] * 4
    lru = LRUPolicy(4, stamp=records["stamp"])
    lru.touch(slots(1))
    assert records["stamp"].tolist() == [0, 1, 0, 0]


@pytest.mark.parametrize("bad", [np.zeros(4, np.int32), np.zeros(5, np.int64), np.zeros((4, 1), np.int64)])
def test_handed_arrays_of_the_wrong_type_or_shape_are_refused(bad):
    with pytest.raises(ValueError, match=r"^policy stamp array must be int64 \[4\], got"):
        LRUPolicy(4, stamp=bad)
    with pytest.raises(ValueError, match=r"^policy count array must be int64 \[4\]"):
        LFUPolicy(4, count=bad)
    with pytest.raises(ValueError, match=r"^policy stamp array must be int64 \[4\]"):
        LFUPolicy(4, stamp=bad)


def test_make_policy_by_name():
    lfu = make_policy("lfu", 8, aging_period=5)
    assert isinstance(lfu, LFUPolicy) and lfu.capacity == 8 and lfu.aging_period == 5
    lru = make_policy("lru", 3)
    assert isinstance(lru, LRUPolicy) and lru.capacity == 3 and lru.clock == 0
    assert lru.stamp.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'; choose one of: lru, lfu"):
        make_policy("fifo", 4)
