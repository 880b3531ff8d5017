import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engram_offload.planner.mrc import (
    COLD, ZipfMRC, load_trace, lru_hits_bruteforce, mrc_from_trace, shards_mrc, shards_sample,
    stack_distances,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 25), min_size=0, max_size=150), st.integers(0, 30))
def test_stack_distances_match_bruteforce_lru(ids, capacity):
    ids = np.array(ids, dtype=np.int64)
    d = stack_distances(ids)
    assert int(np.sum((d != COLD) & (d < capacity))) == lru_hits_bruteforce(ids, capacity)


def test_stack_distances_small_example():
    # a b c a b b: a's reuse sees {b, c}, b's sees {c, a}, the last b sees nothing
    assert stack_distances(np.array([1, 2, 3, 1, 2, 2])).tolist() == [-1, -1, -1, 2, 2, 0]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=200), st.floats(0.05, 1.0))
def test_rows_for_hit_rate_is_the_smallest_size(ids, h):
    ids = np.array(ids, dtype=np.int64)
    curve = mrc_from_trace(ids)
    rows = curve.rows_for_hit_rate(h)
    if rows is None:
        assert curve.max_hit_ratio() < h
    else:
        assert curve.hit_ratio(rows) >= h - 1e-12
        assert rows == 0 or curve.hit_ratio(rows - 1) < h
        assert lru_hits_bruteforce(ids, rows) / len(ids) >= h - 1e-12


def test_shards_sampling_keeps_whole_ids_and_tracks_exact_curve():
    rng = np.random.default_rng(1)
    ids = rng.zipf(1.1, size=300_000) % 200_000
    sample = shards_sample(ids, 0.1)
    kept = np.isin(ids, sample)
    assert np.array_equal(ids[kept], sample)  # all accesses of a kept id, in order, and nothing else
    assert 0.07 < np.unique(sample).size / np.unique(ids).size < 0.13  # about a tenth of the ids
    exact, approx = mrc_from_trace(ids), shards_mrc(ids, 0.1)
    for rows in (1_000, 10_000, 50_000):
        assert abs(exact.hit_ratio(rows) - approx.hit_ratio(rows)) < 0.03


def test_long_traces_are_sampled():
    ids = np.arange(50_000) % 1000
    assert mrc_from_trace(ids, exact_limit=10_000).method.startswith("shards")
    assert mrc_from_trace(ids).method == "exact"


def test_zipf_curve_is_monotone_and_inverts():
    z = ZipfMRC(1.0, 100_000, heads=4)
    hits = [z.hit_ratio(r) for r in (0, 1_000, 10_000, 100_000, 400_000)]
    assert hits == sorted(hits) and hits[0] == 0 and hits[-1] == 1
    rows = z.rows_for_hit_rate(0.8)
    assert abs(z.hit_ratio(rows) - 0.8) < 0.01


def test_zipf_che_matches_simulation():
    # Che's approximation vs an LRU simulation of independent Zipf references
    rng = np.random.default_rng(2)
    n, s = 2_000, 0.9
    p = np.arange(1, n + 1, dtype=float) ** -s
    ids = rng.choice(n, size=60_000, p=p / p.sum())
    sim = mrc_from_trace(ids)
    z = ZipfMRC(s, n, exact_ranks=n)
    for rows in (50, 200, 800):
        assert abs(z.hit_ratio(rows) - sim.hit_ratio(rows)) < 0.03, rows


def test_load_trace_npy_and_text(tmp_path):
    np.save(tmp_path / "t.npy", np.array([3, 1, 2], dtype=np.int64))
    (tmp_path / "t.txt").write_text("3 1\n2\n")
    assert load_trace(tmp_path / "t.npy").tolist() == [3, 1, 2]
    assert load_trace(tmp_path / "t.txt").tolist() == [3, 1, 2]
    (tmp_path / "bad.txt").write_text("3 x 2")
    with pytest.raises(ValueError, match="not an integer"):
        load_trace(tmp_path / "bad.txt")
    np.save(tmp_path / "f.npy", np.array([1.5]))
    with pytest.raises(ValueError, match="integers"):
        load_trace(tmp_path / "f.npy")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.npy")


