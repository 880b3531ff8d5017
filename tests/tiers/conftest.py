"""Tiny tables for the tier tests (real files in tmp_path)."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.table import make_random_table, random_rows

from tier_cases import FORMATS
from tiny_tables import tiny_config as _tiny_config


@pytest.fixture(scope="session")
def tables(tmp_path_factory):
    """row format -> (path, expected raw rows ``[num_rows, row_bytes]``), block size 16 KiB."""
    directory = tmp_path_factory.mktemp("tables")
    out = {}
    for fmt, head_dim in FORMATS:
        config = _tiny_config(fmt, head_dim)
        path = make_random_table(directory / f"{fmt}-{head_dim}.tbl", config, seed=11)
        out[(fmt, head_dim)] = (path, np.concatenate(list(random_rows(config, 11))))
    return out
