"""``mmap`` tier: the file memory-mapped, rows served by the page cache (the baseline).

Reads fault in 4 KiB pages on demand (MADV_RANDOM turns readahead off; ``stats()``
reports whether the kernel took the advice). With ``verify_reads`` each block is
checked against its checksum the first time a read touches it.

Two hazards of a mapping are kept away from readers: ``close`` waits for reads in flight
before unmapping (``Tier.close``), and each read first checks (``fstat``, about a
microsecond) that the file still has its full size and its modification time, so a table
truncated under an open store gives a ``TierError`` instead of a SIGBUS, and one rewritten
in place gives a ``TierError`` instead of a mix of old and new rows. A change racing a read
that already passed the check is not covered: replace table files by renaming a new file
over them (as ``make-table`` and ``convert`` do), never by rewriting them in place.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from ..errors import TierError
from ..table.format import TableHeader
from ..table.verify import BlockVerifier
from ._buffers import gather_at, madvise_quietly
from .base import Tier

__all__ = ["MmapTier"]


class MmapTier(Tier):
    name = "mmap"

    def __init__(self, header: TableHeader, *, verify_reads: bool = False) -> None:
        super().__init__(header)
        self._fd = os.open(header.path, os.O_RDONLY)  # kept for the size check of every read
        try:
            # Private mapping: writable as far as Python knows (torch wants that), never written.
            self._mm = mmap.mmap(self._fd, header.layout.file_bytes, access=mmap.ACCESS_COPY)
        except BaseException:
            os.close(self._fd)
            raise
        self._mtime_ns = os.fstat(self._fd).st_mtime_ns
        self.random_advice = madvise_quietly(self._mm, "MADV_RANDOM")
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)  # [file_bytes]
        self._verifier = BlockVerifier(header, self._block) if verify_reads else None

    def _check_unchanged(self) -> None:
        st = os.fstat(self._fd)
        if st.st_size < self.layout.file_bytes:
            what = f"shrank to {st.st_size:,} bytes (the table has {self.layout.file_bytes:,})"
        elif st.st_mtime_ns != self._mtime_ns:
            what = "was modified (its mtime changed)"
        else:
            return
        raise TierError(
            f"{self.header.path} {what} while open: it was truncated or rewritten in place; "
            "close the store and reopen the table once it is whole (verify it first)"
        )

    def _block(self, block: int) -> bytes:
        start, end = self.layout.block_range(block)
        return self._mm[start:end]

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        self._check_unchanged()
        offsets = self.layout.row_offsets(ids)
        if self._verifier is not None:
            self._verifier.ensure(offsets)
        gather_at(self._bytes, offsets, out)
        self._count(reads=len(ids), bytes_read=len(ids) * self.row_bytes)

    def stats(self) -> dict:
        verified = self._verifier.blocks_verified if self._verifier else 0
        return {**super().stats(), "madv_random": self.random_advice, "blocks_verified": verified}

    def _release(self) -> None:
        self._bytes = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps later
            pass
        os.close(self._fd)
