"""Tier test cases and skips shared by the tier tests."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

TIER_CASES = [
    ("memory", {}),
    ("pinned", {}),
    ("mmap", {}),
    ("direct", {"engine": "threads", "queue_depth": 4}),
    ("direct", {"engine": "threads", "queue_depth": 1}),
    ("direct", {"engine": "uring", "queue_depth": 8}),
]
FORMATS = [("fp8_e4m3_ue8m0", 64), ("fp32", 64), ("bf16", 80), ("fp16", 48), ("int8", 64), ("fp32", 1100)]


def direct_io_refused(directory) -> bool:
    """True when the file system under ``directory`` refuses O_DIRECT (tmpfs does)."""
    probe = os.path.join(directory, ".odirect-probe")
    with open(probe, "wb") as f:
        f.write(bytes(4096))
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return exc.errno == errno.EINVAL
    else:
        os.close(fd)
        return False
    finally:
        os.unlink(probe)


def uring_available() -> bool:
    try:
        from engram_offload.tiers import uring
    except ImportError:
        return False
    return uring.available()


def skip_unavailable(tier: str, options: dict, directory) -> None:
    if tier == "direct" and direct_io_refused(directory):
        pytest.skip(f"O_DIRECT refused on {directory}")
    if options.get("engine") == "uring" and not uring_available():
        pytest.skip("native io_uring helper not available")


def read(t, ids) -> np.ndarray:
    """Rows ``ids`` read from tier ``t``, as a NumPy ``uint8 [n, row_bytes]``."""
    out = torch.empty((len(ids), t.row_bytes), dtype=torch.uint8)
    return t.read_rows(np.asarray(ids, np.int64), out).numpy()
