"""FrequencySketch: sizes, exact counts when nothing collides, halving, min over rows."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.cache.admission import FrequencySketch


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, np.int64)


def test_width_rounds_up_to_a_power_of_two_of_at_least_256():
    assert FrequencySketch(1000).width == 1024
    assert FrequencySketch(1024).width == 1024
    assert FrequencySketch(1025).width == 2048
    assert FrequencySketch(3).width == 256
    s = FrequencySketch(300, depth=3)
    assert s.table.shape == (3, 512) and s.table.dtype == np.int32
    assert s.window == 5120 and s.min_count == 2
    assert FrequencySketch(300, window=7).window == 7


@pytest.mark.parametrize("depth", [0, 5])
def test_depth_outside_1_to_4_is_refused(depth):
    with pytest.raises(ValueError, match="sketch depth must be in 1..4"):
        FrequencySketch(64, depth=depth)


def test_counts_are_exact_on_a_wide_sketch():
    s = FrequencySketch(1 << 16, window=10**6)
    for _ in range(3):
        s.record(ids(5, 0, 2**40))
    s.record(ids(5))
    s.record(ids())
    assert s.estimate(ids(5, 0, 2**40, 6)).tolist() == [4, 3, 3, 0]
    assert s.estimate(ids()).dtype == np.int64 and s.estimate(ids()).size == 0
    one = s.estimate(ids(5))
    assert one.dtype == np.int64 and one.tolist() == [4]


def test_estimates_never_undercount_and_take_the_least_row():
    rng = np.random.default_rng(7)
    trace = [rng.choice(5000, size=200, replace=False).astype(np.int64) for _ in range(20)]
    truth = np.bincount(np.concatenate(trace), minlength=5000)
    deep, shallow = FrequencySketch(256, depth=4, window=10**6), FrequencySketch(256, depth=1, window=10**6)
    for step in trace:
        deep.record(step)
        shallow.record(step)
    everything = np.arange(5000, dtype=np.int64)
    d, s = deep.estimate(everything), shallow.estimate(everything)
    assert (d >= truth).all()
    assert (d <= s).all() and (d < s).any()  # row 0 is shared; more rows can only tighten it


def test_ids_spread_over_the_whole_width():
    s = FrequencySketch(256, window=10**6)
    s.record(np.arange(1024, dtype=np.int64))
    filled = (s.table > 0).mean(axis=1)  # about 1 - e^-4 of each row
    assert (filled > 0.9).all(), filled
    assert s.table.sum() == 4 * 1024


def test_all_counters_halve_once_a_window_of_accesses_is_seen():
    s = FrequencySketch(1 << 16, window=6)
    s.record(ids(1, 2, 3))
    s.record(ids(1, 2))
    assert s.estimate(ids(1, 2, 3)).tolist() == [2, 2, 1]
    s.record(ids(1))  # the sixth access: 3, 2, 1 halve to 1, 1, 0
    assert s.estimate(ids(1, 2, 3)).tolist() == [1, 1, 0]
    s.record(ids(1, 2, 3, 4, 5))  # five more: not yet a second window
    assert s.estimate(ids(1, 2, 3, 4)).tolist() == [2, 2, 1, 1]


def test_admit_needs_the_estimate_to_reach_min_count():
    s = FrequencySketch(1 << 16, window=10**6, min_count=3)
    s.record(ids(1, 2))
    s.record(ids(1, 2))
    s.record(ids(1))
    assert s.admit(ids(1, 2, 9)).tolist() == [True, False, False]
