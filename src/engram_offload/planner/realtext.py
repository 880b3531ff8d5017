"""The hit ratio of an LRU row cache under real text, for when no trace of one's own is at hand.

An access hits an LRU cache of ``C`` rows when fewer than ``C`` distinct rows were read
since the same row's last access (its stack distance, ``planner.mrc``). For hashed n-gram
rows that distance is a property of the text, not of the table (as long as the table is
large enough for few collisions), and it grows with the rows a token reads: so the curve
below is kept per *token-equivalent* of cache (cache rows / rows read per token) and holds
for any table whose tokens read rows the way V4.1-Flash's do.

``REAL_TEXT_HIT`` was measured by ``benchmarks/bench_real_text.py --curve``: the whole of CPython 3.11's
standard library (8.2 million tokens, the benchmark corpus), tokenized with the DeepSeek
tokenizer and hashed into the full ``deepseek-v4.1-flash`` table, 32 sequences of 16-token
pieces a step, each step's ids deduplicated (as the store sees them), stack distances by
SHARDS; the cache starts empty, so first touches count as misses. The trace touches
``REAL_TEXT_DISTINCT`` token-equivalents of rows (11% of that table): a cache that large
holds every row it reads again, and above it ``RealTextMRC`` extrapolates to the whole
table (and says so). Source code repeats itself more than prose, so prose will hit less; a
cache that has served fewer tokens hits less too (docs/planner.md: 0.44-0.52 measured
after 12-35 thousand tokens of a young cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .mrc import ramp_to_whole_table

__all__ = ["RealTextMRC", "REAL_TEXT_CACHE_TOKENS", "REAL_TEXT_DISTINCT", "REAL_TEXT_FIRST_TOUCH", "REAL_TEXT_HIT",
           "REAL_TEXT_TOKENS", "step_unique_fraction"]

REAL_TEXT_TOKENS = 8_243_595
"""Tokens of the measured trace (every file of the standard library of 16 tokens or more)."""
REAL_TEXT_CACHE_TOKENS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
"""Cache sizes, in token-equivalents (cache rows / rows read per token)."""
REAL_TEXT_HIT = (0.0008, 0.0026, 0.2084, 0.4218, 0.5573, 0.6426, 0.7098, 0.7647)
"""Hit ratio at each of ``REAL_TEXT_CACHE_TOKENS`` (``benchmarks/bench_real_text.py``; see the module doc)."""
REAL_TEXT_FIRST_TOUCH = 0.2275
"""The share of the trace's reads that are a row's first (the misses of an unbounded cache)."""
REAL_TEXT_DISTINCT = 1_687_765
"""The rows the trace touched, in token-equivalents: a cache this large hits every re-read."""


STEP_TOKENS = (1, 8, 32, 128, 512)
"""Decode steps' sequences, and prefill chunks' tokens (with the ``PREFILL_TOKENS`` below)."""
DECODE_UNIQUE = (1.0, 0.994, 0.994, 0.9782, 0.9115)
"""Distinct row ids / row ids of a decode step of ``STEP_TOKENS`` sequences, one token each
(``benchmarks/bench_real_text.py --steps``: the standard library's files side by side, steps 20-200)."""
PREFILL_TOKENS = (1, 16, 64, 256, 1024, 4096)
PREFILL_UNIQUE = (1.0, 0.9841, 0.8796, 0.781, 0.6455, 0.5728)
"""The same for a prefill chunk of ``PREFILL_TOKENS`` consecutive tokens of one file: its
n-grams repeat (identifiers, indentation), and each distinct row is read once (the first
200 chunks of files that long)."""


def step_unique_fraction(decode_tokens: int, prefill_tokens: int) -> float:
    """Distinct row ids / row ids of a step of ``decode_tokens`` sequences decoding one token
    each and ``prefill_tokens`` prompt tokens (taken as one chunk), by real text's measured
    repeats (linear in log tokens between the measured sizes, flat beyond the largest)."""
    total = decode_tokens + prefill_tokens
    if total <= 0:
        return 1.0
    distinct = (decode_tokens * _interp_steps(decode_tokens, STEP_TOKENS, DECODE_UNIQUE)
                + prefill_tokens * _interp_steps(prefill_tokens, PREFILL_TOKENS, PREFILL_UNIQUE))
    return distinct / total


def _interp_steps(tokens: int, sizes: tuple[int, ...], fractions: tuple[float, ...]) -> float:
    if tokens <= 1:
        return 1.0
    return float(np.interp(math.log(tokens), np.log(np.asarray(sizes, dtype=np.float64)), fractions))


def _interp_log(x: float) -> float:
    """``REAL_TEXT_HIT`` at ``x`` token-equivalents, linear in log(x) between the measured
    sizes, linear to 0 at no cache below the smallest, flat at the trace's reuse
    (``1 - REAL_TEXT_FIRST_TOUCH``) from ``REAL_TEXT_DISTINCT`` on."""
    xs = np.log(np.asarray((*REAL_TEXT_CACHE_TOKENS, REAL_TEXT_DISTINCT), dtype=np.float64))
    ys = (*REAL_TEXT_HIT, 1.0 - REAL_TEXT_FIRST_TOUCH)
    if x < REAL_TEXT_CACHE_TOKENS[0]:
        return REAL_TEXT_HIT[0] * max(x, 0.0) / REAL_TEXT_CACHE_TOKENS[0]
    return float(np.interp(math.log(x), xs, ys))


@dataclass(frozen=True)
class RealTextMRC:
    """``REAL_TEXT_HIT`` for a table of ``table_rows`` rows whose tokens read
    ``rows_per_token`` rows each, over every cache size up to the whole table.

    Measured up to the rows the trace touched (``REAL_TEXT_DISTINCT`` token-equivalents);
    above, EXTRAPOLATED (``mrc.ramp_to_whole_table``): the trace's first touches
    (``REAL_TEXT_FIRST_TOUCH`` of its reads) are served in the share of the table's other
    rows the cache holds beyond the ones the trace touched, linear to 1.0 at the whole
    table (text that returns to old n-grams more than uniformly would hit more).
    ``table_rows=None``: no extrapolation, flat at the trace's reuse."""

    rows_per_token: int
    table_rows: int | None = None

    def __post_init__(self) -> None:
        if self.rows_per_token < 1:
            raise ValueError(f"rows_per_token must be >= 1, got {self.rows_per_token}")
        if self.table_rows is not None and self.table_rows < 1:
            raise ValueError(f"table_rows must be >= 1, got {self.table_rows}")

    @property
    def measured_rows(self) -> float:
        """The largest cache (rows) the measured curve covers; the extrapolation starts there
        (at half the table for a table smaller than the rows the trace touched)."""
        touched = REAL_TEXT_DISTINCT * self.rows_per_token
        return touched if self.table_rows is None else min(touched, self.table_rows / 2)

    def hit_ratio(self, rows: float) -> float:
        """Fraction of row reads a cache of ``rows`` rows serves."""
        if rows <= 0:
            return 0.0
        start = self.measured_rows
        if self.table_rows is None or rows <= start:
            return _interp_log(rows / self.rows_per_token)
        if rows >= self.table_rows:
            return 1.0
        return ramp_to_whole_table(_interp_log(start / self.rows_per_token), start, self.table_rows, rows)

    def extrapolated(self, rows: float) -> bool:
        """Whether ``hit_ratio(rows)`` is the extrapolation, not the measurement."""
        return self.table_rows is not None and self.measured_rows < rows < self.table_rows

    def rows_for_hit_rate(self, hit_rate: float) -> int | None:
        """The smallest cache (rows) reaching ``hit_rate``; None above the curve's ceiling
        (only without ``table_rows``)."""
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"hit rate must be within [0, 1], got {hit_rate}")
        top = float(self.table_rows if self.table_rows is not None else self.measured_rows)
        if hit_rate > self.hit_ratio(top):
            return None
        lo, hi = 0.0, top
        for _ in range(100):
            mid = (lo + hi) / 2
            if self.hit_ratio(mid) >= hit_rate:
                hi = mid
            else:
                lo = mid
        return int(math.ceil(hi))
