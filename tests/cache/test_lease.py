"""Lease: rows and the pins behind them; rows left in a cache's arena copied out only on demand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload.cache import RowCache
from engram_offload.cache.lease import Lease, RowsInPlace

from cache_fakes import ROW_BYTES, rows_for

RB = ROW_BYTES


def test_rows_left_in_the_arena_are_named_and_copied_out_while_pinned():
    cache = RowCache(10 * RB, RB)
    ids = np.array([3, 9, 12], np.int64)
    cache.fill(ids, rows_for(ids))
    slots = cache.acquire(ids)  # pinned
    rows = RowsInPlace(cache.host_rows, slots)
    assert np.array_equal(rows.copy(), rows_for(ids).numpy()) and rows.copy().flags.c_contiguous
    lease = Lease(ids, rows, [(cache, slots)])
    assert lease.in_place is rows and cache.pinned() == 3
    assert torch.equal(lease.raw, rows_for(ids))  # copied out, once
    assert lease.host_raw is not cache.host_rows and np.array_equal(lease.host_raw, rows_for(ids).numpy())
    assert lease.in_place is rows  # still where the cache holds them, while pinned
    lease.release()
    assert cache.pinned() == 0
    cache.check()


def test_a_lease_of_copied_rows_names_no_place_and_a_released_one_refuses_a_late_copy():
    cache = RowCache(10 * RB, RB)
    ids = np.array([1, 2], np.int64)
    cache.fill(ids, rows_for(ids))
    assert Lease(ids, rows_for(ids).numpy(), []).in_place is None
    assert Lease(ids, rows_for(ids), []).in_place is None
    slots = cache.acquire(ids)
    lease = Lease(ids, RowsInPlace(cache.host_rows, slots), [(cache, slots)])
    lease.release()
    with pytest.raises(RuntimeError, match="^this lease was released: its rows, left in the cache, may be gone"):
        _ = lease.raw
