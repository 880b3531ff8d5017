"""Deduplicate a step's row ids before any cache or tier access.

A serving step needs ``tokens x layers x cols`` rows, and many repeat: the same n-gram
hashes to the same rows wherever it occurs, and short n-grams are common. ``dedup`` returns
the distinct ids (sorted, so tier reads walk the file forward) and the inverse that puts
them back in the step's order: ``ids == unique[inverse]``.

The native kernel (``_dedupkernel``, optional) does it in one call that keeps the GIL for a
step's ids; NumPy is the fallback (``ENGRAM_OFFLOAD_NO_NATIVE=1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._native import native_disabled

__all__ = ["Dedup", "dedup", "native_dedup"]


@dataclass(frozen=True)
class Dedup:
    """Distinct ids of a step and the inverse that puts them back in its order and shape."""

    unique: np.ndarray  # int64 [u], sorted
    inverse: np.ndarray  # int64 [n]: ids.reshape(-1) == unique[inverse]
    shape: tuple[int, ...]  # the ids' original shape

    @property
    def requested(self) -> int:
        return int(self.inverse.size)


def _as_ids(ids: Any) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return arr.astype(np.int64)
        raise TypeError(f"row ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def native_dedup():
    """The compiled dedup kernel, or None (not built, or switched off: ``_native.native_disabled``)."""
    if native_disabled():
        return None
    try:
        from . import _dedupkernel
    except ImportError:
        return None
    return _dedupkernel


def dedup(ids: Any) -> Dedup:
    """Row ids of any shape -> ``Dedup`` (sorted distinct ids plus inverse).

    The native kernel reads the ids in place (any strides) and never lets go of the GIL for a
    step's ids: NumPy's sort and ufuncs each do, and each let-go while the prefetch worker
    waits for the GIL costs a thread switch. Without it, ids and their positions are packed into one int64 each (id in the high bits) and
    sorted: a plain sort of distinct keys is about 7x cheaper than a stable argsort,
    and the inverse falls out of the low bits. Ids too large to pack (or negative) take
    an argsort instead.
    """
    arr = _as_ids(ids)
    n = arr.size
    if n == 0:
        return Dedup(np.empty(0, np.int64), np.empty(0, np.int64), arr.shape)
    kernel = native_dedup()
    if kernel is not None:
        unique, inverse = np.empty(n, np.int64), np.empty(n, np.int64)
        u = kernel.dedup(arr, unique, inverse)
        if u >= 0:
            return Dedup(unique[:u], inverse, arr.shape)
    flat = arr.reshape(-1)
    bits = max(1, (n - 1).bit_length())
    lo, hi = int(flat.min()), int(flat.max())
    if lo >= 0 and hi < (1 << (63 - bits)):
        key = flat << bits
        key |= np.arange(n, dtype=np.int64)
        key.sort()
        ordered = key >> bits
        order = key & ((1 << bits) - 1)
    else:
        order = np.argsort(flat)
        ordered = flat[order]
    starts = np.empty(n, dtype=bool)
    starts[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    inverse = np.empty(n, np.int64)
    if starts.all():  # no repeats
        inverse[order] = np.arange(n, dtype=np.int64)
        return Dedup(ordered, inverse, arr.shape)
    inverse[order] = np.cumsum(starts) - 1  # group of each sorted position
    return Dedup(ordered[starts], inverse, arr.shape)
