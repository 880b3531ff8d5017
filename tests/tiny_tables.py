"""Tiny Engram configs for tests that write real table files."""

from __future__ import annotations

from engram_offload.engram.config import EngramConfig


def tiny_config(row_format: str = "fp8_e4m3_ue8m0", head_dim: int = 64, starts=(300, 500)) -> EngramConfig:
    """Two layers, orders 2..3, two heads: a few thousand rows."""
    return EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=head_dim,
                        prime_starts=starts, row_format=row_format)
