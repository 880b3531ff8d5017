"""Batched asynchronous positional reads through io_uring.

This wraps the optional C extension :mod:`engram_offload.tiers._uring`, which
issues many ``pread``-like requests into one destination buffer with up to
``queue_depth`` of them in flight, using one ``io_uring_enter`` system call
per batch of submissions and completions, with the GIL released for the whole
batch.

When the extension did not compile, the kernel lacks io_uring (or it is
disabled by ``kernel.io_uring_disabled`` or a seccomp filter), or
``ENGRAM_OFFLOAD_NO_NATIVE`` is set (:mod:`engram_offload._native`),
:func:`available` returns False and :func:`unavailable_reason` says why;
the direct tier then reads with its threads engine.

Read semantics (:meth:`UringReader.read`):

* every destination range is bounds-checked before any I/O is issued
  (``ValueError``; nothing is read);
* a short read is resubmitted for the remainder;
* a read that returns 0 bytes before its length is complete has hit end of
  file and raises ``OSError(errno.EIO, "... end of file")``: data is never
  silently replaced by zeros;
* errors follow :mod:`engram_offload.tiers.policy` (shared with the threads
  engine): transient ones are retried ``retries`` times, then raised as
  ``OSError(errno, message naming the file offset)``; others are raised at
  once.  ``EINVAL`` usually means an O_DIRECT alignment violation: file
  offset, length and destination address must all be multiples of the
  device's logical block size (512 or 4096 bytes);
* after a failure, the part of ``dest`` covered by the batch is unspecified
  (some reads completed, others did not), but no read is still in flight.

:meth:`UringReader.read_rows` reads rows of a paged table (format version 3) in one
call: each distinct page holding a requested row is read whole into one of the ring's
page slots (the same failure semantics), checked against the table's page checksum
when given one (read once more from the medium if it differs), and its rows are copied
out; no Python runs per page.
"""

from __future__ import annotations

import os
import threading
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, NamedTuple, Optional, Self, Union

import numpy as np

from .._native import NO_NATIVE_ENV, native_disabled
from .policy import DEFAULT_QUEUE_DEPTH, DEFAULT_RETRIES, TRANSIENT_ERRNOS

if TYPE_CHECKING:
    from ..table.format import TableLayout

__all__ = ["available", "unavailable_reason", "UringReader", "RowsRead", "DEFAULT_QUEUE_DEPTH"]

_lock = threading.Lock()
_probed = False
_module: Optional[ModuleType] = None
_reason: Optional[str] = None


def _probe() -> None:
    """Imports the extension and creates a test ring once; caches the result."""
    global _probed, _module, _reason
    with _lock:
        if _probed:
            return
        try:
            from engram_offload.tiers import _uring  # type: ignore[attr-defined]
        except ImportError as exc:
            _reason = f"native extension engram_offload.tiers._uring not built: {exc}"
        else:
            try:
                _uring.probe()
            except OSError as exc:
                _reason = f"io_uring_setup failed on this kernel: {exc}"
            else:
                _module = _uring
        _probed = True