@pytest.mark.parametrize("s", [0.8, 1.0, 1.2])
def test_zipf_binning_tracks_the_exact_ranks(s):
    exact = ZipfMRC(s, 20_000, exact_ranks=20_000)
    binned = ZipfMRC(s, 20_000, exact_ranks=100, bins=512)
    for rows in (50, 500, 5_000, 15_000):
        assert abs(binned.hit_ratio(rows) - exact.hit_ratio(rows)) < 2e-3, rows
    assert abs(binned.rows_for_hit_rate(0.5) - exact.rows_for_hit_rate(0.5)) <= 0.01 * exact.rows_for_hit_rate(0.5)


def test_zipf_heads_are_independent_copies():
    one, four = ZipfMRC(1.0, 5_000), ZipfMRC(1.0, 5_000, heads=4)
    assert four.total_rows == 20_000
    for rows in (10, 1_000, 4_000):
        assert four.hit_ratio(4 * rows) == pytest.approx(one.hit_ratio(rows), abs=1e-6)
    assert four.rows_for_hit_rate(0) == 0 and four.rows_for_hit_rate(1.0) == 20_000
    assert four.hit_ratio(-1) == 0.0 and four.hit_ratio(20_000) == 1.0


def test_zipf_and_trace_curves_refuse_bad_arguments():
    with pytest.raises(ValueError, match=r"^Zipf exponent must be >= 0, got -0.5$"):
        ZipfMRC(-0.5, 10)
    with pytest.raises(ValueError, match=r"^rows_per_head and heads must be positive$"):
        ZipfMRC(1.0, 0)
    with pytest.raises(ValueError, match=r"^rows_per_head and heads must be positive$"):
        ZipfMRC(1.0, 10, heads=0)
    assert ZipfMRC(0.0, 1).rows_for_hit_rate(0.5) <= 1
    curve = mrc_from_trace(np.array([1, 1], np.int64))
    for bad in (-0.1, 1.1):
        with pytest.raises(ValueError, match=rf"^hit rate must be within \[0, 1\], got {bad}$"):
            curve.rows_for_hit_rate(bad)
        with pytest.raises(ValueError, match=r"^hit rate must be within"):
            ZipfMRC(1.0, 10).rows_for_hit_rate(bad)
    with pytest.raises(ValueError, match=r"^the trace is empty: give at least one row id$"):
        mrc_from_trace(np.array([], np.int64))
    for rate in (0.0, 1.5):
        with pytest.raises(ValueError, match=rf"^sampling rate must be in \(0, 1\], got {rate}$"):
            shards_sample(np.arange(4), rate)


def test_a_trace_curve_counts_cold_misses_and_reuse():
    curve = mrc_from_trace(np.array([1, 2, 1, 1, 3], np.int64))  # distances: -, -, 1, 0, -
    assert (curve.accesses, curve.trace_length, curve.distinct_ids, curve.method) == (5, 5, 3, "exact")
    assert curve.distances.tolist() == [0.0, 1.0]
    assert [curve.hit_ratio(r) for r in (0, 1, 2)] == [0.0, 0.2, 0.4]
    assert curve.max_hit_ratio() == 0.4
    assert [curve.rows_for_hit_rate(h) for h in (0.0, 0.2, 0.4, 0.41)] == [0, 1, 2, None]


def test_shards_adjusts_the_sample_to_the_expected_size():
    rng = np.random.default_rng(4)
    ids = rng.zipf(1.2, size=50_000) % 5_000
    curve = shards_mrc(ids, 0.2)
    assert curve.accesses == round(0.2 * ids.size) and curve.trace_length == ids.size
    assert curve.method == "shards@0.2" and curve.rate == 0.2
    sample = shards_sample(ids, 0.2)
    assert curve.distinct_ids == int(np.unique(sample).size / 0.2)
    assert shards_sample(ids, 1.0).tolist() == ids.tolist()
