"""Checking table data against its block checksums: whole files, or blocks on first touch."""

from __future__ import annotations

import os
import threading
from typing import Callable

import numpy as np
import xxhash

from ..errors import ChecksumError
from .format import TableHeader, read_header
from .progress import byte_progress

__all__ = ["verify_table", "BlockVerifier", "checksum_error"]


def checksum_error(header: TableHeader, block: int) -> ChecksumError:
    start, end = header.layout.block_range(block)
    return ChecksumError(
        f"{header.path}: block {block} (bytes {start:,}..{end:,}) does not match its checksum; "
        "the table is damaged: rewrite it (make-table / convert) or restore a copy"
    )


def verify_table(path: str | os.PathLike[str], progress: bool | None = None) -> TableHeader:
    """Read every block of the table at ``path`` and check it; return its header.

    Raises ``TableFormatError`` for a damaged header or size, ``ChecksumError`` naming the
    first bad block and its byte range.
    """
    header = read_header(path)
    layout = header.layout
    with open(header.path, "rb", buffering=0) as f, \
            byte_progress(f"verifying {header.path.name}", layout.data_bytes, progress) as advance:
        buf = bytearray(layout.block_size)
        for block in range(layout.num_blocks):
            start, end = layout.block_range(block)
            view = memoryview(buf)[: end - start]
            got = os.preadv(f.fileno(), [view], start)
            if got != end - start or xxhash.xxh3_64_intdigest(view) != int(header.block_digests[block]):
                raise checksum_error(header, block)
            advance(end - start)
    return header


class BlockVerifier:
    """Verifies each data block once, the first time a read touches it (thread-safe).

    ``read_block(block) -> bytes-like`` returns the block's bytes from the tier's medium.
    """

    def __init__(self, header: TableHeader, read_block: Callable[[int], memoryview | bytes]) -> None:
        self.header = header
        self._read_block = read_block
        self._ok = np.zeros(header.layout.num_blocks, dtype=bool)
        self._lock = threading.Lock()
        self.blocks_verified = 0

    def blocks_of(self, offsets: np.ndarray) -> np.ndarray:
        """Block indices of file byte ``offsets`` (int64) in the data region."""
        layout = self.header.layout
        return (offsets - layout.data_offset) // layout.block_size

    def ensure(self, offsets: np.ndarray) -> None:
        """Verify every not-yet-verified block holding one of ``offsets``; raise ``ChecksumError``."""
        blocks = self.blocks_of(offsets)
        todo = np.unique(blocks[~self._ok[blocks]])
        for block in todo.tolist():
            with self._lock:
                if self._ok[block]:
                    continue
                data = self._read_block(block)
                if xxhash.xxh3_64_intdigest(data) != int(self.header.block_digests[block]):
                    raise checksum_error(self.header, block)
                self._ok[block] = True
                self.blocks_verified += 1
