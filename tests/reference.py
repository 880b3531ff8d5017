"""An independent, position-by-position reading of SPEC section 3, used as a test oracle."""

from __future__ import annotations

import numpy as np

from engram_offload.config import EngramConfig


def reference_row_ids(config: EngramConfig, token_map: np.ndarray, ids: list[int],
                      dead: list[bool] | None = None) -> np.ndarray:
    """One sequence of raw ids -> int64 [T, L, C] global row ids, with Python integers."""
    vprime = int(max(token_map)) + 1
    pad = int(token_map[config.pad_id])
    comp = [int(token_map[t]) if t >= 0 else t for t in ids]
    dead = dead or [False] * len(ids)
    n = config.max_ngram_size
    out = np.zeros((len(ids), len(config.layer_ids), config.cols_per_layer), np.int64)
    for li, layer in enumerate(config.layer_ids):
        mult = [int(m) for m in config.multipliers(layer, vprime)]
        primes = config.primes[layer]
        offsets = config.head_offsets(layer)
        for p in range(len(ids)):
            c, reached = [], False
            for k in range(n):
                q = p - k
                reached = reached or (q >= 0 and dead[q])
                c.append(pad if q < 0 or reached else comp[q])
            col = 0
            for order in range(2, n + 1):
                mix = 0
                for k in range(order):
                    mix ^= c[k] * mult[k]
                for prime in primes[order - 2]:
                    out[p, li, col] = mix % prime + offsets[col]
                    col += 1
    return out
