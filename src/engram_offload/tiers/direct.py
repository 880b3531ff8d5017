"""``direct`` tier: O_DIRECT reads of the pages (or sectors) holding the requested rows.

Per request, rows are grouped by 4 KiB page and each touched page costs one read. A table
with page checksums (format version 2) is read in whole pages, and every page is checked
against its checksum before a row of it is returned (``tiers.pagecheck``: a bad page is
read once more, then ``ChecksumError``), whichever engine read it. A version-1 table has
nothing to check a page against: each read is the smallest 512-byte-aligned span covering
that page's requested rows (a lone 264-byte row costs at most 1 KiB). Pages or spans are
read into a page-aligned buffer, then rows are copied out. With the ``uring`` engine, a
version-2 table's rows are read in one native call per request
(``UringReader.read_rows``: pages read, checked, re-read once, rows copied out, the GIL
released throughout); ``ENGRAM_OFFLOAD_NO_NATIVE`` or ``native_rows=False`` keeps the
Python steps above.

Pipelining: one native call keeps its ring full until its last reads, then drains it; a
caller that reads one batch at a time leaves the drive idle while the tail drains and
while it does its own work between calls. A native read of more than ``2 x pipeline_rows``
rows in ascending order (a store's distinct ids) is cut into chunks of about
``pipeline_rows`` (at page boundaries) read on two lanes,
the caller's thread and a helper, each on a ring of half the queue depth (so as many reads
are in flight as before): while one lane checks and copies out a chunk's pages, the other
lane's reads are in flight. Both lanes end before the call returns, and a failure is
raised as the one call raised it (the failing chunk first in the batch's order wins).
It is off by default (``pipeline_rows=0``; ``PIPELINE_ROWS`` is the chunk size to try): on
the two-core machine it was measured on (``benchmarks/bench_tier.py --one-caller``, loaded by
other work), it read 0.95-1.04x the one-call read's rows/s at 1.13-1.17x its CPU a read.

Engines: ``uring`` (the native io_uring helper, ``engram_offload.tiers.uring``, many
reads in flight per system call, a small pool of rings shared by all caller threads) and
``threads`` (a pool of threads each issuing ``os.preadv``, GIL released); ``auto`` takes
uring when it is available. Both follow ``tiers.policy`` (short reads resume, transient
errors are retried, end of file and other errors fail at once) and raise ``OSError``; the
tier turns that into one ``TierError`` naming the file. Bytes that were not read are never
returned.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

import numpy as np
import torch

from .._native import native_disabled
from ..errors import TierError
from ..table.format import PAGE_BYTES, SECTOR_BYTES, TableHeader
from ..table.verify import BlockVerifier, page_checksum_error
from ._buffers import ThreadBuffers, aligned_empty, gather_at
from .base import Tier
from .pagecheck import check_pages, plan_pages
from .policy import DEFAULT_QUEUE_DEPTH, DEFAULT_RETRIES, failure_message, is_transient

__all__ = ["DEFAULT_RINGS", "DirectTier", "ENGINES", "PIPELINE_ROWS", "ThreadEngine", "UringEngine", "plan_spans"]

ENGINES = ("auto", "uring", "threads")
DEFAULT_RINGS = 4
"""io_uring rings a direct store keeps at most, shared by all its caller threads."""
PIPELINE_ROWS = 256
"""Rows a chunk of a pipelined native read, when asked for (``pipeline_rows``; see the module doc)."""

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


class Engine(Protocol):
    """Reads byte spans of one descriptor into a buffer; raises ``OSError`` on failure."""

    name: str

    @property
    def retried(self) -> int:
        """Reads reissued so far (short reads, transient errors)."""
        ...

    def read(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dest_offsets: np.ndarray) -> None:
        """Read ``lengths[i]`` bytes at ``offsets[i]`` into ``dest[dest_offsets[i]:]`` for every i."""
        ...

    def close(self) -> None:
        """Free the engine's threads or rings (not the descriptor); no read is running."""
        ...


