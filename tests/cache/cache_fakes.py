"""Fake media for the cache tests: a tier over rows in memory that counts and can fail."""

from __future__ import annotations

import threading

import numpy as np
import torch

from engram_offload.config import EngramConfig
from engram_offload.errors import TierError


def small_config() -> EngramConfig:
    return EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=32,
                        prime_starts=(300, 500), row_format="fp8_e4m3_ue8m0")


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

    def close(self) -> None:
        pass
