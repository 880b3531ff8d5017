"""Tiny tables for the tier tests (real files in tmp_path)."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.config import EngramConfig
from engram_offload.table import make_random_table, random_rows
from tier_cases import FORMATS


def _tiny_config(row_format: str = "fp8_e4m3_ue8m0", head_dim: int = 64, starts=(300, 500)) -> EngramConfig:
    """Two layers, orders 2..3, two heads: a few thousand rows."""
    return EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=head_dim,
                        prime_starts=starts, row_format=row_format)


@pytest.fixture
def tiny_config():
    """Factory: ``tiny_config(row_format, head_dim)`` -> a small EngramConfig."""
    return _tiny_config


@pytest.fixture
def config() -> EngramConfig:
    return _tiny_config()


@pytest.fixture(scope="session")
def tables(tmp_path_factory):
    """row format -> (path, expected raw rows ``[num_rows, row_bytes]``), block size 16 KiB."""
    directory = tmp_path_factory.mktemp("tables")
    out = {}
    for fmt, head_dim in FORMATS:
        config = _tiny_config(fmt, head_dim)
        path = make_random_table(directory / f"{fmt}-{head_dim}.tbl", config, seed=11, block_size=16384)
        out[(fmt, head_dim)] = (path, np.concatenate(list(random_rows(config, 11))))
    return out