class ThreadEngine:
    """Reads spans with ``pread`` on a pool of threads, following ``tiers.policy``.

    ``fd`` is borrowed: the tier keeps it open until after ``close``.
    """

    name = "threads"

    def __init__(self, fd: int, threads: int, pread: Pread = os.preadv, retries: int = DEFAULT_RETRIES) -> None:
        self.fd, self.threads, self.pread, self.retries = fd, threads, pread, retries
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="engram-direct")
        self._retried_lock = threading.Lock()
        self._retried = 0

    @property
    def retried(self) -> int:
        return self._retried

    def read(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dest_offsets: np.ndarray) -> None:
        n = len(offsets)
        parts = min(self.threads, n)
        bounds = np.linspace(0, n, parts + 1).astype(np.int64).tolist()
        jobs = [
            (offsets[a:b].tolist(), lengths[a:b].tolist(), dest_offsets[a:b].tolist())
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        view = memoryview(dest)  # type: ignore[arg-type]  # NumPy's stubs lack __buffer__
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
        fd, pread = self.fd, self.pread
        for off, length, d in zip(offsets, lengths, dests):
            failures = 0
            try:
                got = pread(fd, [view[d: d + length]], off)
            except OSError as exc:
                if not is_transient(exc.errno):
                    raise _failed(exc, length, off, 0, 0) from exc
                failures = 1
            else:
                if got == length:
                    continue
                if got == 0:
                    raise OSError(errno.EIO, failure_message(length, off, 0, 0, "end of file"))
            self._read_carefully(off, length, view[d: d + length], failures)

    def _read_carefully(self, off: int, length: int, view: memoryview, failures: int) -> None:
        """One span after a first attempt that failed transiently (``failures`` 1) or came
        back short (0): ``1 + retries`` failed attempts in all before ``OSError``."""
        done = 0
        while done < length:
            self._count_retry()
            try:
                got = self.pread(self.fd, [view[done:]], off + done)
            except OSError as exc:
                if not is_transient(exc.errno) or failures >= self.retries:
                    raise _failed(exc, length, off, done, failures) from exc
                failures += 1
                continue
            if got == 0:
                raise OSError(errno.EIO, failure_message(length, off, done, failures, "end of file"))
            # Resume a short read at its last whole sector (O_DIRECT needs aligned offsets).
            advanced = got - (got % SECTOR_BYTES if done + got < length else 0)
            if not advanced:  # short of even one sector: no progress, a failure
                if failures >= self.retries:
                    raise OSError(errno.EIO, failure_message(length, off, done, failures, "short reads"))
                failures += 1
            done += advanced

    def _count_retry(self) -> None:
        with self._retried_lock:
            self._retried += 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _failed(exc: OSError, length: int, off: int, done: int, retries: int) -> OSError:
    """``exc`` restated in the policy's sentence (what, where, after how many retries)."""
    return OSError(exc.errno, failure_message(length, off, done, retries, exc.strerror or str(exc)))


class UringEngine:
    """Reads spans through the native io_uring helper, on a pool of at most ``rings`` rings.

    A caller takes an idle ring (making one while fewer than ``rings`` exist, else waiting
    for one), so descriptors stay bounded however many threads come and go.
    """

    name = "uring"

    def __init__(self, fd: int, queue_depth: int, retries: int = DEFAULT_RETRIES, rings: int = DEFAULT_RINGS) -> None:
        from . import uring

        if rings < 1:
            raise ValueError(f"rings must be >= 1, got {rings}")
        self._uring, self.fd, self.queue_depth, self.retries, self.rings = uring, fd, queue_depth, retries, rings
        self._pool = threading.Condition(threading.Lock())
        self._idle: list = []
        self._made: list = []  # every ring made and not yet discarded
        self._retired = 0  # reissued reads of discarded rings

    @property
    def retried(self) -> int:
        with self._pool:
            return self._retired + sum(reader.retried for reader in self._made)

    def read(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dest_offsets: np.ndarray) -> None:
        reader = self._take()
        try:
            reader.read(offsets, lengths, dest, dest_offsets)
        finally:
            self._give_back(reader)

    def read_rows(self, ids: np.ndarray, out: np.ndarray, header: TableHeader, verify: bool):
        """Rows ``ids`` of a version-2 table into ``out`` (uint8 ``[n, row_bytes]``) in one
        native call: ``uring.UringReader.read_rows``, whose ``RowsRead`` it returns."""
        reader = self._take()
        try:
            return reader.read_rows(ids, out, header.layout, header.page_sums if verify else None)
        finally:
            self._give_back(reader)

    def _take(self):
        with self._pool:
            self._pool.wait_for(lambda: self._idle or len(self._made) < self.rings)
            if self._idle:
                return self._idle.pop()
            reader = self._uring.UringReader(self.fd, self.queue_depth, retries=self.retries)
            self._made.append(reader)
            return reader

    def _give_back(self, reader) -> None:
        with self._pool:
            if reader.broken:  # io_uring_enter itself failed: make a fresh ring next time
                self._made.remove(reader)
                self._retired += reader.retried
                reader.close()
            else:
                self._idle.append(reader)
            self._pool.notify()

    def close(self) -> None:
        with self._pool:
            for reader in self._made:
                self._retired += reader.retried
                reader.close()
            self._idle.clear()
            self._made.clear()


class DirectTier(Tier):
    """Rows read with O_DIRECT from the table file, bypassing the page cache.

    Options: ``engine`` (``auto`` | ``uring`` | ``threads``), ``queue_depth`` (reads in
    flight: io_uring queue depth per ring, or thread count for ``threads``), ``rings`` (io_uring
    rings shared by the caller threads), ``retries`` (per read), ``verify_reads`` (check
    each block's checksum the first time a read touches it), ``verify_pages`` (check every
    page read against its checksum, version-2 tables; on by default, off only to measure
    what the check costs), ``native_rows`` (read a version-2 table's rows in one native
    call with the ``uring`` engine; off: the Python steps, as the ``threads`` engine),
    ``pread`` (the ``os.preadv``-like function of the threads engine; a fault-injection hook),
    ``pipeline_rows`` (chunk rows of a pipelined native read, e.g. ``PIPELINE_ROWS``; 0, the
    default: one call; see the module doc).
    """

    name = "direct"

    def __init__(
        self,
        header: TableHeader,
        *,
        engine: str = "auto",
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        retries: int = DEFAULT_RETRIES,
        verify_reads: bool = False,
        verify_pages: bool = True,
        pread: Pread | None = None,
        rings: int = DEFAULT_RINGS,
        native_rows: bool = True,
        pipeline_rows: int = 0,
    ) -> None:
        super().__init__(header)
        if pipeline_rows < 0:
            raise ValueError(f"pipeline_rows must be >= 0 (0: off), got {pipeline_rows}")
        self.pipeline_rows = int(pipeline_rows)
        self._lanes: UringEngine | None = None  # rings of half the queue depth, for pipelined reads
        self._helper: ThreadPoolExecutor | None = None
        self._pipeline_lock = threading.Lock()
        self.whole_pages = header.page_sums is not None  # version 2: read pages whole
        self.verify_pages = verify_pages and self.whole_pages
        self.native_rows = native_rows
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
        self._engine: Engine
        if engine == "uring":
            self._engine = UringEngine(self._fd, queue_depth, retries, rings)
            if self.pipeline_rows and queue_depth >= 2:
                self._lanes = UringEngine(self._fd, queue_depth // 2, retries, rings)
        else:
            self._engine = ThreadEngine(self._fd, queue_depth, pread or os.preadv, retries)
        self.engine = engine
        self._buffers = ThreadBuffers()
        self._verifier = BlockVerifier(header, self._read_block) if verify_reads else None
        self._block_buf: np.ndarray | None = None
        try:  # some file systems accept O_DIRECT at open and refuse it at read
            self._read_spans(np.array([header.layout.data_offset], np.int64), np.array([PAGE_BYTES], np.int64),
                             aligned_empty(PAGE_BYTES), np.zeros(1, np.int64))
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

    def _read_spans(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dest_offsets: np.ndarray) -> None:
        """The engine's read; its ``OSError`` becomes the one ``TierError`` naming the file."""
        try:
            self._engine.read(offsets, lengths, dest, dest_offsets)
        except OSError as exc:
            batch = f" (one of a batch of {len(offsets)} reads)" if len(offsets) > 1 else ""
            raise self._read_failed(exc, batch) from exc

    def _read_failed(self, exc: OSError, context: str) -> TierError:
        return TierError(f"{self.header.path}: {exc.strerror or exc}{context}")

    def _read_block(self, block: int) -> memoryview:
        start, end = self.layout.block_range(block)
        if self._block_buf is None:
            self._block_buf = aligned_empty(self.layout.block_size)
        self._read_spans(np.array([start], np.int64), np.array([end - start], np.int64),
                         self._block_buf, np.zeros(1, np.int64))
        self._count(reads=1, bytes_read=end - start)
        return memoryview(self._block_buf)[: end - start]  # type: ignore[arg-type]  # NumPy's stubs lack __buffer__

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        layout = self.layout
        if self._verifier is not None:
            self._verifier.ensure(layout.row_offsets(ids))
        if self.whole_pages and self._reads_rows_natively():
            self._read_rows_natively(ids, out)
            return
        offsets = layout.row_offsets(ids)
        if self.whole_pages:
            self._read_pages(offsets, out)
            return
        starts, lengths, dests, total, positions = plan_spans(
            offsets, layout.row_bytes, layout.page_bytes, layout.data_offset
        )
        buf = self._buffers.get(total)
        self._read_spans(starts, lengths, buf, dests)
        gather_at(torch.from_numpy(buf[:total]), positions, out)
        self._count(reads=len(starts), bytes_read=int(lengths.sum()))

    def _read_pages(self, offsets: np.ndarray, out: torch.Tensor) -> None:
        """Whole pages, each checked against its checksum (``verify_pages``) before use."""
        plan = plan_pages(offsets, self.layout)
        page = self.layout.page_bytes
        buf = self._buffers.get(plan.nbytes)
        self._read_spans(plan.starts, np.full(len(plan.starts), page, np.int64), buf, plan.dests)
        self._count(reads=len(plan.starts), bytes_read=plan.nbytes)
        if self.verify_pages:
            def reread(bad: np.ndarray) -> None:
                self._count(reads=len(bad), bytes_read=len(bad) * page, page_rereads=len(bad))
                self._read_spans(plan.starts[bad], np.full(len(bad), page, np.int64), buf, plan.dests[bad])

            self._count(pages_checked=len(plan.pages))
            check_pages(self.header, plan, buf, reread)
        gather_at(torch.from_numpy(buf[: plan.nbytes]), plan.positions, out)

    def _reads_rows_natively(self) -> bool:
        return self.native_rows and isinstance(self._engine, UringEngine) and not native_disabled()

    def _read_rows_natively(self, ids: np.ndarray, out: torch.Tensor) -> None:
        """Pages read, checked (``verify_pages``) and rows copied out in one native call, or
        pipelined over two lanes (see the module doc)."""
        assert isinstance(self._engine, UringEngine)
        direct_out = out.device.type == "cpu" and out.is_contiguous()
        dest = out if direct_out else torch.empty(out.shape, dtype=torch.uint8)  # [n, row_bytes]
        cuts = self._chunks(ids)
        try:
            if cuts is None:
                got = [self._engine.read_rows(ids, dest.numpy(), self.header, self.verify_pages)]
            else:
                got = self._read_pipelined(ids, dest.numpy(), cuts)
        except OSError as exc:
            raise self._read_failed(exc, f" (reading the pages of {len(ids)} rows)") from exc
        page = self.layout.page_bytes
        reads = sum(g.reads for g in got)
        self._count(reads=reads, bytes_read=reads * page, pages_checked=sum(g.pages_checked for g in got),
                    page_rereads=sum(g.page_rereads for g in got))
        bad = next((g.bad_page for g in got if g.bad_page >= 0), -1)
        if bad >= 0:
            raise page_checksum_error(self.header, bad)
        if not direct_out:
            out.copy_(dest)

    def _chunks(self, ids: np.ndarray) -> list[int] | None:
        """Chunk boundaries of a pipelined read of ``ids`` (``[0, ..., n]``, never between two
        neighbouring ids of one page); None when the read is too small, pipelining is off, or
        the ids are not in ascending order (chunks of ids in any order would share pages, each
        read once a chunk: a store's ids are sorted)."""
        chunk, n = self.pipeline_rows, len(ids)
        if self._lanes is None or n <= 2 * chunk or not bool((ids[1:] >= ids[:-1]).all()):
            return None
        rpp = self.layout.rows_per_page
        cuts = [0]
        for cut in range(chunk, n, chunk):
            cut = max(cut, cuts[-1] + 1)
            while cut < n and ids[cut] // rpp == ids[cut - 1] // rpp:
                cut += 1
            if cut < n:
                cuts.append(cut)
        cuts.append(n)
        return cuts

    def _read_pipelined(self, ids: np.ndarray, dest: np.ndarray, cuts: list[int]) -> list:
        """Chunks ``ids[cuts[k]:cuts[k+1]]`` read into ``dest`` on two lanes: even chunks on
        the caller's thread, odd ones on a helper. Returns every chunk's ``RowsRead`` in order;
        after a failure each lane stops at its next chunk, both end, and the failure of the
        earliest failing chunk is raised (an ``OSError``; a bad page is its ``RowsRead``'s)."""
        lanes = self._lanes
        assert lanes is not None
        chunks = len(cuts) - 1
        results: list = [None] * chunks
        errors: list[BaseException | None] = [None] * chunks
        stop = threading.Event()

        def lane(first: int) -> None:
            for k in range(first, chunks, 2):
                if stop.is_set():
                    return
                a, b = cuts[k], cuts[k + 1]
                try:
                    results[k] = lanes.read_rows(ids[a:b], dest[a:b], self.header, self.verify_pages)
                except BaseException as exc:  # noqa: BLE001 - raised below, in the batch's order
                    errors[k] = exc
                    stop.set()
                    return
                if results[k].bad_page >= 0:
                    stop.set()
                    return

        helper = self._helper_pool().submit(lane, 1)
        try:
            lane(0)
        finally:
            helper.result()  # lane 1 never raises: it keeps its errors; no read of it is left running
        for k in range(chunks):
            if errors[k] is not None:
                raise errors[k]  # type: ignore[misc]
            if results[k] is not None and results[k].bad_page >= 0:
                break
        return [r for r in results if r is not None]

    def _helper_pool(self) -> ThreadPoolExecutor:
        with self._pipeline_lock:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(max_workers=DEFAULT_RINGS, thread_name_prefix="engram-lane")
            return self._helper

    def stats(self) -> dict:
        verified = self._verifier.blocks_verified if self._verifier else 0
        stats = super().stats()
        stats["retries"] += self._engine.retried + (self._lanes.retried if self._lanes is not None else 0)
        return {**stats, "engine": self.engine, "queue_depth": self.queue_depth, "blocks_verified": verified,
                "verify_pages": self.verify_pages}

    def _release(self) -> None:
        helper = getattr(self, "_helper", None)
        if helper is not None:
            helper.shutdown(wait=True)
        for engine in (getattr(self, "_engine", None), getattr(self, "_lanes", None)):
            if engine is not None:
                engine.close()
        os.close(self._fd)


def _uring_available() -> bool:
    try:
        from . import uring
    except ImportError:
        return False
    return uring.available()
