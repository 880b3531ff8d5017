"""Admission control: a count-min sketch of recent row accesses decides which misses to cache.

When a cache is full, caching a row seen once evicts a row that may be used again, and
most Engram rows are one-off n-grams. ``FrequencySketch`` estimates how often each id was
asked for recently (4 hashed counters per id, minimum taken; all counters halve after a
window of accesses); a full cache admits a miss only when its estimate reaches ``min_count``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["FrequencySketch"]

_SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                  dtype=np.uint64)


class FrequencySketch:
    """Count-min sketch over int64 ids with periodic halving. Not thread-safe (the cache locks)."""

    def __init__(self, width: int, depth: int = 4, window: int | None = None, min_count: int = 2) -> None:
        if not 1 <= depth <= len(_SEEDS):
            raise ValueError(f"sketch depth must be in 1..{len(_SEEDS)}, got {depth}")
        bits = max(8, int(np.ceil(np.log2(max(2, width)))))
        self._shift = np.uint64(64 - bits)
        self.width = 1 << bits
        self.depth = depth
        self.table = np.zeros((depth, self.width), np.int32)  # [depth, width]
        self.window = int(window or 10 * self.width)
        self.min_count = min_count
        self._seen = 0

    def _cells(self, ids: np.ndarray) -> np.ndarray:
        h = (ids.astype(np.uint64)[None, :] + np.uint64(1)) * _SEEDS[: self.depth, None]  # [depth, n]
        return (h >> self._shift).astype(np.int64)

    def record(self, ids: np.ndarray) -> None:
        """Count one access of each id (ids distinct within the call)."""
        if ids.size == 0:
            return
        cells = self._cells(ids)
        for row in range(self.depth):
            np.add.at(self.table[row], cells[row], 1)
        self._seen += ids.size
        if self._seen >= self.window:
            self.table >>= 1
            self._seen = 0

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: an upper estimate of each id's recent access count."""
        if ids.size == 0:
            return np.empty(0, np.int64)
        cells = self._cells(ids)
        rows = np.arange(self.depth)[:, None]
        return self.table[rows, cells].min(axis=0).astype(np.int64)

    def admit(self, ids: np.ndarray) -> np.ndarray:
        """bool ``[n]``: which ids are frequent enough to enter a full cache."""
        return self.estimate(ids) >= self.min_count
