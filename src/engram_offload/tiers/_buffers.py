"""Page-aligned host buffers (for O_DIRECT) and byte-offset row gathers out of them."""

from __future__ import annotations

import mmap
import threading

import numpy as np
import torch

from ..buffers.rowcopy import move_rows

__all__ = ["ThreadBuffers", "aligned_empty", "gather_at", "madvise_quietly", "private_mapping"]

ALIGN = mmap.PAGESIZE


def private_mapping(nbytes: int) -> mmap.mmap:
    """``nbytes`` (rounded up to whole pages) of ordinary process memory: a private anonymous
    mapping. ``mmap.mmap(-1, n)`` alone maps MAP_SHARED, which is shmem: no transparent huge
    pages where ``shmem_enabled`` is ``never`` (the usual default), and a costlier fault per page."""
    return mmap.mmap(-1, max(ALIGN, -(-nbytes // ALIGN) * ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised, page-aligned ``np.uint8 [nbytes]`` (a private mapping; freed with it)."""
    return np.frombuffer(private_mapping(nbytes), np.uint8, count=nbytes)


class ThreadBuffers:
    """One page-aligned scratch buffer per calling thread, grown (doubling) as needed."""

    def __init__(self, min_bytes: int = 1 << 20) -> None:
        self.min_bytes = min_bytes
        self._local = threading.local()

    def get(self, nbytes: int) -> np.ndarray:
        """This thread's buffer, at least ``nbytes`` long (its contents are undefined)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = aligned_empty(max(nbytes, 2 * (buf.nbytes if buf is not None else 0), self.min_bytes))
            self._local.buf = buf
        return buf


def madvise_quietly(mm: mmap.mmap, advice_name: str) -> bool:
    """``mm.madvise(mmap.<advice_name>)`` where the OS has it; False when refused."""
    advice = getattr(mmap, advice_name, None)
    if advice is None:
        return False
    try:
        mm.madvise(advice)
    except OSError:
        return False
    return True


def gather_at(src: torch.Tensor, byte_offsets: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """Copy the ``row_bytes``-long byte runs of ``src`` (uint8 ``[N]``) starting at
    ``byte_offsets`` (int64 ``[n]``) into ``out`` (uint8 ``[n, row_bytes]``)."""
    move_rows(src, byte_offsets, out, None, src_byte_offsets=True)
    return out
