"""RecycledArrays: an array is handed out again only once nobody holds what it gave."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch

from engram_offload.recycle import RecycledArrays


def test_an_array_let_go_is_used_again_and_a_held_one_never():
    pool = RecycledArrays()
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
    pool = RecycledArrays()
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


def test_the_smallest_free_array_that_fits_is_taken_and_a_too_small_one_replaced():
    pool = RecycledArrays()
    big, small = pool.empty((1000,), np.uint8), pool.empty((10,), np.uint8)
    big_at, small_at = big.__array_interface__["data"][0], small.__array_interface__["data"][0]
    del big, small
    assert pool.empty((8,), np.uint8).__array_interface__["data"][0] == small_at
    pool2 = RecycledArrays()
    tiny = pool2.empty((4,), np.uint8)
    del tiny
    grown = pool2.empty((4096,), np.uint8)  # the free 4-byte one is dropped for a larger one
    assert grown.size == 4096 and pool2.made == 2 and len(pool2._bases) == 1
    del grown
    assert pool.empty((500,), np.uint8).__array_interface__["data"][0] == big_at


def test_beyond_keep_arrays_are_plain_new_ones():
    pool = RecycledArrays(keep=2)
    held = [pool.empty((16,), np.int32) for _ in range(4)]
    assert pool.made == 4 and len(pool._bases) == 2
    held.clear()
    pool.empty((16,), np.int32)
    assert pool.reused == 1
    with pytest.raises(ValueError, match="keep must be at least 1"):
        RecycledArrays(keep=0)


def test_threads_never_get_the_same_array_at_once():
    pool = RecycledArrays(keep=4)
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
