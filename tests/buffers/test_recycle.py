"""RecycledArrays: an array is handed out again only once nobody holds what it gave."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest
import torch

from engram_offload.buffers.recycle import RecycledArrays


def test_an_array_let_go_is_used_again_and_a_held_one_never():
    pool = RecycledArrays(min_bytes=0)
    a = pool.empty((4, 8), np.float32)
    a[:] = 1.0
    b = pool.empty((4, 8), np.float32)  # a is held: a new array
    assert not np.shares_memory(a, b) and pool.made == 2 and pool.reused == 0
    address = a.__array_interface__["data"][0]
    del a
    c = pool.empty((2, 8), np.float32)  # fits in a's
    assert c.__array_interface__["data"][0] == address and pool.reused == 1
    assert c.shape == (2, 8) and c.dtype == np.float32


def test_a_tensor_made_from_the_array_holds_it():
    pool = RecycledArrays(min_bytes=0)
    rows = torch.from_numpy(pool.empty((3, 4), np.float32))  # the array lives on in the tensor
    rows.fill_(7.0)
    view = rows[1:]  # a view of the tensor holds it too
    del rows
    gc.collect()
    other = pool.empty((3, 4), np.float32)
    other.fill(0.0)
    assert torch.equal(view, torch.full((2, 4), 7.0)) and pool.reused == 0
    del view
    assert pool.empty((3, 4), np.float32) is not None and pool.reused == 1


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_numpy_view_holds_the_array_too():
    pool = RecycledArrays(min_bytes=0)
    a = pool.empty((6,), np.int64)
    a[:] = 5
    view = a[2:].reshape(2, 2)
    del a
    gc.collect()
    pool.empty((6,), np.int64).fill(0)  # a new array: the view still holds the first
    assert (view == 5).all() and pool.reused == 0


def test_the_array_let_go_of_last_is_taken_first():
    pool = RecycledArrays(min_bytes=0)
    first, second = pool.empty((100,), np.uint8), pool.empty((100,), np.uint8)
    first_at, second_at = address(first), address(second)
    del first, second  # second let go of last
    again = pool.empty((50,), np.uint8)
    assert address(again) == second_at
    assert address(pool.empty((100,), np.uint8)) == first_at  # the other, while again is held


def test_too_small_free_arrays_are_skipped_then_replaced_once_keep_is_reached():
    pool = RecycledArrays(keep=2, min_bytes=0)
    big, small = pool.empty((1000,), np.uint8), pool.empty((10,), np.uint8)
    big_at = address(big)
    del big, small  # small let go of last, but too small for 500
    assert address(pool.empty((500,), np.uint8)) == big_at
    grown = pool.empty((4096,), np.uint8)  # two kept already: the free 10-byte one is replaced
    assert grown.size == 4096 and pool.made == 3 and len(pool._bases) == 2
    del grown
    assert pool.empty((4000,), np.uint8).size == 4000 and pool.reused == 2


def test_beyond_keep_arrays_are_plain_new_ones():
    pool = RecycledArrays(keep=2, min_bytes=0)
    held = [pool.empty((16,), np.int32) for _ in range(4)]
    assert pool.made == 4 and len(pool._bases) == 2
    held.clear()
    pool.empty((16,), np.int32)
    assert pool.reused == 1
    with pytest.raises(ValueError, match="keep must be at least 1"):
        RecycledArrays(keep=0)


def test_the_kept_bytes_stay_within_max_bytes():
    pool = RecycledArrays(min_bytes=0, max_bytes=1000)
    a = pool.empty((600,), np.uint8)
    b = pool.empty((600,), np.uint8)  # 1,200 bytes kept would be too many: b is not kept
    assert pool.kept_bytes == 600 and len(pool._bases) == 1
    del a, b
    c = pool.empty((900,), np.uint8)  # a's free 600 bytes replaced by 900
    assert pool.kept_bytes == 900 and pool.made == 3
    del c
    assert pool.empty((1200,), np.uint8).size == 1200 and pool.kept_bytes == 900  # never over


def test_arrays_under_min_bytes_are_never_kept():
    pool = RecycledArrays(min_bytes=1024)
    small = pool.empty((255,), np.float32)  # 1,020 bytes
    del small
    assert pool.empty((255,), np.float32).shape == (255,) and pool.made == pool.reused == 0
    big = pool.empty((256,), np.float32)
    big_at = address(big)
    del big
    assert address(pool.empty((256,), np.float32)) == big_at and (pool.made, pool.reused) == (1, 1)


def test_threads_never_get_the_same_array_at_once():
    pool = RecycledArrays(keep=4, min_bytes=0)
    errors = []

    def work(value: int) -> None:
        for _ in range(300):
            a = pool.empty((256,), np.int64)
            a.fill(value)
            if not (a == value).all():
                errors.append(value)

    threads = [threading.Thread(target=work, args=(v,)) for v in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and pool.reused > 0


def test_a_replaced_free_slot_is_taken_off_the_free_list():
    """The free slot whose small array a new one replaces is lent again: it must no longer be
    free, or the next request gets the very memory the first caller still holds."""
    pool = RecycledArrays(keep=1, min_bytes=0)
    small = pool.empty((10,), np.uint8)
    del small  # the one slot is free, too small for what comes next
    grown = pool.empty((4096,), np.uint8)  # replaces the free slot's array
    other = pool.empty((100,), np.uint8)  # fits in grown's array: must not be handed out
    assert not np.shares_memory(grown, other)
    grown[:] = 1
    other[:] = 2
    assert (grown == 1).all()


def test_by_default_sixteen_arrays_are_kept():
    pool = RecycledArrays(min_bytes=0)
    held = [pool.empty((64,), np.uint8) for _ in range(17)]
    assert pool.made == 17 and len(pool._bases) == 16 and pool.kept_bytes == 16 * 64
    del held


def test_kept_bytes_may_reach_max_bytes_exactly():
    pool = RecycledArrays(keep=2, min_bytes=0, max_bytes=1000)
    a, b = pool.empty((400,), np.uint8), pool.empty((600,), np.uint8)  # 1,000 bytes: both kept
    assert pool.kept_bytes == 1000 and len(pool._bases) == 2
    pool = RecycledArrays(keep=2, min_bytes=0, max_bytes=1000)
    a, b = pool.empty((300,), np.uint8), pool.empty((600,), np.uint8)
    del a
    grown = pool.empty((400,), np.uint8)  # replaces a's free 300 bytes: 1,000 kept
    assert pool.kept_bytes == 1000 and address(grown) in {address(x) for x in pool._bases}
    del b, grown


def test_every_free_array_too_small_is_a_candidate_for_replacing():
    """The last-freed small array would take the kept bytes over ``max_bytes``; an earlier
    freed one does not: that one is replaced."""
    pool = RecycledArrays(keep=3, min_bytes=0, max_bytes=1000)
    a, b, c = pool.empty((100,), np.uint8), pool.empty((200,), np.uint8), pool.empty((600,), np.uint8)
    del b  # free list: b (200 bytes)
    del a  # free list: b, a (100 bytes, let go of last)
    grown = pool.empty((300,), np.uint8)  # replacing a: 1,100 bytes; replacing b: 1,000 bytes
    assert pool.kept_bytes == 1000 and address(grown) in {address(x) for x in pool._bases}
    assert sorted(x.nbytes for x in pool._bases) == [100, 300, 600]
    del c, grown


def test_arrays_not_kept_have_their_shape_and_dtype():
    pool = RecycledArrays(keep=1, min_bytes=64, max_bytes=1000)
    small = pool.empty((3, 5), np.float32)  # under min_bytes: a plain array
    assert small.shape == (3, 5) and small.dtype == np.float32
    kept = pool.empty((10, 10), np.int16)
    large = pool.empty((20, 30), np.int32)  # over max_bytes: the caller's alone
    assert large.shape == (20, 30) and large.dtype == np.int32 and kept.shape == (10, 10)


def test_an_array_outlives_its_pool():
    """Arrays handed out hold their memory after the pool is gone: in a child process, a
    pool's 8 MiB array (its own ``mmap``) is written after the pool is collected; here, the
    memory the pool kept lives on with the array."""
    pool = RecycledArrays()
    a = pool.empty((1 << 20,), np.float64)
    memory = weakref.ref(pool._bases[0])
    del pool
    gc.collect()
    assert memory() is not None and address(memory()) == address(a)
    del a
    gc.collect()
    assert memory() is None
    code = ("import gc, numpy as np\n"
            "from engram_offload.buffers.recycle import RecycledArrays\n"
            "pool = RecycledArrays()\n"
            "a = pool.empty((1 << 20,), np.float64)\n"
            "del pool\n"
            "gc.collect()\n"
            "a[:] = 3.0\n"
            "print(float(a.sum()))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # the package this test imported
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.split() == [str(3.0 * (1 << 20))], (done.returncode, done.stderr)


def test_kept_arrays_and_those_over_max_bytes_start_on_a_cache_line():
    """The decoder streams its stores only into 64-byte aligned rows; ``np.empty`` gives a
    large block 16-byte alignment only (its header precedes it)."""
    from engram_offload.buffers.recycle import ALIGNMENT, aligned_bytes

    pool = RecycledArrays(keep=2, min_bytes=0, max_bytes=8 << 20)
    held = [pool.empty((rows, 256), np.float32) for rows in (1, 3, 4096, 5000)]  # the last two not kept
    assert pool.made == 4 and len(pool._bases) == 2
    assert all(a.ctypes.data % ALIGNMENT == 0 for a in held)
    for nbytes in (1, 63, 64, 1 << 20, (6 << 20) + 5):
        block = aligned_bytes(nbytes)
        assert block.nbytes == nbytes and block.dtype == np.uint8 and block.ctypes.data % ALIGNMENT == 0


def test_aligned_bytes_are_whole_at_every_start_an_alignment_allows(monkeypatch):
    """Wherever the allocator's block starts within an alignment, the array starts at the next
    multiple of it and holds the whole ``nbytes``: each start made in turn."""
    from engram_offload.buffers import recycle

    real_empty = np.empty
    for alignment in (3, 64):
        for start in range(alignment):  # the block's address, modulo the alignment
            def empty(n, dtype, start=start, alignment=alignment):
                big = real_empty(n + 2 * alignment, np.uint8)
                skip = (start - big.ctypes.data) % alignment
                return big[skip:skip + n]

            monkeypatch.setattr(recycle.np, "empty", empty)
            block = recycle.aligned_bytes(100, alignment)
            monkeypatch.setattr(recycle.np, "empty", real_empty)
            assert block.nbytes == 100 and block.ctypes.data % alignment == 0
