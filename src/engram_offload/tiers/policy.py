"""How the direct tier's engines read: queue depth, retries, which failures are retried.

One policy for both engines (the ``os.preadv`` threads and the native io_uring reader,
which is handed ``TRANSIENT_ERRNOS`` when its ring is made):

* a short read resumes where it stopped (progress is not a failure);
* a read returning 0 bytes before its length is complete hit end of file: the file is
  shorter than the table says (truncated?), raised at once as ``EIO``;
* an error in ``TRANSIENT_ERRNOS`` is retried up to ``retries`` times; any other error
  (EBADF, EINVAL from an O_DIRECT misalignment, EFAULT, ...) is raised at once.

Engines raise ``OSError`` whose message is ``failure_message(...)``; the tier turns it
into a ``TierError`` naming the file.
"""

from __future__ import annotations

import errno

__all__ = ["DEFAULT_QUEUE_DEPTH", "DEFAULT_RETRIES", "TRANSIENT_ERRNOS", "failure_message", "is_transient"]

DEFAULT_QUEUE_DEPTH = 128
"""Reads kept in flight per ring (or threads of the threads engine): fio's reference depth for random
4 KiB reads, which a single caller needs to keep an NVMe namespace busy across its batches."""

DEFAULT_RETRIES = 3
"""Extra attempts of a read failing with a transient error."""

TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EINTR, errno.EAGAIN, errno.EBUSY, errno.ECANCELED})


def is_transient(err: int | None) -> bool:
    """Whether a read failing with ``err`` may succeed when tried again."""
    return err in TRANSIENT_ERRNOS


def failure_message(length: int, offset: int, done: int, retries: int, what: str) -> str:
    """The text of a failed read (the native reader formats the same sentence)."""
    return (f"read of {length} bytes at file offset {offset} failed after {done} bytes "
            f"and {retries} retries: {what}")
