"""``direct`` tier: O_DIRECT reads of the pages holding the requested rows.

Per request, rows are grouped by page and each touched page costs one read of the whole
page, which is checked against its checksum before a row of it is returned
(``tiers.pagecheck``: a bad page is read once more, then ``ChecksumError``), whichever
engine read it. Pages are read into a page-aligned buffer, then rows are copied out. With
the ``uring`` engine, a request's rows are read in one native call
(``UringReader.read_rows``: pages read, checked, re-read once, rows copied out, the GIL
released throughout); ``ENGRAM_OFFLOAD_NO_NATIVE`` keeps the Python steps above.

Engines: ``uring`` (the native io_uring helper, ``engram_offload.tiers.uring``, many
reads in flight per system call, a small pool of rings shared by all caller threads) and
``threads`` (a pool of threads each issuing ``os.preadv``, GIL released); ``auto`` takes
uring when it is available. Both follow ``tiers.policy`` (short reads resume, transient
errors are retried, end of file and other errors fail at once) and raise ``OSError``; the
tier turns that into one ``TierError`` naming the file. Bytes that were not read are never
returned.

A checkpoint (``table.checkpoint``) is read from its shards, one descriptor and engine each:
the aligned pages covering each row's values (``pagecheck.plan_checkpoint``; a row may straddle
two pages), each checked against the sidecar's page sums, the rows put together from there. Its
scales (``head_dim / 32`` bytes a row, 6.1 GB for DeepSeek-V4.1-Flash) are held resident by
default, one copy a machine in a ``shared`` segment (``scales="memory"``: this process's own;
``"read"``: their page read beside the values, about twice the reads a row): measured, resident
scales serve 1.8x the rows a second at 0.6x the CPU a row (docs/checkpoint.md).
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
from ..table.checkpoint import CheckpointHeader, scales_header
from ..table.format import PAGE_BYTES, SECTOR_BYTES, TableHeader
from ..table.verify import page_checksum_error
from ._buffers import ThreadBuffers, aligned_empty, gather_at
from .base import Tier
from .pagecheck import PagePlan, check_pages, gather_pieces, plan_checkpoint, plan_pages
from .policy import DEFAULT_QUEUE_DEPTH, DEFAULT_RETRIES, failure_message, is_transient
from .segments import DEFAULT_SHM_DIR

__all__ = ["DEFAULT_RINGS", "DirectTier", "ENGINES", "ThreadEngine", "UringEngine"]

ENGINES = ("auto", "uring", "threads")
SCALES = ("shared", "memory", "read")  # where a checkpoint's scales are: resident (one copy a machine, or ours), or read
DEFAULT_RINGS = 4
"""io_uring rings a direct store keeps at most, shared by all its caller threads."""

Pread = Callable[[int, list, int], int]  # os.preadv's signature


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

    def read_rows(self, ids: np.ndarray, out: np.ndarray, header: TableHeader):
        """Rows ``ids`` of a table into ``out`` (uint8 ``[n, row_bytes]``), pages checked, in one
        native call: ``uring.UringReader.read_rows``, whose ``RowsRead`` it returns."""
        reader = self._take()
        try:
            return reader.read_rows(ids, out, header.layout, header.page_sums)
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
    """Rows read with O_DIRECT from the table file (a checkpoint's shards), bypassing the page cache.

    Options: ``engine`` (``auto`` | ``uring`` | ``threads``), ``queue_depth`` (reads in
    flight: io_uring queue depth per ring, or thread count for ``threads``), ``rings`` (io_uring
    rings shared by the caller threads), ``retries`` (per read), ``pread`` (the
    ``os.preadv``-like function of the threads engine; a fault-injection hook),
    ``scales`` (a checkpoint's: ``shared``, ``memory`` or ``read``, see the module doc) and
    ``shm_dir`` (where shared scales live). Every page read is checked against the table's page
    sums (a checkpoint's: its sidecar's).
    """

    name = "direct"

    def __init__(
        self,
        header: TableHeader,
        *,
        engine: str = "auto",
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        retries: int = DEFAULT_RETRIES,
        pread: Pread | None = None,
        rings: int = DEFAULT_RINGS,
        scales: str = "shared",
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
    ) -> None:
        super().__init__(header)
        if header.page_sums is None:
            raise ValueError(f"{header.path}: the direct tier reads a table file opened with read_header")
        if engine not in ENGINES:
            raise ValueError(f"unknown direct engine {engine!r}; choose one of: {', '.join(ENGINES)}")
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {queue_depth}")
        self.queue_depth = queue_depth
        self._checkpoint = getattr(header, "checkpoint", None)
        if scales not in SCALES:
            raise ValueError(f"unknown scales {scales!r}; choose one of: {', '.join(SCALES)}")
        if engine == "auto":
            engine = "uring" if pread is None and _uring_available() else "threads"
        if engine == "uring" and not _uring_available():
            from . import uring

            raise ValueError(f"engine 'uring' is not available here: {uring.unavailable_reason()}; use engine='threads'")
        self.engine = engine
        self._buffers = ThreadBuffers()
        self._fds: list[int] = []
        self._engines: list[Engine] = []
        files = [header.path] if self._checkpoint is None else list(self._checkpoint.shards)
        sizes = [header.layout.file_bytes] if self._checkpoint is None else self._checkpoint.sizes.tolist()
        probes = [header.layout.data_offset] if self._checkpoint is None else [0] * len(files)
        try:
            for path, size, probe in zip(files, sizes, probes):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        raise self._no_direct_io() from exc
                    raise
                self._fds.append(fd)
                self._engines.append(UringEngine(fd, queue_depth, retries, rings) if engine == "uring"
                                     else ThreadEngine(fd, queue_depth, pread or os.preadv, retries))
                if size >= probe + PAGE_BYTES:  # some file systems accept O_DIRECT at open and refuse it at read
                    self._read_spans(np.array([probe], np.int64), np.array([PAGE_BYTES], np.int64),
                                     aligned_empty(PAGE_BYTES), np.zeros(1, np.int64), len(self._fds) - 1)
            self._fd, self._engine = self._fds[0], self._engines[0]
            held = scales_header(header) if scales != "read" and isinstance(header, CheckpointHeader) else None
            self._scale_tier: Tier | None = None
            self._scales = None
            if held is not None:  # a resident tier of the scales alone
                from . import open_tier

                self._scale_tier = open_tier(scales, held, **({"shm_dir": shm_dir} if scales == "shared" else {}))
                self._scales = self._scale_tier.rows.numpy()  # type: ignore[attr-defined]  # [rows, d/32]
        except BaseException as exc:
            self.close()
            if isinstance(exc, TierError) and isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.EINVAL:
                raise self._no_direct_io() from exc
            raise

    def _no_direct_io(self) -> TierError:
        return TierError(
            f"{self.header.path}: the file system refuses O_DIRECT (EINVAL; tmpfs does, for "
            "one): put the table on a file system with direct I/O (ext4, xfs) or use the "
            "mmap or memory tier"
        )

    def _read_spans(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dest_offsets: np.ndarray,
                    file: int = 0) -> None:
        """An engine's read of file ``file``; its ``OSError`` becomes the one ``TierError`` naming the file."""
        try:
            self._engines[file].read(offsets, lengths, dest, dest_offsets)
        except OSError as exc:
            batch = f" (one of a batch of {len(offsets)} reads)" if len(offsets) > 1 else ""
            raise self._read_failed(exc, batch, file) from exc

    def _read_failed(self, exc: OSError, context: str, file: int = 0) -> TierError:
        path = self.header.path if self._checkpoint is None else self._checkpoint.shards[file]
        return TierError(f"{path}: {exc.strerror or exc}{context}")

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        if self._checkpoint is not None:
            self._read_checkpoint(ids, out)
        elif isinstance(self._engine, UringEngine) and not native_disabled():
            self._read_rows_natively(ids, out)
        else:
            self._read_pages(self.layout.row_offsets(ids), out)

    def _read_pages(self, offsets: np.ndarray, out: torch.Tensor) -> None:
        """Whole pages, each checked against its checksum before use."""
        plan = plan_pages(offsets, self.layout)
        page = self.layout.page_bytes
        buf = self._buffers.get(plan.nbytes)
        self._read_spans(plan.starts, np.full(len(plan.starts), page, np.int64), buf, plan.dests)
        self._count(reads=len(plan.starts), bytes_read=plan.nbytes, pages_checked=len(plan.pages))

        def reread(bad: np.ndarray) -> None:
            self._count(reads=len(bad), bytes_read=len(bad) * page, page_rereads=len(bad))
            self._read_spans(plan.starts[bad], np.full(len(bad), page, np.int64), buf, plan.dests[bad])

        check_pages(self.header, plan, buf, reread)
        gather_at(torch.from_numpy(buf[: plan.nbytes]), plan.positions, out)

    def _read_checkpoint(self, ids: np.ndarray, out: torch.Tensor) -> None:
        """A checkpoint's rows: the pages under their pieces, each checked, the pieces put together."""
        ck = self._checkpoint
        assert ck is not None
        plan = plan_checkpoint(ids, ck, 1 if self._scales is not None else None)
        buf = self._buffers.get(plan.nbytes)
        self._read_planned(plan, np.arange(len(plan.pages)), buf)
        self._count(reads=len(plan.pages), bytes_read=plan.nbytes, pages_checked=len(plan.pages))

        def reread(bad: np.ndarray) -> None:
            self._count(reads=len(bad), bytes_read=len(bad) * PAGE_BYTES, page_rereads=len(bad))
            self._read_planned(plan, bad, buf)

        check_pages(self.header, plan, buf, reread)
        gather_pieces(buf, plan, ck, out, self._scales, ids)

    def _read_planned(self, plan: PagePlan, which: np.ndarray, buf: np.ndarray) -> None:
        """Pages ``which`` (indices into ``plan.pages``) of a checkpoint plan into ``buf``, file by
        file; a page its shard ends in (``valid`` short of a page) is read alone, the rest zeroed."""
        assert plan.files is not None and plan.valid is not None
        files, whole = plan.files[which], plan.valid[which] == PAGE_BYTES
        for file in np.unique(files).tolist():
            full = which[(files == file) & whole]
            if full.size:
                self._read_spans(plan.starts[full], np.full(full.size, PAGE_BYTES, np.int64), buf, plan.dests[full], file)
            for i in which[(files == file) & ~whole].tolist():
                page = buf[plan.dests[i]: plan.dests[i] + PAGE_BYTES]
                try:
                    got = os.preadv(self._fds[file], [page], int(plan.starts[i]))  # type: ignore[list-item]
                except OSError as exc:
                    raise self._read_failed(exc, " (its last page)", file) from exc
                if got < plan.valid[i]:
                    raise self._read_failed(OSError(errno.EIO, "end of file before the indexed end"), "", file)
                page[got:] = 0

    def _read_rows_natively(self, ids: np.ndarray, out: torch.Tensor) -> None:
        """Pages read, checked and rows copied out in one native call."""
        assert isinstance(self._engine, UringEngine)
        direct_out = out.device.type == "cpu" and out.is_contiguous()
        dest = out if direct_out else torch.empty(out.shape, dtype=torch.uint8)  # [n, row_bytes]
        try:
            got = self._engine.read_rows(ids, dest.numpy(), self.header)
        except OSError as exc:
            raise self._read_failed(exc, f" (reading the pages of {len(ids)} rows)") from exc
        self._count(reads=got.reads, bytes_read=got.reads * self.layout.page_bytes, pages_checked=got.pages_checked,
                    page_rereads=got.page_rereads)
        if got.bad_page >= 0:
            raise page_checksum_error(self.header, got.bad_page)
        if not direct_out:
            out.copy_(dest)

    def stats(self) -> dict:
        stats = super().stats()
        stats["retries"] += sum(engine.retried for engine in self._engines)
        scales = self._scale_tier.name if self._scale_tier is not None else "read" if self._checkpoint else None
        return {**stats, "engine": self.engine, "queue_depth": self.queue_depth, "scales": scales}

    def _release(self) -> None:
        scale_tier, self._scale_tier = getattr(self, "_scale_tier", None), None
        if scale_tier is not None:
            self._scales = None
            scale_tier.close()
        for engine in getattr(self, "_engines", []):
            engine.close()
        for fd in getattr(self, "_fds", []):
            os.close(fd)


def _uring_available() -> bool:
    try:
        from . import uring
    except ImportError:
        return False
    return uring.available()
