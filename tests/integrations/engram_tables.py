"""V4.1-shaped Engram tables for the plugin tests: fp8 rows of 264 bytes, tiny primes.

The prime search starts at 67: vLLM 0.33.0's ``_is_prime`` calls 61 composite, so its layout
differs from engram-offload's (and from the checkpoint's) for searches that reach 61.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engram_offload.engram.config import EngramConfig
from engram_offload.pool.publish import publish_table
from engram_offload.pool.servers import redis_server_missing, start_local_pool
from engram_offload.serving.rowserver import start_row_server
from engram_offload.table import random_rows
from engram_offload.table.writer import write_table

PRIME_START = 67
SOCKET = "rows.sock"


def v41_config(n_heads: int = 8, max_ngram_size: int = 4, layer_ids=(1, 14)) -> EngramConfig:
    """V4.1's shape (fp8 rows, head_dim 256, one prime start for every order), small primes.
    The defaults give V4.1-Flash's 24 columns a layer."""
    return EngramConfig(layer_ids=tuple(layer_ids), max_ngram_size=max_ngram_size, n_heads=n_heads, head_dim=256,
                        prime_starts=(PRIME_START,) * (max_ngram_size - 1), variant="v4.1",
                        row_format="fp8_e4m3_ue8m0", hidden_size=64, hc_mult=2)


def table_rows(config: EngramConfig, seed: int = 0) -> np.ndarray:
    """Seeded raw rows ``uint8 [num_rows, 264]``; a few rows carry the scale bytes 0 and 255."""
    raw = np.concatenate(list(random_rows(config, seed)))
    d = config.head_dim
    raw[3, d] = 0  # scale byte 0: vLLM decodes it to 0.0
    raw[5, d + 1] = 255  # scale byte 255: inf
    raw[5, 32:64] = np.arange(32, dtype=np.uint8) & 0x3F  # values 0 among them: 0 * inf
    last = config.num_rows - 1
    raw[last, d:] = (0, 255, 0, 255, 1, 254, 127, 128)
    return raw


def write_v41_table(path: Path, config: EngramConfig, seed: int = 0) -> tuple[Path, np.ndarray]:
    raw = table_rows(config, seed)
    return write_table(path, config, raw), raw


def write_other_model_table(path: Path) -> Path:
    """A table of another model's layout: V4.1's shape, other bucket primes (a start of 71)."""
    other = v41_config().replace(prime_starts=(71, 71, 71))
    return write_table(path, other, np.concatenate(list(random_rows(other, 1))))


@contextmanager
def served_tables(folder: Path, seed: int, socket_prefix: str) -> Iterator[types.SimpleNamespace]:
    """One V4.1 table in ``folder`` (``table``, its rows ``raw``) beside another model's
    (``other``), served by a row server on the mmap tier (``socket``, in a short folder of /tmp)
    and, where redis-server runs, published to a one-node Redis pool (``pool_table``: its URL,
    else None); the servers are stopped on exit."""
    table, raw = write_v41_table(folder / "v41.table", v41_config(), seed=seed)
    other = write_other_model_table(folder / "other.table")
    sockets = Path(tempfile.mkdtemp(prefix=socket_prefix, dir="/tmp"))
    server = start_row_server(table, sockets / SOCKET, tier="mmap")
    pool = None if redis_server_missing() else start_local_pool(1, None, folder / "redis")
    try:
        pool_table = None
        if pool is not None:  # the table in a Redis pool too: the remote tier
            pool_table = f"{pool.url}/{publish_table(table, pool.url, progress=False)['fingerprint']}"
        yield types.SimpleNamespace(table=table, raw=raw, other=other, socket=sockets / SOCKET, server_tier="mmap",
                                    pool_table=pool_table)
    finally:
        if pool is not None:
            pool.stop()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        shutil.rmtree(sockets, ignore_errors=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, but any NaN equals any NaN (0 * inf gives a NaN whose sign bit may differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.uint8:
        return torch.equal(a, b)
    nan = torch.isnan(a.float())
    if not torch.equal(nan, torch.isnan(b.float())):
        return False
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])
