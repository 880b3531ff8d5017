"""The shared tier's scrubber: every page of a loaded segment checked again, in the background.

A page of a sealed segment can change without moving its file's times (through a writable
mapping made before the seal, which only the operator's uid or root can make, or a bit the
hardware flips); the checks of an attach and of each read meet it only by chance. So one of the
processes attached to a segment checks every page again against the table's page checksums, a
chunk at a time, paced so that a pass takes ``scrub_seconds`` (600 by default), never faster than
``MAX_SCRUB_BYTES_PER_S`` nor busier than ``SCRUB_CPU_SHARE`` of a core. The first chunk waits
one chunk's time (the loader, or the attach, has just checked).

One scrubber a segment: each attached process's scrubber asks for an OFD write lock
(``F_OFD_SETLK``) on the segment's lock file, without waiting; the holder scrubs, the others ask
again every ``SCRUB_POLL_SECONDS``, so one takes over when the scrubbing process exits (the kernel
drops its lock; a forked child closes the lock file it inherited). OFD locks and the ``flock`` of
the loader's election do not interact.

A page that differs: the scrubber marks the segment damaged (``segments.mark_damaged``: the state,
the page and its pid in the head) and removes its name under the election, so the next open loads
a fresh copy; every attached process's next read sees the state and raises ``TierError`` naming
the segment and the page: the changed row is never served. A segment no longer at its name
(replaced, removed) is not scrubbed further.

Found within: one pass (data bytes / rate) after the change, plus one chunk, plus one poll when
the scrubbing process exited meanwhile.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING

import numpy as np

from ..table.verify import bad_pages
from .segments import LOCK_SUFFIX, election, mark_damaged

if TYPE_CHECKING:
    from .shared import SharedTier

__all__ = ["Scrubber", "SCRUB_SECONDS", "MAX_SCRUB_BYTES_PER_S", "SCRUB_CPU_SHARE", "SCRUB_POLL_SECONDS"]

SCRUB_SECONDS = 570.0  # a pass over every page takes this long (the rates below allowing): with a poll, < 10 min
MAX_SCRUB_BYTES_PER_S = 1 << 30  # the fastest a pass goes, whatever the segment's size
SCRUB_CPU_SHARE = 0.25  # of one core, at most, whatever the machine's speed
SCRUB_POLL_SECONDS = 10.0  # how often a process that does not scrub asks to
SCRUB_CHUNK_BYTES = 4 << 20  # pages checked at a time
_OFD_LOCK = struct.Struct("hhqqi4x")  # struct flock: type, whence, start, length (0: all), pid (0)


_RUNNING: weakref.WeakSet[Scrubber] = weakref.WeakSet()


def _forked() -> None:
    """In a forked child: close the inherited lock files (the child runs no scrubber; holding the
    open file would keep the lock after the parent's scrubber ends)."""
    for scrubber in list(_RUNNING):
        lock, scrubber._lock = scrubber._lock, -1
        if lock >= 0:
            os.close(lock)


os.register_at_fork(after_in_child=_forked)


def _take(fd: int) -> bool:
    """Whether this open file now holds the OFD write lock on ``fd``'s file (never waits)."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _OFD_LOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


class Scrubber:
    """The background check of ``tier``'s segment (a daemon thread, started at once): ``elected``
    is set while this process scrubs, ``found`` once a page was found changed (here or by another
    process's scrubber), ``problem`` says what; ``passes`` counts whole passes."""

    def __init__(self, tier: SharedTier, seconds: float) -> None:
        self.tier = tier
        layout = tier.layout
        self.rate = min(max(1, layout.num_rows * layout.row_bytes) / seconds, MAX_SCRUB_BYTES_PER_S)  # bytes/s
        self.poll = min(SCRUB_POLL_SECONDS, seconds)
        self.elected, self.found = threading.Event(), threading.Event()
        self.problem: str | None = None
        self.passes = self.pages_checked = 0
        self.cpu_seconds = 0.0
        self._passed = threading.Condition()
        self._stop = threading.Event()
        lock = tier._folder.open(tier._name + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT)  # the election's file
        assert lock is not None  # O_CREAT
        self._lock = lock
        _RUNNING.add(self)
        self._thread = threading.Thread(target=self._run, name="engram-shm-scrub", daemon=True)
        self._thread.start()

    def wait_passes(self, count: int, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until ``count`` passes are done; whether they are."""
        with self._passed:
            return self._passed.wait_for(lambda: self.passes >= count, timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def stats(self) -> dict:
        return {"scrub_bytes_per_s": self.rate, "scrub_elected": self.elected.is_set(), "scrub_passes": self.passes,
                "scrub_pages_checked": self.pages_checked, "scrub_cpu_seconds": self.cpu_seconds,
                "scrub_problem": self.problem}

    def _run(self) -> None:
        tier = self.tier
        try:
            try:
                while not _take(self._lock):
                    if self._stop.wait(self.poll) or self._gone():
                        return
                self.elected.set()
                self._scrub()
            finally:
                self.elected.clear()
                _RUNNING.discard(self)
                lock, self._lock = self._lock, -1
                os.close(lock)  # drops the lock: another process's scrubber takes over
        except Exception as exc:  # noqa: BLE001 - a scrubber that fails stops; the reads' own checks remain
            warnings.warn(f"the background check of the shared segment {tier.segment} stopped: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=1)

    def _gone(self) -> bool:
        """Whether the segment is no longer to be scrubbed: marked damaged (``found`` set then),
        or no longer at its name."""
        tier = self.tier
        if tier._marked():
            self.problem = str(tier._damaged())
            self.found.set()
            return True
        return not tier._folder.holds(tier._name, tier._fd)

    def _scrub(self) -> None:
        tier = self.tier
        n, page_bytes = tier.layout.num_pages, tier.layout.page_bytes
        step = max(1, SCRUB_CHUNK_BYTES // page_bytes)
        first, next_at = 0, time.monotonic() + min(step, n) * page_bytes / self.rate
        while n and not self._stop.wait(max(0.0, next_at - time.monotonic())):
            if self._gone():
                return
            pages = np.arange(first, min(first + step, n), dtype=np.int64)
            cpu = time.thread_time()
            buf = tier._staging.get(len(pages) * page_bytes)
            if not tier._rebuild_pages(tier._fd, tier._address, pages, buf):
                return  # cut short: every read refuses it (its size)
            bad = bad_pages(tier.header, pages, buf[: len(pages) * page_bytes])
            cpu = time.thread_time() - cpu
            self.cpu_seconds += cpu
            if bad.size:
                self._mark(int(pages[bad[0]]))
                return
            self.pages_checked += len(pages)
            first = int(pages[-1]) + 1
            if first == n:
                first = 0
                with self._passed:
                    self.passes += 1
                    self._passed.notify_all()
            next_at = max(next_at + len(pages) * page_bytes / self.rate,
                          time.monotonic() + cpu * (1 / SCRUB_CPU_SHARE - 1))

    def _mark(self, page: int) -> None:
        """Mark the segment damaged at ``page`` and take its name away, so the next open loads afresh."""
        tier = self.tier
        mark_damaged(tier._fd, page)
        with election(tier._folder, tier._name, tier._lock_timeout):
            if tier._folder.holds(tier._name, tier._fd):
                tier._folder.unlink(tier._name)
        self.problem = str(tier._damaged())
        self.found.set()
