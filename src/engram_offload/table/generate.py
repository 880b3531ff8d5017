"""Seeded random rows for benchmark tables: valid, finite values, generated as raw bytes.

The same (config, seed) always gives the same bytes. Generation is far faster than disk
writes, so writing a GiB table is I/O bound.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np

from ..engram.config import EngramConfig
from ..engram.rows import FP8_BLOCK
from .writer import write_table

__all__ = ["random_rows", "make_random_table"]

CHUNK_ROWS = 1 << 16


def random_rows(config: EngramConfig, seed: int = 0, chunk_rows: int = CHUNK_ROWS) -> Iterator[np.ndarray]:
    """Yield raw rows ``uint8 [k, row_bytes]`` in chunks, ``config.num_rows`` in all."""
    rng = np.random.default_rng(seed)
    d, fmt = config.head_dim, config.row_format
    for start in range(0, config.num_rows, chunk_rows):
        k = min(chunk_rows, config.num_rows - start)
        yield _chunk(rng, fmt, k, d)


def _chunk(rng: np.random.Generator, fmt: str, k: int, d: int) -> np.ndarray:
    if fmt == "fp8_e4m3_ue8m0":
        # fp8 e4m3fn byte = sign | 4-bit exponent | 3-bit mantissa. Clearing the top exponent
        # bit keeps |value| <= 1.875 and rules out NaN (0x7F/0xFF); scales 2**-7 .. 1.
        values = np.frombuffer(rng.bytes(k * d), np.uint8).reshape(k, d) & np.uint8(0xBF)
        scales = np.uint8(127) - (np.frombuffer(rng.bytes(k * d // FP8_BLOCK), np.uint8) & np.uint8(7))
        return np.concatenate([values, scales.reshape(k, d // FP8_BLOCK)], axis=1)
    if fmt == "int8":
        values = np.frombuffer(rng.bytes(k * d), np.uint8).reshape(k, d)
        scales = (rng.random(k, dtype=np.float32) * 1e-3 + 1e-4).astype("<f4")
        return np.concatenate([values, scales.view(np.uint8).reshape(k, 4)], axis=1)
    x = rng.standard_normal((k, d), dtype=np.float32) * np.float32(0.05)  # [k, d]
    if fmt == "fp32":
        return x.astype("<f4").view(np.uint8)
    if fmt == "fp16":
        return x.astype("<f2").view(np.uint8)
    if fmt == "bf16":  # round-to-nearest-even on the float32 bits
        bits = x.view(np.uint32)
        bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return bits.astype("<u2").view(np.uint8)
    raise ValueError(f"no random generator for row format {fmt!r}")


def make_random_table(
    path: str | os.PathLike[str],
    config: EngramConfig,
    seed: int = 0,
    *,
    progress: bool | None = None,
) -> Path:
    """Write a table of seeded random rows at ``config``'s layout."""
    return write_table(path, config, random_rows(config, seed), progress=progress)
