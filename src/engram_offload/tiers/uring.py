"""Batched asynchronous positional reads through io_uring.

This wraps the optional C extension :mod:`engram_offload.tiers._uring`, which
issues many ``pread``-like requests into one destination buffer with up to
``queue_depth`` of them in flight, using one ``io_uring_enter`` system call
per batch of submissions and completions, with the GIL released for the whole
batch.

When the extension did not compile, the kernel lacks io_uring (or it is
disabled by ``kernel.io_uring_disabled`` or a seccomp filter), or the
environment sets ``ENGRAM_OFFLOAD_NO_NATIVE=1``, :func:`available` returns
False and :func:`unavailable_reason` says why; callers then fall back to
``os.preadv``/``os.pread`` loops.

Read semantics (:meth:`UringReader.read`):

* every destination range is bounds-checked before any I/O is issued
  (``ValueError``; nothing is read);
* a short read is resubmitted for the remainder;
* a read that returns 0 bytes before its length is complete has hit end of
  file and raises ``OSError(errno.EIO, "... end of file")``: data is never
  silently replaced by zeros;
* transient errors (``EIO``, ``EAGAIN``, ...) are retried ``retries`` times,
  then raised as ``OSError(errno, message naming the file offset)``;
  deterministic ones (``EBADF``, ``EINVAL``, ``EFAULT``, ...) are raised at
  once.  ``EINVAL`` usually means an O_DIRECT alignment violation: file
  offset, length and destination address must all be multiples of the
  device's logical block size (512 or 4096 bytes);
* after a failure, the part of ``dest`` covered by the batch is unspecified
  (some reads completed, others did not), but no read is still in flight.
"""

from __future__ import annotations

import errno
import os
import threading
from types import ModuleType, TracebackType
from typing import Optional, Self, Union

import numpy as np

__all__ = [
    "available",
    "unavailable_reason",
    "UringReader",
    "PreadReader",
    "open_reader",
    "DEFAULT_QUEUE_DEPTH",
]

DEFAULT_QUEUE_DEPTH = 128
"""Reads kept in flight by default; enough to saturate an NVMe namespace."""

_ENV_DISABLE = "ENGRAM_OFFLOAD_NO_NATIVE"

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


def _disabled_by_env() -> bool:
    return os.environ.get(_ENV_DISABLE, "") not in ("", "0")


