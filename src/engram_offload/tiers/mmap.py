"""``mmap`` tier: the file memory-mapped, rows served by the page cache (the baseline).

Reads fault in 4 KiB pages on demand (MADV_RANDOM turns readahead off). With
``verify_reads`` each block is checked against its checksum the first time a read
touches it.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from ..table.format import TableHeader
from ..table.verify import BlockVerifier
from ._buffers import gather_at, madvise_quietly
from .base import Tier

__all__ = ["MmapTier"]


class MmapTier(Tier):
    name = "mmap"

    def __init__(self, header: TableHeader, *, verify_reads: bool = False) -> None:
        super().__init__(header)
        fd = os.open(header.path, os.O_RDONLY)
        try:
            # Private mapping: writable as far as Python knows (torch wants that), never written.
            self._mm = mmap.mmap(fd, header.layout.file_bytes, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self.random_advice = madvise_quietly(self._mm, "MADV_RANDOM")
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)  # [file_bytes]
        self._verifier = BlockVerifier(header, self._block) if verify_reads else None

    def _block(self, block: int) -> bytes:
        start, end = self.layout.block_range(block)
        return self._mm[start:end]

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        offsets = self.layout.row_offsets(ids)
        if self._verifier is not None:
            self._verifier.ensure(offsets)
        gather_at(self._bytes, offsets, out)
        self._count(reads=len(ids), bytes_read=len(ids) * self.row_bytes)

    def stats(self) -> dict:
        verified = self._verifier.blocks_verified if self._verifier else 0
        return {**super().stats(), "madv_random": self.random_advice, "blocks_verified": verified}

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._bytes = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass
