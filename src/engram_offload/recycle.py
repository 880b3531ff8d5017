"""Output arrays used again once nobody holds them.

A fetch worker decodes every step's rows into new arrays, megabytes a step at a GPU
server's batch (256 sequences of V4.1-Flash: 12,288 rows, 12 MiB of float32). The C
allocator gives blocks that large back to the kernel when they are freed (an ``munmap`` or
a trim of the worker's arena), so the next step's arrays come back as fresh pages: a page
fault per 4 KiB, or the zeroing of a 2 MiB huge page. That cost 40% of the fetch path's
CPU a row on the development machine. ``RecycledArrays`` keeps a few arrays and hands one
out again once the last view of its previous use is gone (watched through a weak reference
to the array it gave out, which ``torch.from_numpy`` and every NumPy view keep alive), so a
caller may hold rows as long as it likes: those are simply not reused.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np

__all__ = ["RecycledArrays"]


class RecycledArrays:
    """``empty(shape, dtype)`` like ``np.empty``, from up to ``keep`` arrays it keeps. Thread-safe."""

    def __init__(self, keep: int = 16) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.keep = keep
        self._lock = threading.Lock()
        self._bases: list[np.ndarray] = []  # uint8 [capacity] each
        self._given: list[weakref.ref[np.ndarray] | None] = []  # the array handed out from each
        self.reused = 0  # arrays handed out again
        self.made = 0  # arrays allocated (kept or not)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """An uninitialized array ``shape`` of ``dtype``: a kept one nobody holds when one
        is large enough, else a new one (kept while fewer than ``keep`` are)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            pick = self._free_slot(nbytes)
            if pick is None:
                self.made += 1
                base = np.empty(max(nbytes, 1), np.uint8)
                if len(self._bases) >= self.keep:
                    return base[:nbytes].view(dtype).reshape(shape)
                self._bases.append(base)
                self._given.append(None)
                pick = len(self._bases) - 1
            else:
                self.reused += 1
            out = self._bases[pick][:nbytes].view(dtype).reshape(shape)
            self._given[pick] = weakref.ref(out)
            return out

    def _free_slot(self, nbytes: int) -> int | None:
        """The smallest kept array of at least ``nbytes`` that nobody holds; else, if one
        nobody holds is too small, that one's slot is dropped so a larger one takes it."""
        best = small = None
        for i, (base, given) in enumerate(zip(self._bases, self._given)):
            if given is not None and given() is not None:
                continue  # still held
            if base.nbytes >= nbytes:
                if best is None or base.nbytes < self._bases[best].nbytes:
                    best = i
            else:
                small = i
        if best is None and small is not None:
            del self._bases[small], self._given[small]
        return best

    def clear(self) -> None:
        """Forget every kept array (those still held live on with their holders)."""
        with self._lock:
            self._bases.clear()
            self._given.clear()
