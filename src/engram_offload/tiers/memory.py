"""``memory`` tier: the whole table as dense rows in RAM (huge pages where the OS allows)."""

from __future__ import annotations

import mmap

import numpy as np
import torch
import xxhash

from ..errors import TierError
from ..table.format import TableHeader
from ..table.progress import byte_progress
from ..table.verify import checksum_error
from .base import Tier

__all__ = ["MemoryTier", "check_free_memory", "load_dense_rows", "mem_available"]

LOAD_CHUNK_BYTES = 32 << 20
MEMINFO = "/proc/meminfo"


def mem_available() -> int | None:
    """Bytes the kernel can hand out without swapping (``MemAvailable``), or None if unknown."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_free_memory(header: TableHeader, what: str, copies: int = 1) -> None:
    """``TierError`` when loading ``copies`` of ``header``'s rows would need more than
    ``MemAvailable``."""
    need = copies * header.layout.num_rows * header.layout.row_bytes
    available = mem_available()
    if available is not None and need > available:
        held = " (two copies while the rows are pinned)" if copies == 2 else ""
        raise TierError(
            f"{header.path}: the {what} tier loads the whole table into RAM: it needs "
            f"{need / 2**30:,.2f} GiB{held} and {available / 2**30:,.2f} GiB is available (MemAvailable); "
            "use the mmap or direct tier, free memory, or pass check_memory=False to load anyway"
        )


class _BlockChecker:
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


def load_dense_rows(
    header: TableHeader, verify: bool = False, progress: bool | None = None
) -> tuple[torch.Tensor, mmap.mmap, bool]:
    """Read a table's rows into an anonymous mapping as dense ``uint8 [num_rows, row_bytes]``.

    Returns (rows, the mapping, whether MADV_HUGEPAGE was accepted). ``verify`` checks
    every block's checksum while loading (``ChecksumError`` naming the block), whatever
    the block size.
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
    chunk_pages = max(1, LOAD_CHUNK_BYTES // page)
    staging = bytearray(chunk_pages * page)
    checker = _BlockChecker(header) if verify else None
    row = 0
    with open(header.path, "rb", buffering=0) as f, \
            byte_progress(f"loading {header.path.name}", layout.data_bytes, progress) as advance:
        f.seek(layout.data_offset)
        for first_page in range(0, layout.num_pages, chunk_pages):
            pages = min(chunk_pages, layout.num_pages - first_page)
            view = memoryview(staging)[: pages * page]
            got = f.readinto(view)
            if got != len(view):
                raise TierError(f"{header.path} ended early while loading: the file changed under us; "
                                "check it with `engram-offload verify` and reopen it")
            if checker is not None:
                checker.feed(view)
            paged = np.frombuffer(view, np.uint8).reshape(pages, page)[:, : rpp * rb]
            take = min(pages * rpp, layout.num_rows - row)
            dense[row: row + take] = paged.reshape(pages * rpp, rb)[:take]
            row += take
            advance(len(view))
    return torch.from_numpy(dense), mm, huge


class MemoryTier(Tier):
    """All rows in host memory; a read is one ``index_select``.

    Options: ``verify_reads`` (check every block's checksum while loading),
    ``progress`` (bar while loading; default for large tables), ``check_memory``
    (refuse with ``TierError`` when the rows exceed ``MemAvailable``; False to insist).
    """

    name = "memory"

    def __init__(self, header: TableHeader, *, verify_reads: bool = False, progress: bool | None = None,
                 check_memory: bool = True) -> None:
        super().__init__(header)
        if check_memory:
            check_free_memory(header, self.name, self._load_copies())
        self._rows, self._mm, self.huge_pages = load_dense_rows(header, verify_reads, progress)
        self.verify_reads = verify_reads

    def _load_copies(self) -> int:
        """Copies of the rows held at once while opening."""
        return 1

    @property
    def rows(self) -> torch.Tensor:
        """The dense rows, uint8 ``[num_rows, row_bytes]`` (read only by convention)."""
        return self._rows

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        torch.index_select(self._rows, 0, torch.from_numpy(ids), out=out)
        self._count(bytes_read=len(ids) * self.row_bytes)

    def stats(self) -> dict:
        return {**super().stats(), "huge_pages": self.huge_pages, "verified_on_load": self.verify_reads}

    def _release(self) -> None:
        self._rows = None  # type: ignore[assignment]
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the GC frees it later
                pass
