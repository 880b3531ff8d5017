"""Rewriting a version-1 table as version 2 (page checksums added), atomically.

The old data is checked against its block checksums while it streams through, so a
damaged table is refused (``ChecksumError``) rather than given fresh checksums; the new
file is written by ``TableWriter`` (temporary file, fsync, rename over the old one).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import TierError
from .format import FORMAT_VERSION, read_header
from .verify import BlockStreamChecker
from .writer import TableWriter

__all__ = ["upgrade_table"]

UPGRADE_CHUNK_BYTES = 32 << 20


def upgrade_table(path: str | os.PathLike[str], progress: bool | None = None) -> bool:
    """Rewrite the table at ``path`` in the current format; False when it already is."""
    header = read_header(path)
    layout = header.layout
    if layout.version == FORMAT_VERSION:
        return False
    rb, rpp, page = layout.row_bytes, layout.rows_per_page, layout.page_bytes
    chunk_pages = max(1, UPGRADE_CHUNK_BYTES // page)
    checker = BlockStreamChecker(header)
    buf = bytearray(chunk_pages * page)
    left = layout.num_rows
    with open(header.path, "rb", buffering=0) as f, \
            TableWriter(Path(path), layout.config, block_size=layout.block_size, progress=progress) as writer:
        for first in range(0, layout.num_pages, chunk_pages):
            pages = min(chunk_pages, layout.num_pages - first)
            view = memoryview(buf)[: pages * page]
            if os.preadv(f.fileno(), [view], layout.data_offset + first * page) != len(view):
                raise TierError(f"{header.path} ended early while upgrading: the file changed; verify it")
            checker.feed(view)
            rows = np.frombuffer(view, np.uint8).reshape(pages, page)[:, : rpp * rb].reshape(-1, rb)
            take = min(len(rows), left)
            writer.write(rows[:take])
            left -= take
    return True
