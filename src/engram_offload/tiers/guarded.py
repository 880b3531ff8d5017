"""Copies out of a mapped file that end in an error, never a signal, when the file shrinks.

Touching a mapped page past the end of a truncated file raises SIGBUS. ``guarded_copy`` copies
byte ranges of a mapping with the native helper (``tiers/_safecopy.c``), which catches that
SIGBUS, even mid-copy, and reports it; without the helper it reads the same ranges with
``pread`` from the file (a short read reports the same). Used by every tier that reads out
of a file mapping (``mmap``, ``shared``).
"""

from __future__ import annotations

import os

import numpy as np

from .._native import native_disabled

__all__ = ["guarded_copy", "guarded_copy_available"]

try:
    from . import _safecopy  # type: ignore[attr-defined]
except ImportError:  # not built: copies go through pread
    _safecopy = None


def guarded_copy_available() -> bool:
    """Whether copies out of a mapping are SIGBUS-guarded natively (else ``pread`` is used)."""
    return _safecopy is not None and not native_disabled()


def guarded_copy(address: int, length: int, fd: int, offsets: np.ndarray, lengths: np.ndarray,
                 dest: np.ndarray, dests: np.ndarray) -> bool:
    """Copy the byte ranges ``offsets``/``lengths`` (int64 ``[n]``) of a file mapped from its
    start at ``address`` (``length`` bytes mapped; ``fd`` the file, for the ``pread`` path) into
    ``dest`` (a writable buffer) at byte offsets ``dests`` (int64 ``[n]``). Returns False when
    the file ended before a range did (it shrank under the mapping), True when all was copied."""
    if guarded_copy_available():
        return not _safecopy.copy_spans(address, length, offsets, lengths, dest, dests)
    view = memoryview(dest).cast("B")  # type: ignore[arg-type]  # NumPy's stubs lack __buffer__
    for off, n, d in zip(offsets.tolist(), lengths.tolist(), dests.tolist()):
        if os.preadv(fd, [view[d: d + n]], off) != n:
            return False
    return True
