"""Checking table data against its checksums: whole files, blocks on first touch, streams of
data fed in file order, and pages (format version 2) as they are read."""

from __future__ import annotations

import os
import threading
from typing import Callable

import numpy as np
import xxhash

from ..errors import ChecksumError
from .format import TableHeader, read_header
from .pagesum import page_sums
from .progress import byte_progress

__all__ = ["verify_table", "BlockVerifier", "BlockStreamChecker", "bad_pages", "checksum_error",
           "page_checksum_error"]


def checksum_error(header: TableHeader, block: int) -> ChecksumError:
    start, end = header.layout.block_range(block)
    return ChecksumError(
        f"{header.path}: block {block} (bytes {start:,}..{end:,}) does not match its checksum; "
        "the table is damaged: rewrite it (make-table / convert) or restore a copy"
    )


def page_checksum_error(header: TableHeader, page: int, reread: bool = True) -> ChecksumError:
    first, last = header.layout.page_rows(page)
    again = " after a re-read" if reread else ""
    return ChecksumError(
        f"{header.path}: data page {page} (rows {first:,}..{last:,}) does not match its checksum{again}; "
        "the table is damaged: rewrite it (make-table / convert) or restore a copy"
    )


def bad_pages(header: TableHeader, pages: np.ndarray, data) -> np.ndarray:
    """Positions ``i`` where page ``pages[i]`` (int64 ``[m]``), held at ``data[i*page_bytes:]``
    (whole pages back to back), differs from its checksum. The table must have page sums."""
    assert header.page_sums is not None
    got = page_sums(data, header.layout.page_bytes)
    return np.flatnonzero(got != header.page_sums[pages])


def verify_table(path: str | os.PathLike[str], progress: bool | None = None) -> TableHeader:
    """Read every block of the table at ``path`` and check it; return its header.

    Raises ``TableFormatError`` for a damaged header or size, ``ChecksumError`` naming the
    first bad block and its byte range (or, in version 2, the first bad page and its rows).
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
            if header.page_sums is not None:
                first = (start - layout.data_offset) // layout.page_bytes
                pages = np.arange(first, first + (end - start) // layout.page_bytes)
                bad = bad_pages(header, pages, view)
                if bad.size:
                    raise page_checksum_error(header, int(pages[bad[0]]), reread=False)
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


class BlockStreamChecker:
    """Checks the data region, fed in file order in pieces of any size, block by block."""

    def __init__(self, header: TableHeader) -> None:
        self.header = header
        self.block = 0
        self._hash = xxhash.xxh3_64()
        self._missing = self._block_bytes()

    def _block_bytes(self) -> int:
        start, end = self.header.layout.block_range(self.block)
        return end - start

    def feed(self, data: memoryview) -> None:
        """``ChecksumError`` naming the block as soon as a block is complete and wrong."""
        while len(data):
            piece, data = data[: self._missing], data[self._missing:]
            self._hash.update(piece)
            self._missing -= len(piece)
            if self._missing == 0:
                if self._hash.intdigest() != int(self.header.block_digests[self.block]):
                    raise checksum_error(self.header, self.block)
                self.block += 1
                self._hash.reset()
                self._missing = self._block_bytes() if self.block < self.header.layout.num_blocks else 0
