"""The row server tests' table and socket folder."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from engram_offload.table import make_random_table, random_rows

from tiny_tables import tiny_config


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """A small fp8 table and its rows (``[num_rows, row_bytes]`` uint8)."""
    config = tiny_config("fp8_e4m3_ue8m0", 64)
    path = make_random_table(tmp_path_factory.mktemp("rowserver") / "t.table", config, seed=8)
    return path, np.concatenate(list(random_rows(config, 8)))


@pytest.fixture
def socket_dir():
    """A short folder for Unix sockets (their paths are limited to 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)