def available() -> bool:
    """True when the extension imported and ``io_uring_setup`` works here.

    The probe runs once per process; the ``ENGRAM_OFFLOAD_NO_NATIVE``
    environment variable is checked on every call.
    """
    if _disabled_by_env():
        return False
    _probe()
    return _module is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False, or None when it is True."""
    if _disabled_by_env():
        return f"disabled by {_ENV_DISABLE}={os.environ.get(_ENV_DISABLE)}"
    _probe()
    return _reason


def _as_int64(name: str, a: Union[np.ndarray, int, list[int]], n: Optional[int] = None) -> np.ndarray:
    arr = np.ascontiguousarray(a, dtype=np.int64)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} items, expected {n}")
    return arr


class _ClosingReader:
    """``with reader:`` closes the reader when the block ends."""

    def close(self) -> None:  # pragma: no cover - every reader defines it
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.close()


class UringReader(_ClosingReader):
    """Issues batches of positional reads on one file descriptor.

    ``fd`` is borrowed, not owned: the caller keeps it open while the reader
    is used and closes it afterwards.  For O_DIRECT descriptors, file offsets,
    lengths and destination addresses must be aligned to the device's
    logical block size (allocate ``dest`` with a 4096-aligned base).

    One ring is shared by all threads: :meth:`read` holds a lock for the
    duration of the batch and releases the GIL while waiting on the device,
    so concurrent callers are serialised but safe.  Give each thread its own
    reader for parallel batches.
    """

    def __init__(self, fd: int, queue_depth: int = DEFAULT_QUEUE_DEPTH, *, retries: int = 3,
                 setup_flags: int = -1) -> None:
        if not available():
            raise RuntimeError(f"io_uring reader unavailable: {unavailable_reason()}")
        assert _module is not None
        os.fstat(fd)  # raises OSError(EBADF) for a bad descriptor
        self._fd = int(fd)
        self._retries = int(retries)
        self._lock = threading.Lock()
        self._ring = _module.Ring(int(queue_depth), int(setup_flags))

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

    def close(self) -> None:
        """Unmaps and closes the ring (not the file descriptor).  Idempotent."""
        with self._lock:
            self._ring.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"queue_depth={self.queue_depth}"
        return f"UringReader(fd={self._fd}, {state})"


class PreadReader(_ClosingReader):
    """Pure-Python stand-in for :class:`UringReader` (same interface and
    failure semantics), used when the native helper is unavailable.

    Reads one request at a time with ``os.preadv`` straight into ``dest``, so
    it has no queue depth: expect a few microseconds of Python overhead per
    read on top of the device latency.  Thread-safe (no shared state besides
    the borrowed descriptor).
    """

    def __init__(self, fd: int, queue_depth: int = DEFAULT_QUEUE_DEPTH, *, retries: int = 3) -> None:
        os.fstat(fd)  # raises OSError(EBADF) for a bad descriptor
        self._fd = int(fd)
        self._retries = int(retries)
        self._closed = False

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def queue_depth(self) -> int:
        return 1

    @property
    def closed(self) -> bool:
        return self._closed

    def read(
        self,
        offsets: np.ndarray,
        lengths: Union[np.ndarray, int],
        dest: np.ndarray,
        dest_offsets: np.ndarray,
        *,
        wait_batch: int = -1,
    ) -> None:
        """Same contract as :meth:`UringReader.read`."""
        if self._closed:
            raise ValueError("read on a closed PreadReader")
        offs = _as_int64("offsets", offsets)
        n = offs.shape[0]
        doffs = _as_int64("dest_offsets", dest_offsets, n)
        lens = _as_int64("lengths", np.full(n, lengths) if np.ndim(lengths) == 0 else lengths, n)
        view = memoryview(dest).cast("B")  # raises for non-contiguous buffers
        if view.readonly:
            raise TypeError("dest must be writable")
        size = view.nbytes
        bad = (lens < 0) | (offs < 0) | (doffs < 0) | (doffs > size) | (lens > size - doffs)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"read {i} out of range: file offset {offs[i]}, length {lens[i]}, "
                f"dest offset {doffs[i]}, dest size {size}"
            )
        for off, length, doff in zip(offs.tolist(), lens.tolist(), doffs.tolist()):
            done = 0
            tries = 0
            while done < length:
                try:
                    got = os.preadv(self._fd, [view[doff + done : doff + length]], off + done)
                except OSError as exc:
                    if exc.errno in _PERMANENT_ERRNOS or tries >= self._retries:
                        raise OSError(
                            exc.errno,
                            f"read of {length} bytes at file offset {off} failed after "
                            f"{done} bytes: {exc.strerror}",
                        ) from None
                    tries += 1
                    continue
                if got == 0:
                    raise OSError(
                        errno.EIO,
                        f"read of {length} bytes at file offset {off} failed after "
                        f"{done} bytes: end of file",
                    )
                done += got

    def close(self) -> None:
        self._closed = True


_PERMANENT_ERRNOS = frozenset(
    {errno.EBADF, errno.EINVAL, errno.EFAULT, errno.ENOSYS, errno.EOPNOTSUPP, errno.EISDIR,
     errno.ENXIO, errno.ESPIPE, errno.EOVERFLOW, errno.EPERM, errno.EACCES, errno.ENODEV}
)


def open_reader(fd: int, queue_depth: int = DEFAULT_QUEUE_DEPTH) -> Union[UringReader, PreadReader]:
    """A :class:`UringReader` when :func:`available`, else a :class:`PreadReader`."""
    if available():
        return UringReader(fd, queue_depth)
    return PreadReader(fd, queue_depth)
