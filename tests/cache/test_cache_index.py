"""RowIndex against a dict, and the policies' choice of victims."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_offload.cache import FrequencySketch, LFUPolicy, LRUPolicy, RowIndex, make_policy


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove"]),
                          st.lists(st.integers(0, 200), min_size=1, max_size=30)), max_size=30))
def test_index_matches_a_dict(ops):
    check_against_a_dict(RowIndex(64), ops)


def test_index_survives_many_removals():
    index = RowIndex(100)
    for round_ in range(50):  # tombstones pile up and force rebuilds
        keys = np.arange(round_ * 100, round_ * 100 + 100, dtype=np.int64)
        index.insert(keys, keys * 2)
        assert (index.lookup(keys) == keys * 2).all()
        index.remove(keys)
        assert (index.lookup(keys) == -1).all()
    assert len(index) == 0


def test_lru_evicts_least_recent():
    p = LRUPolicy(4)
    p.insert(np.array([0, 1, 2, 3]))
    p.touch(np.array([0]))
    p.touch(np.array([2]))
    victims = p.victims(2, np.ones(4, bool))
    assert sorted(victims.tolist()) == [1, 3]


def test_victims_skip_what_is_not_evictable():
    p = make_policy("lru", 4)
    p.insert(np.array([0, 1, 2, 3]))
    evictable = np.array([False, True, False, True])
    assert sorted(p.victims(4, evictable).tolist()) == [1, 3]


def test_lfu_keeps_frequent_rows_and_ages():
    p = LFUPolicy(4, aging_period=1000)
    p.insert(np.array([0, 1, 2, 3]))
    for _ in range(5):
        p.touch(np.array([0, 1]))
    p.touch(np.array([2, 3]))  # 2 and 3 are more recent, but rarely used
    assert sorted(p.victims(2, np.ones(4, bool)).tolist()) == [2, 3]
    aged = LFUPolicy(2, aging_period=2)
    aged.insert(np.array([0, 1]))
    aged.touch(np.array([0, 1]))
    assert aged.count.max() <= 1  # halved after 2 accesses


def test_sketch_counts_and_admits():
    s = FrequencySketch(1024, min_count=2)
    s.record(np.array([5, 6], np.int64))
    s.record(np.array([5], np.int64))
    est = s.estimate(np.array([5, 6, 7], np.int64))
    assert est.tolist() == [2, 1, 0]  # no collision in every row for these few ids: exact counts
    assert s.admit(np.array([5, 7], np.int64)).tolist() == [True, False]


def test_sketch_halves_after_its_window():
    s = FrequencySketch(256, min_count=2, window=8)
    for _ in range(3):
        s.record(np.array([1, 2], np.int64))  # 6 accesses: below the window
    assert s.estimate(np.array([1, 2], np.int64)).tolist() == [3, 3]
    s.record(np.array([1, 2], np.int64))  # 8 accesses: every counter halves
    assert s.estimate(np.array([1, 2], np.int64)).tolist() == [2, 2]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove"]),
                          st.lists(st.integers(0, 200), min_size=1, max_size=30)), max_size=30))
def test_direct_index_matches_a_dict(ops):
    from engram_offload.cache.index import DirectIndex

    check_against_a_dict(DirectIndex(201, 64), ops)


def test_make_index_picks_the_smaller_table():
    from engram_offload.cache.index import DirectIndex, make_index

    assert isinstance(make_index(100), RowIndex)  # key space unknown
    assert isinstance(make_index(100, num_keys=10**7), RowIndex)  # array far larger than the hash table
    assert isinstance(make_index(100_000, num_keys=1_000_000), DirectIndex)
    assert isinstance(make_index(10, num_keys=10**6, kind="direct"), DirectIndex)


def check_against_a_dict(index, ops) -> None:
    """Apply add/remove batches of keys 0..200 (at most 64 live) to ``index`` and a dict;
    after each batch every key must look up the same in both."""
    ref, next_value = {}, 0
    for op, keys in ops:
        keys = np.unique(np.array(keys, np.int64))
        if op == "add":
            new = np.array([k for k in keys if k not in ref], np.int64)[: 64 - len(ref)]
            values = np.arange(next_value, next_value + new.size, dtype=np.int64)
            next_value += new.size
            index.insert(new, values)
            ref.update(zip(new.tolist(), values.tolist()))
        else:
            index.remove(keys)
            for k in keys.tolist():
                ref.pop(k, None)
        probe = np.arange(0, 201, dtype=np.int64)
        expected = np.array([ref.get(k, -1) for k in probe.tolist()])
        assert (index.lookup(probe) == expected).all()
        assert len(index) == len(ref)
