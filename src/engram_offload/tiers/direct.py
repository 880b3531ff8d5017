"""``direct`` tier: O_DIRECT reads of only the sectors holding the requested rows.

Per request, rows are grouped by 4 KiB page and each touched page costs one read: the
smallest 512-byte-aligned span covering that page's requested rows (so rows sharing a
sector or a page cost one read, and a lone 264-byte row costs at most 1 KiB). Spans are
read into a page-aligned buffer, then rows are copied out.

Engines: ``uring`` (the native io_uring helper, ``engram_offload.tiers.uring``, many
reads in flight per system call) and ``threads`` (a pool of threads each issuing
``os.preadv``, GIL released); ``auto`` takes uring when it is available. Failed reads are
retried (EIO, EINTR, EAGAIN, short reads) and then raised as ``TierError``; bytes that
were not read are never returned.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from ..errors import TierError
from ..table.format import PAGE_BYTES, SECTOR_BYTES, TableHeader
from ..table.verify import BlockVerifier
from ._buffers import aligned_empty, gather_at
from .base import Tier

__all__ = ["DirectTier", "ENGINES", "ThreadEngine", "plan_spans"]

ENGINES = ("auto", "uring", "threads")
DEFAULT_QUEUE_DEPTH = 64
TRANSIENT = {errno.EIO, errno.EINTR, errno.EAGAIN, errno.EBUSY}

Pread = Callable[[int, list, int], int]  # os.preadv's signature


def plan_spans(offsets: np.ndarray, row_bytes: int, page_bytes: int, data_offset: int):
    """Group rows by page into sector-aligned read spans.

    ``offsets``: file offsets of the rows (int64 ``[n]``). Returns (span starts ``[m]``,
    span lengths ``[m]``, destination offsets ``[m]`` (4 KiB aligned), buffer bytes, and
    each row's byte position in the buffer ``[n]``).
    """
    pages = (offsets - data_offset) // page_bytes
    starts = offsets & ~np.int64(SECTOR_BYTES - 1)
    ends = (offsets + (row_bytes + SECTOR_BYTES - 1)) & ~np.int64(SECTOR_BYTES - 1)
    order = np.argsort(pages, kind="stable")
    sorted_pages = pages[order]
    new = np.empty(len(order), bool)
    new[0] = True
    np.not_equal(sorted_pages[1:], sorted_pages[:-1], out=new[1:])
    first = np.flatnonzero(new)
    span_start = np.minimum.reduceat(starts[order], first)
    span_len = np.maximum.reduceat(ends[order], first) - span_start
    slots = (span_len + (PAGE_BYTES - 1)) & ~np.int64(PAGE_BYTES - 1)
    dest = np.zeros(len(first), np.int64)
    np.cumsum(slots[:-1], out=dest[1:])
    span_of = np.empty(len(order), np.int64)
    span_of[order] = np.cumsum(new) - 1
    position = dest[span_of] + (offsets - span_start[span_of])
    return span_start, span_len, dest, int(dest[-1] + slots[-1]), position


class ThreadEngine:
    """Reads spans with ``pread`` on a pool of threads, retrying transient failures."""

    name = "threads"

    def __init__(self, tier: "DirectTier", threads: int, pread: Pread, retries: int) -> None:
        self.tier, self.threads, self.pread, self.retries = tier, threads, pread, retries
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="engram-direct")

    def read(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dest_offsets: np.ndarray) -> None:
        n = len(offsets)
        parts = min(self.threads, n)
        bounds = np.linspace(0, n, parts + 1).astype(np.int64).tolist()
        jobs = [
            (offsets[a:b].tolist(), lengths[a:b].tolist(), dest_offsets[a:b].tolist())
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        view = memoryview(dest)
        if parts == 1:
            self._run(*jobs[0], view)
            return
        futures = [self._pool.submit(self._run, *job, view) for job in jobs]
        error = None
        for fut in futures:  # wait for every job: none may still write into dest afterwards
            try:
                fut.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        if error is not None:
            raise error

    def _run(self, offsets: list[int], lengths: list[int], dests: list[int], view: memoryview) -> None:
        fd, pread = self.tier._fd, self.pread
        for off, length, d in zip(offsets, lengths, dests):
            try:
                if pread(fd, [view[d: d + length]], off) == length:
                    continue
            except OSError:
                pass
            self._read_carefully(off, length, view[d: d + length])

    def _read_carefully(self, off: int, length: int, view: memoryview) -> None:
        """One span after a failed first attempt: short reads resume, transient errors retry,
        then TierError (``1 + retries`` attempts in all)."""
        done, failures, last = 0, 1, "short read"
        self.tier._count(retries=1)
        while done < length:
            try:
                got = self.pread(self.tier._fd, [view[done:]], off + done)
            except OSError as exc:
                if exc.errno not in TRANSIENT:
                    raise self.tier._error(off, length, exc) from exc
                got, last = -1, f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}"
            advanced = 0
            if got > 0:  # resume a short read at the last whole sector
                advanced = got - (got % SECTOR_BYTES if done + got < length else 0)
                done += advanced
            if done < length:
                self.tier._count(retries=1)
                if advanced:
                    continue  # progress: not a failure
                if got == 0:
                    last = "end of file (truncated?)"
                failures += 1
                if failures > self.retries:
                    raise TierError(
                        f"{self.tier.header.path}: reading {length} bytes at offset {off:,} failed "
                        f"after {self.retries} retries ({last})"
                    )

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class UringEngine:
    """Reads spans through the native io_uring helper; one ring per calling thread."""

    name = "uring"

    def __init__(self, tier: "DirectTier", queue_depth: int, retries: int) -> None:
        from . import uring

        self._uring, self.tier, self.queue_depth, self.retries = uring, tier, queue_depth, retries
        self._local = threading.local()
        self._readers: list = []
        self._lock = threading.Lock()

    def read(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dest_offsets: np.ndarray) -> None:
        reader = getattr(self._local, "reader", None)
        if reader is None:
            reader = self._uring.UringReader(self.tier._fd, self.queue_depth, retries=self.retries)
            self._local.reader = reader
            with self._lock:
                self._readers.append(reader)
        try:
            reader.read(offsets, lengths, dest, dest_offsets)
        except OSError as exc:
            raise self.tier._error(int(offsets[0]), int(lengths[0]), exc, batch=len(offsets)) from exc

    def close(self) -> None:
        with self._lock:
            for reader in self._readers:
                reader.close()
            self._readers.clear()


class DirectTier(Tier):
    """Rows read with O_DIRECT from the table file, bypassing the page cache.

    Options: ``engine`` (``auto`` | ``uring`` | ``threads``), ``queue_depth`` (reads in
    flight: io_uring queue depth, or thread count for ``threads``), ``retries`` (per read),
    ``verify_reads`` (check each block's checksum the first time a read touches it),
    ``pread`` (the ``os.preadv``-like function of the threads engine; a fault-injection hook).
    """

    name = "direct"

    def __init__(
        self,
        header: TableHeader,
        *,
        engine: str = "auto",
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        retries: int = 3,
        verify_reads: bool = False,
        pread: Pread | None = None,
    ) -> None:
        super().__init__(header)
        if engine not in ENGINES:
            raise ValueError(f"unknown direct engine {engine!r}; choose one of: {', '.join(ENGINES)}")
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.queue_depth = queue_depth
        if engine == "auto":
            engine = "uring" if pread is None and _uring_available() else "threads"
        if engine == "uring" and not _uring_available():
            from . import uring

            raise ValueError(f"engine 'uring' is not available here: {uring.unavailable_reason()}; use engine='threads'")
        try:
            self._fd = os.open(header.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise self._no_direct_io() from exc
            raise
        if engine == "uring":
            self._engine: ThreadEngine | UringEngine = UringEngine(self, queue_depth, retries)
        else:
            self._engine = ThreadEngine(self, queue_depth, pread or os.preadv, retries)
        self.engine = engine
        self._local = threading.local()
        self._verifier = BlockVerifier(header, self._read_block) if verify_reads else None
        self._block_buf: np.ndarray | None = None
        try:  # some file systems accept O_DIRECT at open and refuse it at read
            probe = aligned_empty(PAGE_BYTES)
            self._engine.read(np.array([header.layout.data_offset], np.int64),
                              np.array([PAGE_BYTES], np.int64), probe, np.zeros(1, np.int64))
        except TierError as exc:
            self.close()
            if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.EINVAL:
                raise self._no_direct_io() from exc
            raise

    def _no_direct_io(self) -> TierError:
        return TierError(
            f"{self.header.path}: the file system refuses O_DIRECT (EINVAL; tmpfs does, for "
            "one): put the table on a file system with direct I/O (ext4, xfs) or use the "
            "mmap or memory tier"
        )

    def _error(self, off: int, length: int, exc: OSError, batch: int = 1) -> TierError:
        where = f"reading {length} bytes at offset {off:,}" + (f" (batch of {batch} reads)" if batch > 1 else "")
        return TierError(f"{self.header.path}: {where} failed: {exc}")

    def _buffer(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = aligned_empty(max(nbytes, 2 * (buf.nbytes if buf is not None else 0), 1 << 20))
            self._local.buf = buf
        return buf

    def _read_block(self, block: int) -> memoryview:
        start, end = self.layout.block_range(block)
        if self._block_buf is None:
            self._block_buf = aligned_empty(self.layout.block_size)
        self._engine.read(np.array([start], np.int64), np.array([end - start], np.int64),
                          self._block_buf, np.zeros(1, np.int64))
        self._count(reads=1, bytes_read=end - start)
        return memoryview(self._block_buf)[: end - start]

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        layout = self.layout
        offsets = layout.row_offsets(ids)
        if self._verifier is not None:
            self._verifier.ensure(offsets)
        starts, lengths, dests, total, positions = plan_spans(
            offsets, layout.row_bytes, layout.page_bytes, layout.data_offset
        )
        buf = self._buffer(total)
        self._engine.read(starts, lengths, buf, dests)
        gather_at(torch.from_numpy(buf[:total]), positions, out)
        self._count(reads=len(starts), bytes_read=int(lengths.sum()))

    def stats(self) -> dict:
        verified = self._verifier.blocks_verified if self._verifier else 0
        return {**super().stats(), "engine": self.engine, "queue_depth": self.queue_depth,
                "blocks_verified": verified}

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()
        os.close(self._fd)


def _uring_available() -> bool:
    try:
        from . import uring
    except ImportError:
        return False
    return uring.available()
