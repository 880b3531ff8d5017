import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_offload.planner.mrc import (
    COLD,
    ZipfMRC,
    load_trace,
    mrc_from_trace,
    shards_mrc,
    shards_sample,
    stack_distances,
)


def lru_hits_bruteforce(ids: np.ndarray, capacity: int) -> int:
    """Hits of a plain LRU cache of ``capacity`` rows: the slow reference the curves are checked against."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for x in np.asarray(ids).reshape(-1).tolist():
        if x in cache:
            hits += 1
            cache.move_to_end(x)
        elif capacity > 0:
            cache[x] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


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
        assert curve.hit_ratio(math.inf) < h
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
@pytest.mark.parametrize("bins", [512, 2048])
def test_zipf_binning_tracks_the_exact_ranks(s, bins):
    # 100 exact ranks, the other 19,900 in log-spaced bins: within a millionth everywhere
    exact = ZipfMRC(s, 20_000, exact_ranks=20_000)
    binned = ZipfMRC(s, 20_000, exact_ranks=100, bins=bins)
    for rows in (0.5, 1, 3, 10, 50, 500, 5_000, 15_000, 19_995):
        assert abs(binned.hit_ratio(rows) - exact.hit_ratio(rows)) < 1e-6, rows
    assert abs(binned.rows_for_hit_rate(0.5) - exact.rows_for_hit_rate(0.5)) <= 1


def test_zipf_binning_from_the_second_rank():
    exact = ZipfMRC(1.0, 500, exact_ranks=500)
    binned = ZipfMRC(1.0, 500, exact_ranks=1, bins=64)
    for rows in (1, 10, 100, 400):
        assert abs(binned.hit_ratio(rows) - exact.hit_ratio(rows)) < 0.01, rows


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
    assert curve.hit_ratio(math.inf) == 0.4
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


# ---------------------------------------------------------------- exact stack distances


def distinct_since_previous(ids: list[int]) -> list[int]:
    """The definition, access by access: distinct other ids since the previous access."""
    out = []
    for i, x in enumerate(ids):
        before = [j for j in range(i) if ids[j] == x]
        out.append(len(set(ids[before[-1] + 1:i])) if before else COLD)
    return out


@pytest.mark.parametrize("ids, want", [
    ([], []),
    ([7], [-1]),
    ([5, 5, 5], [-1, 0, 0]),
    ([1, 2, 2, 1], [-1, -1, 0, 1]),  # the 2s' reuse counts once for the last 1
    ([1, 2, 3, 4, 4, 3, 2, 1], [-1, -1, -1, -1, 0, 1, 2, 3]),
    ([1, 2, 1, 2, 1, 2], [-1, -1, 1, 1, 1, 1]),
    ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [-1, -1, -1, 1, -1, -1, -1, -1, 3, 6, 1]),
])
def test_stack_distances_of_hand_checked_traces(ids, want):
    assert distinct_since_previous(ids) == want
    got = stack_distances(np.array(ids, dtype=np.int64))
    assert got.dtype == np.int64 and got.tolist() == want


def test_stack_distances_match_the_definition_on_many_traces():
    # lengths around the powers of two where the merge levels change, small and large alphabets
    rng = np.random.default_rng(11)
    lengths = [2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129]
    for n in lengths:
        for alphabet in (2, 3, 5, 10, 40):
            for _ in range(3):
                ids = rng.integers(0, alphabet, size=n)
                assert stack_distances(ids).tolist() == distinct_since_previous(ids.tolist()), (n, alphabet, ids)


def test_stack_distances_keep_every_bit_of_64_bit_ids():
    big = 2**53  # 2**53 and 2**53 + 1 are one float64 but two row ids
    ids = np.array([big, big + 1, big, 2**63 - 1, -(2**63), big + 1], dtype=np.int64)
    assert stack_distances(ids).tolist() == [-1, -1, 1, -1, -1, 3]


def test_traces_of_any_shape_are_read_in_order():
    ids = np.array([[1, 2, 3], [1, 2, 2]], dtype=np.int64)
    assert stack_distances(ids).tolist() == [-1, -1, -1, 2, 2, 0]
    assert lru_hits_bruteforce(ids, 3) == 3 and lru_hits_bruteforce(ids.ravel(), 3) == 3
    curve = mrc_from_trace(ids)
    assert curve.distances.tolist() == [0.0, 2.0, 2.0]
    assert (curve.accesses, curve.trace_length, curve.distinct_ids) == (6, 6, 3)
    assert shards_sample(ids, 0.5).tolist() == shards_sample(ids.ravel(), 0.5).tolist()
    assert shards_sample(ids, 1.0).tolist() == [1, 2, 3, 1, 2, 2]
    assert shards_mrc(ids, 0.5).trace_length == 6


def test_stack_distances_refuse_ids_that_are_not_integers():
    with pytest.raises(ValueError, match=r"^row ids must be integers, got dtype float64$"):
        stack_distances(np.array([1.0, 2.0]))
    assert stack_distances(np.array([], dtype=np.float64)).tolist() == []


def test_bruteforce_lru_counts_hits():
    ids = np.array([1, 2, 1, 3, 1, 2], dtype=np.int64)
    # one row keeps only the last id; two keep 1 hot; three hold them all
    assert [lru_hits_bruteforce(ids, c) for c in (0, 1, 2, 3)] == [0, 0, 2, 3]
    assert lru_hits_bruteforce(np.array([4, 4, 4]), 1) == 2


# ---------------------------------------------------------------- SHARDS sampling

M64 = 2**64 - 1
GAMMA = 0x9E3779B97F4A7C15
MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def splitmix64(x: int) -> int:
    """SplitMix64's output for state ``x + GAMMA`` (Steele, Lea, Flood 2014; Vigna's splitmix64.c)."""
    z = (x + GAMMA) & M64
    z = (z ^ (z >> 30)) * MIX[0] & M64
    z = (z ^ (z >> 27)) * MIX[1] & M64
    return z ^ (z >> 31)


def unsplitmix64(h: int) -> int:
    """The id whose hash is ``h`` (every step of the finaliser is a bijection of 64-bit words)."""

    def unshift(z: int, k: int) -> int:  # inverts z ^ (z >> k)
        x = z
        for _ in range(64 // k + 1):
            x = z ^ (x >> k)
        return x

    z = unshift(h, 31)
    z = unshift(z * pow(MIX[1], -1, 2**64) & M64, 27)
    z = unshift(z * pow(MIX[0], -1, 2**64) & M64, 30)
    return (z - GAMMA) & M64


def as_ids(words: list[int]) -> np.ndarray:
    """64-bit words as the int64 row ids they are stored as."""
    return np.array(words, dtype=np.uint64).view(np.int64)


def test_the_sampling_hash_is_splitmix64():
    # the generator's first outputs from state 0 (published test vectors)
    assert [splitmix64(k * GAMMA & M64) for k in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4,
                                                                0x06C45D188009454F]
    assert all(unsplitmix64(splitmix64(x)) == x for x in (0, 1, 12345, 2**63, M64))
    ids = np.random.default_rng(5).integers(-(2**63), 2**63 - 1, size=2000, dtype=np.int64)
    for rate in (0.01, 0.3, 0.5, 0.99):
        kept = [int(x) for x in ids if splitmix64(int(x) & M64) < int(rate * 2.0**64)]
        assert shards_sample(ids, rate).tolist() == kept


def test_sampling_keeps_an_id_exactly_below_the_threshold():
    at, below = unsplitmix64(2**63), unsplitmix64(2**63 - 1)  # hashes 0.5 * 2**64 and just under
    ids = as_ids([at, below, at])
    assert shards_sample(ids, 0.5).tolist() == as_ids([below]).tolist()
    top = unsplitmix64(M64)  # the largest hash: kept at rate 1 like every id
    assert shards_sample(as_ids([top, at]), 1.0).tolist() == as_ids([top, at]).tolist()
    assert shards_sample(as_ids([top]), 1 - 2**-53).tolist() == []


IN, IN2 = unsplitmix64(1), unsplitmix64(2)  # sampled at rate 0.5
OUT = unsplitmix64(M64 - 1)  # not sampled below rate 1


@pytest.mark.parametrize("trace, distances, accesses", [
    # 3 of 6 accesses sampled, as expected: A C A's reuse sees C, 1 row scaled to 2
    ([IN, IN2, IN, OUT, OUT, OUT], [2.0], 3),
    # 1 of 4 sampled, 2 expected: the shortfall of 1 is added at distance 0
    ([IN, OUT, OUT, OUT], [0.0], 2),
    # 1 of 6 sampled, 3 expected: 2 added
    ([IN, OUT, OUT, OUT, OUT, OUT], [0.0, 0.0], 3),
    # 6 of 8 sampled, 4 expected: two of the distance-0 reuses removed
    ([IN, IN, IN, IN, IN, IN, OUT, OUT], [0.0, 0.0, 0.0], 4),
    # 4 of 6 sampled, 3 expected: the distance-0 reuse removed, the distance-1 one kept
    ([IN, IN2, IN, IN, OUT, OUT], [2.0], 3),
])
def test_shards_adj_moves_the_sample_to_its_expected_size_at_distance_zero(trace, distances, accesses):
    curve = shards_mrc(as_ids(trace), 0.5)
    assert curve.distances.tolist() == distances and curve.accesses == accesses
    assert (curve.rate, curve.trace_length, curve.method) == (0.5, len(trace), "shards@0.5")
    assert curve.distinct_ids == 2 * len({x for x in trace if x != OUT})
    finite = np.array(distances)
    assert [curve.hit_ratio(r) for r in (0, 1, 2, 3)] == [np.sum(finite < r) / accesses for r in (0, 1, 2, 3)]


def test_an_empty_sample_is_a_curve_without_hits():
    curve = shards_mrc(as_ids([OUT]), 0.5)  # round(0.5) = 0 accesses expected, none sampled
    assert curve.accesses == 0 and curve.distances.size == 0
    assert curve.hit_ratio(10) == 0.0 and curve.hit_ratio(math.inf) == 0.0


def test_the_exact_limit_is_inclusive_and_sampling_has_a_floor():
    ids = np.arange(1000) % 100
    assert mrc_from_trace(ids, exact_limit=1000).method == "exact"
    sampled = mrc_from_trace(ids, exact_limit=999)
    assert sampled.method == "shards@0.999" and sampled.rate == 0.999
    assert mrc_from_trace(ids, exact_limit=0).rate == 1e-4  # never below one in 10,000
    assert mrc_from_trace(ids, rate=0.5).rate == 0.5 and mrc_from_trace(ids, rate=1.0).method == "exact"
    exact = mrc_from_trace(ids, rate=1.0)
    assert exact.distances.tolist() == [99.0] * 900 and exact.distinct_ids == 100 and exact.trace_length == 1000


# ---------------------------------------------------------------- Zipf curves


@pytest.mark.parametrize("heads", [1, 3])
def test_a_uniform_popularity_hits_in_proportion_to_the_cache(heads):
    # s = 0: every row equally likely, so an LRU cache of C of the m rows hits C / m of the time
    z = ZipfMRC(0.0, 1_000, heads=heads)
    m = z.total_rows
    for rows in (0.25, 0.5, 1, 7, 100, m - 1):
        assert z.hit_ratio(rows) == pytest.approx(rows / m, rel=1e-9), rows
    for h in (0.0001, 0.01, 0.5, 0.999):  # C = h * m, rounded up (one more where the root rounds over)
        assert math.ceil(h * m - 1e-6) <= z.rows_for_hit_rate(h) <= math.ceil(h * m - 1e-6) + 1, h


def test_an_integer_exponent_is_the_same_curve():
    assert ZipfMRC(1, 5_000).hit_ratio(100) == ZipfMRC(1.0, 5_000).hit_ratio(100)
    assert ZipfMRC(2, 500, exact_ranks=50).rows_for_hit_rate(0.9) == ZipfMRC(2.0, 500, exact_ranks=50).rows_for_hit_rate(0.9)


def test_a_cache_of_one_row_hits_when_a_row_is_read_twice_in_a_row():
    z = ZipfMRC(1.0, 100)
    p = [1 / r for r in range(1, 101)]
    twice = sum((x / sum(p)) ** 2 for x in p)  # LRU of one row under independent references
    assert abs(z.hit_ratio(1) - twice) < 0.05 * twice  # Che's approximation: 4% under
    assert 0 < z.hit_ratio(0.5) < z.hit_ratio(1) < z.hit_ratio(2)


@pytest.mark.parametrize("s, rows, heads", [(0.7, 3_000, 1), (1.0, 5_000, 3), (1.3, 70_000, 2), (0.0, 10, 7)])
def test_a_cache_of_the_whole_table_hits_every_time(s, rows, heads):
    z = ZipfMRC(s, rows, heads=heads, exact_ranks=1_000, bins=256)
    assert z.hit_ratio(z.total_rows) == 1.0 and z.hit_ratio(z.total_rows * 2) == 1.0
    assert z.rows_for_hit_rate(1.0) == z.total_rows
    assert z.hit_ratio(z.total_rows - 1) < 1.0


# ---------------------------------------------------------------- trace files


def test_a_npy_trace_of_any_integer_type_and_shape_reads_as_flat_int64(tmp_path):
    np.save(tmp_path / "t.npy", np.array([[3, 1], [2, 7]], dtype=np.int32))
    got = load_trace(tmp_path / "t.npy")
    assert got.dtype == np.int64 and got.tolist() == [3, 1, 2, 7]


def test_a_npy_trace_is_never_unpickled(tmp_path):
    class Touch:  # unpickling it would create a file
        def __reduce__(self):
            return (Path.touch, (tmp_path / "unpickled",))

    np.save(tmp_path / "evil.npy", np.array([Touch()], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        load_trace(tmp_path / "evil.npy")
    assert not (tmp_path / "unpickled").exists()


@pytest.mark.parametrize("text, bad", [
    ("3 -1 x 2", "b'x'"),  # a negative id before it is fine
    ("3 X5", "b'X5'"),
    ("3\n--5\n", "b'--5'"),
    ("1 " + "y" * 50, repr(b"y" * 40)),  # long tokens are cut at 40 bytes
])
def test_a_text_trace_names_the_first_token_that_is_not_an_id(tmp_path, text, bad):
    (tmp_path / "t.txt").write_text(text)
    with pytest.raises(ValueError) as e:
        load_trace(tmp_path / "t.txt")
    assert str(e.value) == (f"{tmp_path / 't.txt'}: {bad} is not an integer; "
                            "a text trace holds row ids separated by whitespace")


def test_a_text_trace_holds_64_bit_ids(tmp_path):
    (tmp_path / "t.txt").write_text(f"{2**63 - 1} {-(2**63)}\t0\n")
    assert load_trace(tmp_path / "t.txt").tolist() == [2**63 - 1, -(2**63), 0]
    for big in (2**63, -(2**63) - 1):
        (tmp_path / "big.txt").write_text(f"1 {big}")
        with pytest.raises(ValueError) as e:
            load_trace(tmp_path / "big.txt")
        assert str(e.value) == f"{tmp_path / 'big.txt'}: row id {big} does not fit in 64 bits (int64)"
    (tmp_path / "empty.txt").write_text(" \n")
    empty = load_trace(tmp_path / "empty.txt")
    assert empty.dtype == np.int64 and empty.size == 0


def test_a_missing_trace_says_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_trace(tmp_path / "nope.npy")
    assert str(e.value) == f"no trace file at {tmp_path / 'nope.npy'}: give a .npy int64 array or a text file of row ids"
