"""Helpers of the cache tests: a fake tier over rows in memory that counts and can fail, the
tiny config, rows for the RowCache tests, and a thread hammer."""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import torch

from engram_offload.engram.config import EngramConfig
from engram_offload.errors import TierError

from tiny_tables import tiny_config

ROW_BYTES = 8  # the row width of the RowCache unit tests


def rows_for(ids: np.ndarray) -> torch.Tensor:
    """Distinct uint8 rows ``[n, ROW_BYTES]`` for ids (row i: ids[i] * 7 + 0..7, mod 256)."""
    return torch.from_numpy((ids[:, None] * 7 + np.arange(ROW_BYTES)[None]).astype(np.uint8))


def small_config() -> EngramConfig:
    """The cache tests' table layout: ``tiny_config`` at head_dim 32."""
    return tiny_config(head_dim=32)


def hammer(worker: Callable[[int], Any], threads: int) -> None:
    """Run ``worker(seed)`` in ``threads`` threads released together; re-raise the first failure."""
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            start.wait()
            worker(seed)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    pool = [threading.Thread(target=run, args=(s,)) for s in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


class FakeTier:
    """Rows ``uint8 [num_rows, row_bytes]`` in memory; row i's bytes are derived from i."""

    def __init__(self, num_rows: int, row_bytes: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.rows = torch.from_numpy(rng.integers(0, 256, size=(num_rows, row_bytes), dtype=np.uint8))
        self.num_rows, self.row_bytes = num_rows, row_bytes
        self.reads = 0
        self.rows_read = 0
        self.fail_next = 0  # fail this many reads
        self.before_read = None  # hook(ids) called before copying
        self._lock = threading.Lock()

    def read_rows(self, ids: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self.reads += 1
            self.rows_read += len(ids)
            fail = self.fail_next > 0
            if fail:
                self.fail_next -= 1
        if self.before_read is not None:
            self.before_read(ids)
        if fail:
            raise TierError(f"injected read failure for {len(ids)} rows")
        out.copy_(self.rows[torch.from_numpy(np.asarray(ids, np.int64))])
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"tier": "fake", "requests": self.reads, "rows": self.rows_read}

    def close(self) -> None:
        pass
