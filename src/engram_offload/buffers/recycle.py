"""Output arrays used again once nobody holds them.

A fetch worker decodes every step's rows into new arrays, megabytes a step at a GPU
server's batch (256 sequences of V4.1-Flash: 12,288 rows, 12 MiB of float32). The C
allocator gives blocks that large back to the kernel when they are freed (an ``munmap`` or
a trim of the worker's arena), so the next step's arrays come back as fresh pages: a page
fault per 4 KiB, or the zeroing of a 2 MiB huge page. That cost 40% of the fetch path's
CPU a row on the development machine. ``RecycledArrays`` keeps a few arrays and hands one
out again once the last view of its previous use is gone (watched through a weak reference
to the object it lent the memory through, which every array, view and tensor made from it
keeps alive), so a caller may hold rows as long as it likes: those are simply not reused.
"""

from __future__ import annotations

import math
import threading
import weakref
from functools import partial

import numpy as np

__all__ = ["RecycledArrays", "aligned_bytes", "ALIGNMENT"]

ALIGNMENT = 64  # bytes: a cache line, and what the decoder's streaming stores need


def aligned_bytes(nbytes: int, alignment: int = ALIGNMENT) -> np.ndarray:
    """An uninitialized uint8 array of ``nbytes`` whose data starts at a multiple of
    ``alignment`` (``np.empty`` gives 16 bytes: a large block's header precedes it)."""
    block = np.empty(nbytes + alignment - 1, np.uint8)
    start = -block.ctypes.data % alignment
    return block[start:start + nbytes]


class RecycledArrays:
    """``empty(shape, dtype)`` like ``np.empty``, from up to ``keep`` arrays of ``max_bytes``
    in all that it keeps; the one let go of last (still warm in the CPU's caches) is taken
    first. Arrays under ``min_bytes`` are plain ``np.empty`` ones: the allocator keeps blocks
    that small for the process (at 32 sequences a step, 0.8 MiB a layer, recycling measured
    no better); so are those that would take the kept bytes over ``max_bytes`` (a long
    prefill's rows, say), but these start at a multiple of ``ALIGNMENT`` bytes, as kept ones
    do. Thread-safe."""

    def __init__(self, keep: int = 16, min_bytes: int = 1 << 20, max_bytes: int = 256 << 20) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.keep = keep
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._bases: list[np.ndarray] = []  # uint8 [capacity] each, by slot
        self._given: list[weakref.ref[_Lent] | None] = []  # by slot: what it is lent as
        # slots nobody holds, the last let go of at the end: appended by the weak references'
        # callbacks (an append is atomic; they never take the lock, so a holder may let go anywhere)
        self._free: list[int] = []
        self.reused = 0  # arrays handed out again
        self.made = 0  # arrays allocated (kept or not)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """An uninitialized array ``shape`` of ``dtype``: a kept one nobody holds when one
        is large enough, else a new one (kept while fewer than ``keep`` are)."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(shape, dtype)
        with self._lock:
            slot = self._take_free(nbytes)
            if slot is not None:
                self.reused += 1
            else:
                self.made += 1
                base = aligned_bytes(max(nbytes, 1))
                slot = self._slot_for(base)
                if slot is None:  # no room to keep it: this one is the caller's alone
                    return base[:nbytes].view(dtype).reshape(shape)
            lent = _Lent(self._bases[slot], tuple(shape), dtype)
            self._given[slot] = weakref.ref(lent, partial(_let_go, self._free, slot))
            return np.asarray(lent)

    def _take_free(self, nbytes: int) -> int | None:
        """The slot let go of last whose array holds ``nbytes``, out of the free list."""
        free = self._free
        for k in range(len(free) - 1, -1, -1):
            if self._bases[free[k]].nbytes >= nbytes:
                return free.pop(k)
        return None

    @property
    def kept_bytes(self) -> int:
        """Bytes of the arrays kept (held or free)."""
        return sum(b.nbytes for b in self._bases)

    def _slot_for(self, base: np.ndarray) -> int | None:
        """A slot for a new array within ``keep`` and ``max_bytes``: a new one, else that of
        a free array too small (which ``base`` replaces), else None."""
        kept = self.kept_bytes
        if len(self._bases) < self.keep and kept + base.nbytes <= self.max_bytes:
            self._bases.append(base)
            self._given.append(None)
            return len(self._bases) - 1
        for k in range(len(self._free) - 1, -1, -1):  # each too small, or _take_free would have taken it
            slot = self._free[k]
            if kept - self._bases[slot].nbytes + base.nbytes <= self.max_bytes:
                del self._free[k]
                self._bases[slot] = base
                return slot
        return None


class _Lent:
    """A kept array's memory lent out as ``shape`` of ``dtype``: the array made from it, every
    NumPy view of that and every tensor made from either hold it (NumPy's ``base`` chain stops at
    an object that is not an array), so it dies only once all of them have."""

    __slots__ = ("__array_interface__", "_base", "__weakref__")

    def __init__(self, base: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._base = base
        self.__array_interface__ = {"data": (base.ctypes.data, False), "shape": shape,
                                    "typestr": dtype.str, "version": 3}


def _let_go(free: list[int], slot: int, _ref: object) -> None:
    """The weak reference's callback: ``slot``'s array is no longer held."""
    free.append(slot)
