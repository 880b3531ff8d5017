"""RowIndex and DirectIndex with colliding keys, tombstones, sizes and limits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_offload.cache.index import EMPTY, TOMBSTONE, DirectIndex, RowIndex, make_index

# random 40-bit keys collide in a small table far more often than consecutive ones,
# which Fibonacci hashing spreads out: probing, tombstones and rebuilds all get exercised
POOL = np.random.default_rng(11).integers(0, 2**40, size=48).tolist() + [0]


def keys(*xs: int) -> np.ndarray:
    return np.array(xs, np.int64)


def check_rowindex_invariants(index: RowIndex) -> None:
    live, dead = index.keys >= 0, index.keys == TOMBSTONE
    assert index.count == len(index) == int(live.sum())
    assert index._tombstones == int(dead.sum())
    # rebuilt before live entries plus tombstones pass half the table: probes always end
    assert int(live.sum() + dead.sum()) <= index.keys.size // 2
    assert (index.keys[~live & ~dead] == EMPTY).all()


def apply_ops(index, ops, limit: int) -> None:
    ref: dict[int, int] = {}
    for step, (op, picked) in enumerate(ops):
        batch = np.unique(np.array(picked, np.int64))
        if op == "add":
            new = np.array([k for k in batch.tolist() if k not in ref][: limit - len(ref)], np.int64)
            values = np.arange(new.size, dtype=np.int64) + 1000 * step
            index.insert(new, values)
            ref.update(zip(new.tolist(), values.tolist()))
        else:
            index.remove(batch)
            for k in batch.tolist():
                ref.pop(k, None)
        probe = np.array(POOL, np.int64)
        assert index.lookup(probe).tolist() == [ref.get(k, -1) for k in POOL]
        for k in POOL[:3]:  # one key at a time, too
            assert index.lookup(keys(k)).tolist() == [ref.get(k, -1)]
        got_keys, got_values = index.items()
        assert got_keys.dtype == np.int64 and got_values.dtype == np.int64
        assert dict(zip(got_keys.tolist(), got_values.tolist())) == ref
        if isinstance(index, RowIndex):
            check_rowindex_invariants(index)
        else:
            assert len(index) == len(ref)


OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "remove"]),
                         st.lists(st.sampled_from(POOL), min_size=1, max_size=20)), max_size=40)


@settings(max_examples=80, deadline=None)
@given(OPS)
def test_row_index_with_colliding_keys_matches_a_dict(ops):
    apply_ops(RowIndex(16), ops, 16)


@settings(max_examples=40, deadline=None)
@given(OPS)
def test_direct_index_matches_a_dict(ops):
    # a 2^40-key array is too big: the index holds the pool's positions
    remap = {k: i for i, k in enumerate(POOL)}
    apply_ops(_Remapped(DirectIndex(len(POOL), 16), remap), ops, 16)


class _Remapped:
    """A DirectIndex over the pool's positions, addressed by the pool's keys."""

    def __init__(self, index: DirectIndex, remap: dict[int, int]) -> None:
        self.index, self.remap = index, remap
        self.back = np.array(list(remap), np.int64)

    def _pos(self, ks: np.ndarray) -> np.ndarray:
        return np.array([self.remap[k] for k in ks.tolist()], np.int64)

    def insert(self, ks, values):
        self.index.insert(self._pos(ks), values)

    def remove(self, ks):
        self.index.remove(self._pos(ks))

    def lookup(self, ks):
        return self.index.lookup(self._pos(ks))

    def items(self):
        pos, values = self.index.items()
        return self.back[pos], values

    def __len__(self):
        return len(self.index)


def test_a_row_index_after_many_removals_still_answers_misses():
    index = RowIndex(16)
    rng = np.random.default_rng(5)
    kept = np.empty(0, np.int64)
    for round_ in range(40):
        batch = np.setdiff1d(np.unique(rng.integers(0, 2**40, size=15)), kept)
        index.insert(batch, batch + round_)
        check_rowindex_invariants(index)
        assert index.lookup(batch).tolist() == (batch + round_).tolist()
        assert index.lookup(kept).tolist() == (kept + round_ - 1).tolist()  # survived the rebuilds
        assert (index.lookup(batch + 1) == -1).all()
        index.remove(np.concatenate([batch[:-1], kept]))  # one entry lives on among the tombstones
        kept = batch[-1:]
        check_rowindex_invariants(index)
        assert len(index) == 1


def test_row_index_sizes():
    for capacity, cells in [(1, 16), (8, 32), (9, 64), (100, 512), (1000, 4096)]:
        index = RowIndex(capacity)
        assert index.keys.size == index.values.size == cells, capacity
        assert index.keys.dtype == np.int64 and index.values.dtype == np.int64
        assert (index.keys == EMPTY).all() and len(index) == 0 and index._tombstones == 0
        assert RowIndex.table_bytes(capacity) == 16 * cells == index.keys.nbytes + index.values.nbytes


def test_row_index_spreads_keys_over_the_whole_table():
    index = RowIndex(1000)
    ks = np.unique(np.random.default_rng(2).integers(0, 2**40, size=1000))
    index.insert(ks, ks)
    cells = np.flatnonzero(index.keys >= 0)
    upper = np.count_nonzero(cells >= index.keys.size // 2)
    assert 0.35 < upper / ks.size < 0.65  # homes are uniform over the table, not bunched at its start


def test_row_index_limits():
    with pytest.raises(ValueError, match="index capacity must be >= 1, got 0"):
        RowIndex(0)
    index = RowIndex(1)
    index.insert(keys(0), keys(0))  # key 0 and value 0 are ordinary entries
    assert index.lookup(keys(0)).tolist() == [0] and index.items()[0].tolist() == [0]
    index.insert(keys(), keys())
    with pytest.raises(ValueError, match=r"index full: 1 \+ 1 entries > capacity 1"):
        index.insert(keys(5), keys(5))
    two = RowIndex(2)
    with pytest.raises(ValueError, match=r"index full: 0 \+ 3 entries > capacity 2"):
        two.insert(keys(1, 2, 3), keys(1, 2, 3))
    two.insert(keys(1, 2), keys(7, 8))
    assert len(two) == 2 and two.lookup(keys(2, 1, 3)).tolist() == [8, 7, -1]
    assert two.lookup(keys()).size == 0


def test_direct_index_value_width_follows_the_capacity():
    assert DirectIndex(10, 2**31 - 1).values.dtype == np.int32
    assert DirectIndex(10, 2**31).values.dtype == np.int64
    assert DirectIndex.table_bytes(10, 2**31 - 1) == 40
    assert DirectIndex.table_bytes(10, 2**31) == 80
    index = DirectIndex(5, 2)
    assert index.values.tolist() == [-1] * 5 and index.lookup(keys(0, 4)).dtype == np.int64


@pytest.mark.parametrize("num_keys, capacity", [(0, 1), (1, 0), (0, 0)])
def test_direct_index_needs_keys_and_capacity(num_keys, capacity):
    with pytest.raises(ValueError, match=f"index needs num_keys >= 1 and capacity >= 1, got {num_keys}, {capacity}"):
        DirectIndex(num_keys, capacity)


def test_direct_index_limits_and_empty_batches():
    index = DirectIndex(1, 1)
    index.insert(keys(), keys())
    index.remove(keys())
    index.insert(keys(0), keys(0))
    assert len(index) == 1 and [a.tolist() for a in index.items()] == [[0], [0]]
    with pytest.raises(ValueError, match=r"index full: 1 \+ 1 entries > capacity 1"):
        index.insert(keys(0), keys(3))
    index.remove(keys(0))
    index.remove(keys(0))  # absent: ignored
    assert len(index) == 0 and index.lookup(keys(0)).tolist() == [-1]
    three = DirectIndex(10, 3)
    three.insert(keys(1, 2, 3), keys(4, 5, 6))
    assert len(three) == 3
    with pytest.raises(ValueError, match=r"index full: 0 \+ 4 entries > capacity 3"):
        DirectIndex(10, 3).insert(keys(1, 2, 3, 4), keys(1, 2, 3, 4))


def test_make_index_kinds():
    assert isinstance(make_index(8, kind="hash"), RowIndex)
    assert isinstance(make_index(8, num_keys=10**9, kind="hash"), RowIndex)
    assert isinstance(make_index(8, num_keys=10**6, kind="direct"), DirectIndex)
    with pytest.raises(ValueError, match="unknown index kind 'HASH'; choose auto, direct or hash"):
        make_index(8, kind="HASH")
    with pytest.raises(ValueError, match=r"^a direct index needs num_keys \(the table's row count\)$"):
        make_index(8, kind="direct")
    # auto: the array when it is no larger than the hash table (equal sizes included)
    same = RowIndex.table_bytes(100) // 4
    assert isinstance(make_index(100, num_keys=same), DirectIndex)
    assert isinstance(make_index(100, num_keys=same + 1), RowIndex)
