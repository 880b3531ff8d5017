"""Miss-ratio curves of an LRU row cache: exact stack distances, SHARDS sampling, Zipf.

An access hits an LRU cache of ``C`` rows exactly when its *stack distance* (the number
of distinct other ids seen since the previous access to the same id) is below ``C``;
first accesses always miss. So one pass that computes every stack distance gives the
hit ratio at every cache size at once (Mattson et al., "Evaluation techniques for
storage hierarchies", IBM Systems Journal 1970).

- ``stack_distances``: exact, O(n log^2 n) and vectorised (no Python loop per access):
  the distance of access ``i`` whose previous access is at ``p`` is
  ``(i - p - 1) - #{j < i : prev[j] > p}``, a dominance count done level by level
  as in a bottom-up merge sort. A few million ids take seconds.
- ``shards_mrc``: fixed-rate SHARDS-adj (Waldspurger et al., FAST 2015): keep the ids whose
  hash falls below ``rate``, compute exact distances on that sample, scale by ``1/rate``.
- ``ZipfMRC``: the Che approximation (Che, Tung, Wang 2002) of LRU under independent
  references with Zipf popularity, per hash head, when no trace is at hand.

Every curve answers ``hit_ratio(rows)`` and ``rows_for_hit_rate(h)``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..table.safeio import open_input
from ..units import format_bytes

__all__ = [
    "MissRatioCurve",
    "TraceMRC",
    "ZipfMRC",
    "ExtrapolatedMRC",
    "ramp_to_whole_table",
    "stack_distances",
    "shards_sample",
    "shards_mrc",
    "mrc_from_trace",
    "load_trace",
    "EXACT_LIMIT",
]

EXACT_LIMIT = 4_000_000
"""Traces longer than this are sampled (SHARDS) unless the caller asks otherwise."""

COLD = -1
"""Stack distance of a first access (an infinite distance: always a miss)."""


class MissRatioCurve(Protocol):
    def hit_ratio(self, rows: float) -> float: ...
    def rows_for_hit_rate(self, hit_rate: float) -> int | None: ...


def _previous_occurrence(ids: np.ndarray) -> np.ndarray:
    """``prev[i]`` = index of the previous access to ``ids[i]``, or -1."""
    n = ids.shape[0]
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    prev = np.full(n, -1, dtype=np.int64)
    same = np.empty(n, dtype=bool)
    same[0] = False
    same[1:] = sorted_ids[1:] == sorted_ids[:-1]
    prev[order[same]] = order[np.flatnonzero(same) - 1]
    return prev


def stack_distances(ids: np.ndarray) -> np.ndarray:
    """Exact LRU stack distance of every access (``COLD`` = -1 for first accesses).

    ``ids``: 1-D integer array of row ids in access order.
    """
    ids = np.ascontiguousarray(np.asarray(ids).reshape(-1))
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"row ids must be integers, got dtype {ids.dtype}")
    n = ids.shape[0]
    out = np.full(n, COLD, dtype=np.int64)
    if n == 0:
        return out
    prev = _previous_occurrence(ids.astype(np.int64, copy=False))
    idx = np.arange(n, dtype=np.int64)
    reuse = prev >= 0
    # later[i] = #{j < i : prev[j] > prev[i]}, counted at the one merge level where
    # j sits in the left sibling block of i's block.
    later = np.zeros(n, dtype=np.int64)
    stride = n + 2
    left_pool = idx[reuse]  # a j with prev[j] = -1 never counts
    query_pool = idx[reuse]
    size = 1
    while size < n:
        left = left_pool[(left_pool // size) % 2 == 0]
        right = query_pool[(query_pool // size) % 2 == 1]
        if left.size and right.size:
            keys = np.sort((left // (2 * size)) * stride + prev[left])
            group = (right // (2 * size)) * stride
            hi = np.searchsorted(keys, group + stride, side="left")
            lo = np.searchsorted(keys, group + prev[right], side="right")
            later[right] += hi - lo
        size *= 2
    out[reuse] = idx[reuse] - prev[reuse] - 1 - later[reuse]
    return out


@dataclass(frozen=True)
class TraceMRC:
    """A miss-ratio curve from (possibly sampled and scaled) stack distances.

    ``distances``: sorted finite distances in rows (already scaled by ``1/rate``);
    ``accesses``: the number of accesses they stand for (cold misses included).
    """

    distances: np.ndarray
    accesses: int
    rate: float = 1.0
    trace_length: int = 0
    distinct_ids: int = 0

    @classmethod
    def from_distances(cls, d: np.ndarray, rate: float = 1.0, **info: int) -> "TraceMRC":
        finite = np.sort(d[d >= 0].astype(np.float64) / rate)
        return cls(distances=finite, accesses=int(d.shape[0]), rate=rate, **info)

    @property
    def method(self) -> str:
        return "exact" if self.rate == 1.0 else f"shards@{self.rate:g}"

    def hit_ratio(self, rows: float) -> float:
        """Fraction of accesses an LRU cache of ``rows`` rows serves."""
        if self.accesses == 0:
            return 0.0
        return float(np.searchsorted(self.distances, rows, side="left")) / self.accesses

    def rows_for_hit_rate(self, hit_rate: float) -> int | None:
        """The smallest cache (rows) reaching ``hit_rate``; None when the trace cannot."""
        _check_rate(hit_rate)
        need = math.ceil(hit_rate * self.accesses - 1e-9)
        if need <= 0:
            return 0
        if need > self.distances.shape[0]:
            return None
        return int(math.floor(self.distances[need - 1])) + 1


def ramp_to_whole_table(measured_hit: float, measured_rows: float, table_rows: float, rows: float) -> float:
    """The hit ratio of a cache of ``rows`` rows above the largest one a trace measures
    (``measured_rows``, hitting ``measured_hit``): the trace's remaining misses are first
    touches, reads of rows no access of the trace read before, which a server that has run
    long last read before anything the trace read; a cache larger than the rows the trace
    touched holds ``rows - measured_rows`` of the table's ``table_rows - measured_rows``
    other rows, and so serves that share of them (each such row taken as equally likely:
    hashed n-grams spread uniformly). Linear from ``measured_hit`` to 1.0 at the whole table."""
    if rows >= table_rows:
        return 1.0
    if rows <= measured_rows:
        return measured_hit
    return measured_hit + (1.0 - measured_hit) * (rows - measured_rows) / (table_rows - measured_rows)


@dataclass(frozen=True)
class ExtrapolatedMRC:
    """A measured curve up to ``measured_rows``, extrapolated above by ``ramp_to_whole_table``
    to a hit ratio of 1.0 at ``table_rows`` (every row cached)."""

    base: MissRatioCurve
    measured_rows: float
    table_rows: int

    def __post_init__(self) -> None:
        if not 0 < self.measured_rows <= self.table_rows:
            raise ValueError(f"measured_rows must be within (0, table_rows], got {self.measured_rows} "
                             f"of {self.table_rows}")

    def extrapolated(self, rows: float) -> bool:
        """Whether ``hit_ratio(rows)`` is the extrapolation, not the measurement."""
        return self.measured_rows < rows < self.table_rows

    def hit_ratio(self, rows: float) -> float:
        if rows <= self.measured_rows:
            return self.base.hit_ratio(rows)
        return ramp_to_whole_table(self.base.hit_ratio(self.measured_rows), self.measured_rows, self.table_rows, rows)

    def rows_for_hit_rate(self, hit_rate: float) -> int | None:
        """The smallest cache (rows) reaching ``hit_rate`` (never None: 1.0 at the whole table)."""
        _check_rate(hit_rate)
        top = self.base.hit_ratio(self.measured_rows)
        if hit_rate <= top:
            found = self.base.rows_for_hit_rate(hit_rate)
            if found is not None:
                return min(found, math.ceil(self.measured_rows))
        if hit_rate >= 1.0:
            return self.table_rows
        share = (hit_rate - top) / (1.0 - top)
        return min(self.table_rows, math.ceil(self.measured_rows + share * (self.table_rows - self.measured_rows)))


def _check_rate(hit_rate: float) -> None:
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit rate must be within [0, 1], got {hit_rate}")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each id (SplitMix64 finaliser)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def shards_sample(ids: np.ndarray, rate: float) -> np.ndarray:
    """The accesses whose id hashes below ``rate`` (spatial sampling: all or none of an id)."""
    if not 0 < rate <= 1:
        raise ValueError(f"sampling rate must be in (0, 1], got {rate}")
    ids = np.asarray(ids).reshape(-1)
    if rate == 1:
        return ids
    threshold = np.uint64(min(int(rate * 2.0**64), 2**64 - 1))
    return ids[_splitmix64(ids) < threshold]


def shards_mrc(ids: np.ndarray, rate: float) -> TraceMRC:
    """Fixed-rate SHARDS: exact distances of the sampled accesses, scaled by ``1/rate``."""
    ids = np.asarray(ids).reshape(-1)
    sample = shards_sample(ids, rate)
    d = stack_distances(sample)
    # SHARDS-adj: the sample should hold rate * n accesses; the shortfall or excess
    # (mostly one very hot id falling in or out of the sample) goes to distance 0.
    diff = int(round(rate * ids.shape[0])) - int(sample.shape[0])
    if diff > 0:
        d = np.concatenate([d, np.zeros(diff, dtype=np.int64)])
    elif diff < 0:
        zeros = np.flatnonzero(d == 0)[: -diff]
        d = np.delete(d, zeros)
    return TraceMRC.from_distances(
        d, rate=rate, trace_length=int(ids.shape[0]),
        distinct_ids=int(np.unique(sample).shape[0] / rate),
    )


def mrc_from_trace(ids: np.ndarray, exact_limit: int = EXACT_LIMIT,
                   rate: float | None = None) -> TraceMRC:
    """Exact curve for traces up to ``exact_limit`` ids, SHARDS above (or at ``rate``)."""
    ids = np.asarray(ids).reshape(-1)
    if ids.size == 0:
        raise ValueError("the trace is empty: give at least one row id")
    if rate is None:
        rate = 1.0 if ids.shape[0] <= exact_limit else max(exact_limit / ids.shape[0], 1e-4)
    if rate == 1.0:
        return TraceMRC.from_distances(
            stack_distances(ids), trace_length=int(ids.shape[0]),
            distinct_ids=int(np.unique(ids).shape[0]),
        )
    return shards_mrc(ids, rate)


NPY_MAGIC = b"\x93NUMPY"
MAX_TRACE_BYTES = 16 << 30  # a .npy trace: two billion int64 row ids
MAX_TEXT_TRACE_BYTES = 256 << 20  # a text trace, parsed id by id


def load_trace(path: str | Path) -> np.ndarray:
    """Row ids from a ``.npy`` integer array (told by its magic, whatever the file's name) or a
    text file of integers (any whitespace); a regular file of bounded size (``safeio``)."""
    path = Path(path)
    try:
        f = open_input(path, "trace file")
    except FileNotFoundError:
        raise FileNotFoundError(f"no trace file at {path}: give a .npy int64 array or a text file of row ids") from None
    with f:
        if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
            f.seek(0)
            data = f.read(MAX_TEXT_TRACE_BYTES + 1)
            if len(data) > MAX_TEXT_TRACE_BYTES:
                raise ValueError(f"{path} is over {format_bytes(MAX_TEXT_TRACE_BYTES)} of text: give the trace as "
                                 ".npy int64 (engram-offload trace writes one)")
            return np.array([_row_id(token, path) for token in data.split()], dtype=np.int64)
        if os.fstat(f.fileno()).st_size > MAX_TRACE_BYTES:
            raise ValueError(f"{path} is over {format_bytes(MAX_TRACE_BYTES)}: give a shorter trace")
        f.seek(0)
        try:
            arr = np.load(f, allow_pickle=False)
        except (ValueError, MemoryError) as exc:  # a damaged header, or a shape the file does not hold
            raise ValueError(f"{path} is not a readable .npy array ({exc}): write it again "
                             "(engram-offload trace)") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: the .npy array holds {arr.dtype}; row ids must be integers (int64)")
    return arr.reshape(-1).astype(np.int64, copy=False)


def _row_id(token: bytes, path: Path) -> int:
    """One row id of a text trace: a 64-bit signed integer."""
    try:
        value = int(token)
    except ValueError:
        raise ValueError(
            f"{path}: {token[:40]!r} is not an integer; a text trace holds row ids separated by whitespace"
        ) from None
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{path}: row id {value} does not fit in 64 bits (int64)")
    return value


@dataclass(frozen=True)
class ZipfMRC:
    """LRU under independent references, Zipf(``exponent``) popularity over each head's rows.

    The table has ``heads`` hash heads of ``rows_per_head`` rows each, every token reads one
    row of every head, so the whole table behaves as ``heads`` copies of one Zipf
    distribution. Ranks are grouped into log-spaced bins (exact for the first ranks).
    """

    exponent: float
    rows_per_head: int
    heads: int = 1
    exact_ranks: int = 4096
    bins: int = 2048

    def __post_init__(self) -> None:
        if self.exponent < 0:
            raise ValueError(f"Zipf exponent must be >= 0, got {self.exponent}")
        if self.rows_per_head < 1 or self.heads < 1:
            raise ValueError("rows_per_head and heads must be positive")

    def _levels(self) -> tuple[np.ndarray, np.ndarray]:
        """(count, probability) per popularity level over the whole table."""
        m, s = self.rows_per_head, self.exponent
        k = min(m, self.exact_ranks)
        counts = [np.ones(k)]
        weights = [np.arange(1, k + 1, dtype=np.float64) ** -s]
        if m > k:
            edges = np.unique(np.geomspace(k + 1, m + 1, self.bins).astype(np.int64))
            edges[0], edges[-1] = k + 1, m + 1
            lo, hi = edges[:-1].astype(np.float64), edges[1:].astype(np.float64)
            # mean of x^-s over [lo, hi) by the integral from lo-1/2 to hi-1/2
            a, b = lo - 0.5, hi - 0.5
            if abs(s - 1.0) < 1e-12:
                total = np.log(b / a)
            else:
                total = (b ** (1 - s) - a ** (1 - s)) / (1 - s)
            counts.append(hi - lo)
            weights.append(total / (hi - lo))
        count = np.concatenate(counts)
        w = np.concatenate(weights)
        p = w / np.sum(count * w) / self.heads
        return count * self.heads, p

    def _at(self, t: float) -> tuple[float, float]:
        count, p = self._levels()
        fill = -np.expm1(-p * t)
        return float(np.sum(count * fill)), float(np.sum(count * p * fill))

    def _solve(self, target: float, which: int) -> float:
        lo, hi = 0.0, 1.0
        while self._at(hi)[which] < target and hi < 1e30:
            hi *= 4
        for _ in range(100):
            mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
            if self._at(mid)[which] < target:
                lo = mid
            else:
                hi = mid
        return hi

    @property
    def total_rows(self) -> int:
        return self.rows_per_head * self.heads

    def hit_ratio(self, rows: float) -> float:
        if rows <= 0:
            return 0.0
        if rows >= self.total_rows:
            return 1.0
        return self._at(self._solve(rows, 0))[1]

    def rows_for_hit_rate(self, hit_rate: float) -> int | None:
        _check_rate(hit_rate)
        if hit_rate == 0:
            return 0
        if hit_rate >= 1.0:
            return self.total_rows
        return min(self.total_rows, math.ceil(self._at(self._solve(hit_rate, 1))[0]))