def available() -> bool:
    """True when the extension imported and ``io_uring_setup`` works here.

    The probe runs once per process; the ``ENGRAM_OFFLOAD_NO_NATIVE``
    environment variable is checked on every call.
    """
    if native_disabled():
        return False
    _probe()
    return _module is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False, or None when it is True."""
    if native_disabled():
        return f"disabled by {NO_NATIVE_ENV}={os.environ.get(NO_NATIVE_ENV)}"
    _probe()
    return _reason


def _as_int64(name: str, a: Union[np.ndarray, int, list[int]], n: Optional[int] = None) -> np.ndarray:
    arr = np.ascontiguousarray(a, dtype=np.int64)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} items, expected {n}")
    return arr


class RowsRead(NamedTuple):
    """What one :meth:`UringReader.read_rows` call did."""

    reads: int  # page reads issued, re-reads included
    pages_checked: int  # distinct pages checked against their checksum
    page_rereads: int  # pages read once more after a mismatch
    bad_page: int  # a page that differed twice (its rows were not copied), or -1


class UringReader:
    """Issues batches of positional reads on one file descriptor.

    ``fd`` is borrowed, not owned: the caller keeps it open while the reader
    is used and closes it afterwards.  For O_DIRECT descriptors, file offsets,
    lengths and destination addresses must be aligned to the device's
    logical block size (allocate ``dest`` with a 4096-aligned base).

    One ring is shared by all threads: :meth:`read` holds a lock for the
    duration of the batch and releases the GIL while waiting on the device,
    so concurrent callers are serialised but safe.  Use a few readers (the
    direct tier keeps a small pool) for parallel batches.
    """

    def __init__(self, fd: int, queue_depth: int = DEFAULT_QUEUE_DEPTH, *, retries: int = DEFAULT_RETRIES,
                 setup_flags: int = -1) -> None:
        if not available():
            raise RuntimeError(f"io_uring reader unavailable: {unavailable_reason()}")
        assert _module is not None
        os.fstat(fd)  # raises OSError(EBADF) for a bad descriptor
        self._fd = int(fd)
        self._retries = int(retries)
        self._lock = threading.Lock()
        self._ring = _module.Ring(int(queue_depth), int(setup_flags), tuple(sorted(TRANSIENT_ERRNOS)))

    @property
    def fd(self) -> int:
        """The file descriptor read from."""
        return self._fd

    @property
    def queue_depth(self) -> int:
        """Maximum number of reads in flight (may be capped by the kernel)."""
        return int(self._ring.queue_depth)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return bool(self._ring.closed)

    @property
    def syscalls(self) -> int:
        """``io_uring_enter`` calls made so far (for tuning and tests)."""
        return int(self._ring.n_enter)

    @property
    def retried(self) -> int:
        """Reads reissued so far (after a short read or a transient error)."""
        return int(self._ring.n_retries)

    @property
    def fixed_pages(self) -> bool:
        """Whether :meth:`read_rows` reads into page slots registered with the ring
        (``READ_FIXED``: the kernel pins no page per read); False until its first call."""
        return bool(self._ring.fixed_pages)

    @property
    def fixed_file(self) -> bool:
        """Whether the file read last is registered with the ring (the kernel looks up no
        descriptor per read; registered again when the descriptor names another file)."""
        return bool(self._ring.fixed_file)

    @property
    def huge_pages(self) -> bool:
        """Whether :meth:`read_rows`'s page slots lie on memory advised for transparent huge
        pages (queue depths whose slots take 256 KiB or more, where the huge page could be
        registered); False until its first call."""
        return bool(self._ring.huge_pages)

    @property
    def broken(self) -> bool:
        """Whether the ring itself failed (``io_uring_enter``); only :meth:`close` is left."""
        return bool(self._ring.broken)

    def read(
        self,
        offsets: np.ndarray,
        lengths: Union[np.ndarray, int],
        dest: np.ndarray,
        dest_offsets: np.ndarray,
        *,
        wait_batch: int = -1,
    ) -> None:
        """Reads ``lengths[i]`` bytes at file offset ``offsets[i]`` into
        ``dest[dest_offsets[i]:dest_offsets[i] + lengths[i]]`` for every i.

        Args:
            offsets: int64 [n] file offsets.
            lengths: int64 [n] byte counts, or one int for all reads.
            dest: writable, C-contiguous buffer (any dtype; addressed in bytes).
            dest_offsets: int64 [n] byte offsets into ``dest``.
            wait_batch: completions to wait for per system call (-1: a
                quarter of the queue depth).

        Raises:
            ValueError: a destination range falls outside ``dest`` or an
                argument has the wrong shape; nothing was read.
            OSError: a read failed after retries or hit end of file; its
                errno is set and the message names the file offset.
        """
        offs = _as_int64("offsets", offsets)
        n = offs.shape[0]
        doffs = _as_int64("dest_offsets", dest_offsets, n)
        lens: Union[np.ndarray, int]
        if isinstance(lengths, (int, np.integer)):
            lens = int(lengths)
        else:
            lens = _as_int64("lengths", lengths, n)
        if isinstance(dest, np.ndarray) and not dest.flags.c_contiguous:
            raise ValueError("dest must be C-contiguous")
        with self._lock:
            if self._ring.closed:
                raise ValueError("read on a closed UringReader")
            self._ring.read(self._fd, offs, lens, dest, doffs, self._retries, wait_batch)

    def read_rows(
        self,
        ids: np.ndarray,
        out: np.ndarray,
        layout: "TableLayout",
        page_sums: Optional[np.ndarray],
        *,
        wait_batch: int = -1,
        damage: int = 0,
    ) -> "RowsRead":
        """Rows ``ids`` of a paged table into ``out``, whole pages read and checked natively.

        Args:
            ids: int64 [n] row ids, any order (sorted ones skip a sort).
            out: writable, C-contiguous uint8 [n, row_bytes] (or at least n * row_bytes bytes).
            layout: the table's layout (``data_offset``, ``page_bytes``, ``rows_per_page``,
                ``row_bytes``, ``num_rows``).
            page_sums: uint32 [num_pages] page checksums, or None to skip the check.
            wait_batch: completions to wait for per system call (-1: a quarter of the queue).
            damage: fault injection for tests: flip a byte of the first ``damage`` pages
                read, as a bad transfer would.

        Returns the counts and, when a page differed from its checksum twice, that page
        (``RowsRead.bad_page``; the rows of other pages may be in ``out`` already).

        Raises:
            IndexError: an id is out of range; ValueError: ``out`` is too small. Nothing
                was read.
            OSError: as :meth:`read`, the message naming the file offset.
        """
        ids = _as_int64("ids", ids)
        if isinstance(out, np.ndarray) and not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous")
        sums = None if page_sums is None else np.ascontiguousarray(page_sums, dtype=np.uint32)
        with self._lock:
            if self._ring.closed:
                raise ValueError("read_rows on a closed UringReader")
            got = self._ring.read_rows(
                self._fd, ids, out, layout.data_offset, layout.page_bytes, layout.rows_per_page,
                layout.row_bytes, layout.num_rows, sums, self._retries, wait_batch, damage,
            )
        return RowsRead(*got)

    def close(self) -> None:
        """Unmaps and closes the ring (not the file descriptor).  Idempotent."""
        with self._lock:
            self._ring.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"queue_depth={self.queue_depth}"
        return f"UringReader(fd={self._fd}, {state})"
