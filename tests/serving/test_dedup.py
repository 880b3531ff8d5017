"""dedup: unique + inverse over a step's row ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from engram_offload._native import NO_NATIVE_ENV
from engram_offload.serving.dedup import dedup, native_dedup

SHAPES = st.tuples(st.integers(0, 5), st.integers(0, 4), st.integers(1, 6))


def distinct_ids(shape_strategy=SHAPES):
    """Ids that never repeat (the no-repeat branch), anywhere in 0..2^40."""
    return arrays(np.int64, shape_strategy, elements=st.integers(0, 2**40), unique=True)


def repeating_ids(shape_strategy=SHAPES):
    """Ids from a handful of values (almost every step repeats some), or all one value."""
    return st.one_of(
        arrays(np.int64, shape_strategy, elements=st.integers(0, 5)),
        st.builds(lambda shape, v: np.full(shape, v, np.int64), shape_strategy, st.integers(0, 2**40)),
    )


def check(ids: np.ndarray) -> None:
    d = dedup(ids)
    assert d.unique.dtype == np.int64 and d.inverse.dtype == np.int64
    assert d.unique.tolist() == np.unique(ids).tolist()
    assert d.unique[d.inverse].tolist() == ids.reshape(-1).tolist()
    assert d.shape == ids.shape
    assert d.requested == ids.size


@settings(max_examples=80, deadline=None)
@given(distinct_ids())
def test_distinct_ids_round_trip(ids):
    check(ids)


@settings(max_examples=80, deadline=None)
@given(repeating_ids())
def test_repeating_ids_round_trip(ids):
    check(ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=40, unique=True), st.data())
def test_mixed_distinct_and_repeated_ids_round_trip(values, data):
    # every value at least once, some of them again, in a shuffled order
    extra = data.draw(st.lists(st.sampled_from(values), max_size=40))
    ids = np.array(data.draw(st.permutations(values + extra)), np.int64)
    check(ids)


def test_distinct_ids_in_a_non_sorted_order():
    # the no-repeat branch: the inverse is the inverse permutation of the sort, not the sort
    d = dedup(np.array([30, 10, 40, 20, 0], np.int64))
    assert d.unique.tolist() == [0, 10, 20, 30, 40]
    assert d.inverse.tolist() == [3, 1, 4, 2, 0]


def test_repeats_map_to_their_group():
    d = dedup(np.array([[7, 3], [7, 9], [3, 3]], np.int64))
    assert d.unique.tolist() == [3, 7, 9]
    assert d.inverse.tolist() == [1, 0, 1, 2, 0, 0]
    assert d.shape == (3, 2) and d.requested == 6


def test_the_inverse_restores_the_step_shape():
    ids = torch.tensor([[[4, 4], [9, 1]], [[1, 4], [9, 9]]])  # [B, L, C]
    d = dedup(ids)
    assert d.unique.size == 3 and d.requested == 8
    assert np.array_equal(d.unique[d.inverse].reshape(d.shape), ids.numpy())


def test_empty_step():
    d = dedup(np.empty((0, 2, 4), np.int64))
    assert d.unique.size == 0 and d.inverse.size == 0
    assert d.unique.dtype == np.int64 and d.shape == (0, 2, 4)
    assert dedup([]).unique.dtype == np.int64  # an empty list has no integer dtype, and needs none


def test_ids_must_be_integers():
    with pytest.raises(TypeError, match="row ids must be integers, got dtype float64"):
        dedup(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="float32"):
        dedup(torch.tensor([3.0]))


def test_unsigned_and_torch_ids():
    assert dedup(np.array([4, 2, 4], np.uint32)).unique.tolist() == [2, 4]
    assert dedup(torch.tensor([9, 9, 1])).inverse.tolist() == [1, 1, 0]


@settings(max_examples=40, deadline=None)
@given(arrays(np.int64, st.integers(1, 300), elements=st.sampled_from([0, 7, 2**40, 2**55 + 3, 2**62, -5])))
def test_ids_too_large_to_pack_still_dedup(ids):
    check(ids)


def test_dedup_leaves_the_callers_ids_alone():
    ids = np.array([5, 3, 5, 1], np.int64)
    dedup(ids)
    assert ids.tolist() == [5, 3, 5, 1]


# ---------------------------------------------------------------------- the native kernel
needs_kernel = pytest.mark.skipif(native_dedup() is None, reason="the native dedup kernel is not built")


def numpy_dedup(ids, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv(NO_NATIVE_ENV, "1")
        return dedup(ids)


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(st.one_of(distinct_ids(), repeating_ids(),
                 arrays(np.int64, SHAPES, elements=st.integers(-2**62, 2**62))))
def test_native_kernel_matches_numpy(ids):
    # negative and wide ids too; the kernel falls back where its packed keys cannot hold them
    with pytest.MonkeyPatch.context() as monkeypatch:
        expected = numpy_dedup(ids, monkeypatch)
    got = dedup(ids)
    assert got.unique.tolist() == expected.unique.tolist()
    assert got.inverse.tolist() == expected.inverse.tolist()
    assert got.shape == expected.shape


@needs_kernel
def test_native_kernel_reads_strided_views_in_c_order():
    # the hasher's [P, L, C] ids are a transposed view of a [L, C, P] array: read in place
    base = np.random.default_rng(3).integers(0, 1 << 30, size=(2, 24, 32)).astype(np.int64)
    view = base.transpose(2, 0, 1)[::-1]  # [P, L, C], negative strides as well
    assert not view.flags.c_contiguous
    d = native_dedup()
    unique, inverse = np.empty(view.size, np.int64), np.empty(view.size, np.int64)
    u = d.dedup(view, unique, inverse)
    assert unique[:u].tolist() == np.unique(view).tolist()
    assert unique[inverse].tolist() == view.reshape(-1).tolist()


@needs_kernel
def test_native_kernel_declines_ids_too_wide_to_pack():
    # 2 positions need 1 bit, and the ids span 2**63 + 2**62 values: no 64-bit key holds both
    ids = np.array([-(2**62), 2**63 - 1], np.int64)
    unique, inverse = np.empty(2, np.int64), np.empty(2, np.int64)
    assert native_dedup().dedup(ids, unique, inverse) == -1
    assert dedup(ids).unique.tolist() == [-(2**62), 2**63 - 1]  # the NumPy path


@needs_kernel
def test_native_kernel_refuses_wrong_buffers():
    kernel = native_dedup()
    with pytest.raises(TypeError, match="int64"):
        kernel.dedup(np.zeros(3, np.int32), np.empty(3, np.int64), np.empty(3, np.int64))
    with pytest.raises(ValueError, match="hold 3 ids"):
        kernel.dedup(np.zeros(3, np.int64), np.empty(2, np.int64), np.empty(3, np.int64))


@needs_kernel
@pytest.mark.parametrize("n", [300, 8191, 8192, 12_288, 40_000])
@pytest.mark.parametrize("span,step", [(1, 1), (200, 1), (4096, 1), (1 << 23, 1), ((1 << 23) + 1, 1),
                                       (1 << 36, 1), (1 << 50, 1), (1 << 12, 1 << 12), (1 << 20, 1 << 24)])
def test_native_kernel_matches_numpy_over_digit_widths_and_constant_digits(n, span, step, monkeypatch):
    """Steps large enough for the kernel's wider digits (fewer passes), ids whose span needs
    one pass or several, and ids with digits the same in every key (a pass skipped)."""
    rng = np.random.default_rng(n + span)
    ids = (rng.integers(0, span, n) * step + 12345).astype(np.int64)
    ids[rng.integers(0, n, n // 3)] = ids[rng.integers(0, n, n // 3)]  # repeats
    expected = numpy_dedup(ids, monkeypatch)
    got = dedup(ids)
    assert np.array_equal(got.unique, expected.unique) and np.array_equal(got.inverse, expected.inverse)


@needs_kernel
def test_native_kernel_sorts_a_prefill_without_the_gil():
    # from NOGIL_MIN_IDS ids on the kernel lets go of the GIL; the result is the same
    ids = np.random.default_rng(5).integers(0, 1 << 34, size=70_000).astype(np.int64)
    ids[::7] = ids[3]
    d = dedup(ids)
    assert d.unique.tolist() == np.unique(ids).tolist()
    assert np.array_equal(d.unique[d.inverse], ids)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("n", [2, 4, 1000])
def test_ids_at_the_packing_limit(n, native, monkeypatch):
    """The NumPy path packs an id and its position into one int64 only while the id fits
    beside the position's bits (4 ids take 2: ids below 2^61 pack, 2^61 does not): an id of
    exactly 2^(63 - bits), or up to twice that, would carry into the sign bit and sort wrong.
    Both paths: with the kernel built, the default run never reaches the NumPy one."""
    if not native:
        monkeypatch.setenv(NO_NATIVE_ENV, "1")
    bits = max(1, (n - 1).bit_length())
    limit = 1 << (63 - bits)
    rng = np.random.default_rng(n)
    for top in (limit - 1, limit, 2 * limit - 1):
        ids = rng.integers(0, 50, n).astype(np.int64)
        ids[rng.integers(0, n)] = top
        got = dedup(ids)
        unique, inverse = np.unique(ids, return_inverse=True)
        assert got.unique.tolist() == unique.tolist(), top
        assert got.inverse.tolist() == inverse.reshape(-1).tolist(), top
