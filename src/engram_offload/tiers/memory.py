"""``memory`` tier: the whole table as dense rows in RAM (huge pages where the OS allows)."""

from __future__ import annotations

import mmap

import numpy as np
import torch
import xxhash

from ..table.format import TableHeader
from ..table.progress import byte_progress
from ..table.verify import checksum_error
from .base import Tier

__all__ = ["MemoryTier", "load_dense_rows"]

LOAD_CHUNK_BYTES = 32 << 20


def load_dense_rows(
    header: TableHeader, verify: bool = False, progress: bool | None = None
) -> tuple[torch.Tensor, mmap.mmap, bool]:
    """Read a table's rows into an anonymous mapping as dense ``uint8 [num_rows, row_bytes]``.

    Returns (rows, the mapping, whether MADV_HUGEPAGE was accepted). ``verify`` checks
    every block's checksum while loading (``ChecksumError`` naming the block).
    """
    layout = header.layout
    rb, rpp, page = layout.row_bytes, layout.rows_per_page, layout.page_bytes
    nbytes = layout.num_rows * rb
    mm = mmap.mmap(-1, max(mmap.PAGESIZE, nbytes))
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    huge = False
    if advice is not None:
        try:
            mm.madvise(advice)
            huge = True
        except OSError:
            pass
    dense = np.frombuffer(mm, np.uint8, count=nbytes).reshape(layout.num_rows, rb)
    chunk_pages = max(1, (LOAD_CHUNK_BYTES // layout.block_size) * layout.block_size // page)
    staging = bytearray(chunk_pages * page)
    row = 0
    with open(header.path, "rb", buffering=0) as f, \
            byte_progress(f"loading {header.path.name}", layout.data_bytes, progress) as advance:
        f.seek(layout.data_offset)
        for first_page in range(0, layout.num_pages, chunk_pages):
            pages = min(chunk_pages, layout.num_pages - first_page)
            view = memoryview(staging)[: pages * page]
            got = f.readinto(view)
            if got != len(view):
                raise EOFError(f"{header.path} ended early while loading; the file changed under us")
            if verify:
                _verify_chunk(header, first_page * page, view)
            paged = np.frombuffer(view, np.uint8).reshape(pages, page)[:, : rpp * rb]
            take = min(pages * rpp, layout.num_rows - row)
            dense[row: row + take] = paged.reshape(pages * rpp, rb)[:take]
            row += take
            advance(len(view))
    return torch.from_numpy(dense), mm, huge


def _verify_chunk(header: TableHeader, data_start: int, view: memoryview) -> None:
    bs = header.layout.block_size  # chunks start on block boundaries
    for i in range(0, len(view), bs):
        block = (data_start + i) // bs
        if xxhash.xxh3_64_intdigest(view[i: i + bs]) != int(header.block_digests[block]):
            raise checksum_error(header, block)


class MemoryTier(Tier):
    """All rows in host memory; a read is one ``index_select``.

    Options: ``verify_reads`` (check every block's checksum while loading),
    ``progress`` (bar while loading; default for large tables).
    """

    name = "memory"

    def __init__(self, header: TableHeader, *, verify_reads: bool = False, progress: bool | None = None) -> None:
        super().__init__(header)
        self._rows, self._mm, self.huge_pages = load_dense_rows(header, verify_reads, progress)
        self.verify_reads = verify_reads

    @property
    def rows(self) -> torch.Tensor:
        """The dense rows, uint8 ``[num_rows, row_bytes]`` (read only by convention)."""
        return self._rows

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        torch.index_select(self._rows, 0, torch.from_numpy(ids), out=out)
        self._count(bytes_read=len(ids) * self.row_bytes)

    def stats(self) -> dict:
        return {**super().stats(), "huge_pages": self.huge_pages, "verified_on_load": self.verify_reads}

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._rows = None  # type: ignore[assignment]
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the GC frees it later
                pass
