"""Counters and latency percentiles for one level of a cached store."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np

__all__ = ["LevelStats", "percentiles_ms"]

LATENCY_SAMPLES = 4096


def percentiles_ms(samples: Any) -> dict[str, float]:
    """p50/p90/p99 of durations in seconds, in milliseconds (zeros when there are none)."""
    arr = np.asarray(list(samples), dtype=np.float64)
    if arr.size == 0:
        return {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    p = np.percentile(arr, [50, 90, 99]) * 1e3
    return {"p50_ms": float(p[0]), "p90_ms": float(p[1]), "p99_ms": float(p[2])}


class LevelStats:
    """requests (calls), rows asked, hits, misses, bytes read, fetch latency of one level."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.requests = 0
            self.rows = 0
            self.hits = 0
            self.misses = 0
            self.bytes_read = 0
            self.seconds = 0.0
            self.latency: deque[float] = deque(maxlen=LATENCY_SAMPLES)

    def record(self, rows: int, hits: int, bytes_read: int, seconds: float) -> None:
        with self._lock:
            self.requests += 1
            self.rows += rows
            self.hits += hits
            self.misses += rows - hits
            self.bytes_read += bytes_read
            self.seconds += seconds
            self.latency.append(seconds)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "level": self.name,
                "requests": self.requests,
                "rows": self.rows,
                "hits": self.hits,
                "misses": self.misses,
                "hit_rate": self.hits / self.rows if self.rows else 0.0,
                "bytes_read": self.bytes_read,
                "read_seconds": self.seconds,
                **percentiles_ms(self.latency),
            }
