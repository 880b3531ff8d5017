"""``build_levels`` and ``capped_bytes`` (cache/levels.py) and ``Lease`` (cache/lease.py), on real caches."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from engram_offload.cache import RowCache, build_levels
from engram_offload.cache.lease import Lease
from engram_offload.cache.levels import capped_bytes

RB = 16


def test_capped_bytes():
    assert capped_bytes(1000, RB, None) == 1000  # no table size: as asked
    assert capped_bytes(1000, RB, 10) == 160  # never more than the table
    assert capped_bytes(1000, RB, 100) == 1000
    assert capped_bytes(160, RB, 10) == 160
    assert type(capped_bytes(np.int64(50), np.int64(RB), np.int64(2))) is int


def test_levels_fastest_first_each_capped():
    levels = build_levels(RB, 100 * RB, "lfu", fast_cache_bytes=10 * RB, fast_device="cpu", admission=True,
                          num_rows=50)
    assert [(c.name, c.capacity, c.device.type) for c in levels] == [("fast", 10, "cpu"), ("dram", 50, "cpu")]
    for cache in levels:
        d = cache.describe()
        assert d["policy"] == "lfu" and d["admission"] is True and d["index"] == "DirectIndex"
        assert cache.row_bytes == RB


def test_levels_defaults():
    (dram,) = build_levels(RB, 64 * RB)
    d = dram.describe()
    assert (dram.name, dram.capacity, d["policy"], d["admission"], d["index"]) == ("dram", 64, "lfu", False, "RowIndex")
    assert build_levels(RB, 0) == []
    (fast,) = build_levels(RB, 0, fast_cache_bytes=4 * RB, fast_device="cpu", admission=False)
    assert fast.name == "fast" and fast.describe()["admission"] is False and fast.describe()["index"] == "RowIndex"
    assert build_levels(RB, 10 * RB, num_rows=0) == []  # an empty table needs no cache


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the default without CUDA")
def test_fast_level_defaults_to_the_cpu_without_cuda():
    fast, dram = build_levels(RB, 8 * RB, fast_cache_bytes=4 * RB)
    assert fast.device == torch.device("cpu") and dram.device == torch.device("cpu")


def _pinned(cache: RowCache, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` cached in ``cache`` and pinned, as a fetch leaves them for its lease."""
    slots = cache.reserve(ids)
    new = slots >= 0  # the ids not cached yet
    cache.write(slots[new], torch.zeros((int(new.sum()), RB), dtype=torch.uint8))
    cache.publish(slots[new])  # unpins the fill
    return cache.acquire(ids)


def test_lease_unpins_once_on_release_exit_or_collection():
    a, b = RowCache(8 * RB, RB, name="a"), RowCache(8 * RB, RB, name="b")
    ids = np.arange(3, dtype=np.int64)
    lease = Lease(ids, torch.zeros((3, RB), dtype=torch.uint8), [(a, _pinned(a, ids)), (b, _pinned(b, ids[:2]))])
    assert a.pinned() == 3 and b.pinned() == 2 and lease.ready is None
    lease.release()
    assert a.pinned() == 0 and b.pinned() == 0
    lease.release()  # twice: harmless, nothing released again
    with Lease(ids, lease.raw, [(a, _pinned(a, ids))], ready="event") as held:
        assert held.ready == "event" and a.pinned() == 3 and held.ids is ids
    assert a.pinned() == 0
    Lease(ids, lease.raw, [(a, _pinned(a, ids))])  # forgotten: collected, unpinned
    gc.collect()
    assert a.pinned() == 0
    empty = Lease(ids[:0], lease.raw[:0], [])
    empty.release()
    assert a.pinned() == 0


def test_the_fast_level_is_capped_at_the_table_too():
    fast, dram = build_levels(RB, 100 * RB, fast_cache_bytes=80 * RB, fast_device="cpu", num_rows=30)
    assert (fast.capacity, dram.capacity) == (30, 30)


@pytest.mark.gpu
def test_the_fast_level_lives_on_the_gpu():
    fast, dram = build_levels(RB, 8 * RB, fast_cache_bytes=4 * RB)  # CUDA by default
    assert fast.device.type == "cuda" and dram.device.type == "cpu"
    (chosen,) = build_levels(RB, 0, fast_cache_bytes=4 * RB, fast_device="cuda:0")
    assert chosen.device == torch.device("cuda", 0)
