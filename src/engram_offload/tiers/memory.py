"""``memory`` tier: the whole table as dense rows in RAM (private memory; transparent huge
pages on request).

Loading streams the data region at the disk's sequential rate: a thread reads 16 MiB
chunks (O_DIRECT where the file system allows) while the caller checks the previous chunk's
page checksums (native XXH3, GIL released) and copies its rows into place, and
up to four threads fault the destination's pages in ahead of the copy. Reading, checking
and copying cost about 0.3 s of CPU per GB; faulting fresh memory in is the rest, and
what it costs depends on the machine (measured on a two-core virtual machine whose host
takes free guest memory back: 0.3 s per GB for 4 KiB pages the guest had freed but the
host had not taken back, 2 to 2.4 s per GB for memory the host had taken back, which
a huge page always is there; on bare metal the kernel zeroes at several GB/s).

Huge pages make random row reads faster (measured: 60 ns a row against 92-104 with 4 KiB
pages), so ``huge_pages=True`` suits a server that loads once and serves long; 4 KiB
pages (the default) load faster where faulting huge pages in is dear.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from ..buffers.rowcopy import move_rows
from ..errors import TierError
from ..machine import available_memory_bytes
from ..table.format import PAGE_BYTES, TableHeader
from ..table.progress import byte_progress
from ._buffers import aligned_empty, madvise_quietly, private_mapping
from .base import Tier
from .pagecheck import check_pages, run_of_pages

__all__ = ["MemoryTier", "check_free_memory", "load_dense_rows"]

LOAD_CHUNK_BYTES = 16 << 20
LOAD_BUFFERS = 3  # one being read, one being checked and copied, one spare
PREFAULT_STEP_BYTES = 64 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, in one call
PREFAULT_THREADS = max(1, min(4, (os.cpu_count() or 1)))


def check_free_memory(header: TableHeader, what: str) -> None:
    """``TierError`` when loading ``header``'s rows would need more than ``MemAvailable``."""
    need = header.layout.num_rows * header.layout.row_bytes
    available = available_memory_bytes()
    if available is not None and need > available:
        raise TierError(
            f"{header.path}: the {what} tier loads the whole table into RAM: it needs "
            f"{need / 2**30:,.2f} GiB and {available / 2**30:,.2f} GiB is available (MemAvailable); "
            "use the mmap or direct tier, free memory, or pass check_memory=False to load anyway"
        )


def _open_for_load(path) -> int:
    """A descriptor on ``path``: O_DIRECT where the file system takes it (no page-cache copy,
    no cache pollution), else buffered."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, os.O_RDONLY)
    probe = aligned_empty(PAGE_BYTES)
    try:
        # some file systems take O_DIRECT at open and refuse it at read
        os.preadv(fd, [probe], 0)  # type: ignore[list-item]  # NumPy's stubs lack __buffer__
    except OSError as exc:
        os.close(fd)
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, os.O_RDONLY)
    return fd


def _read_fully(fd: int, view: np.ndarray, offset: int, path) -> None:
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], offset + done)  # type: ignore[list-item]  # NumPy's stubs lack __buffer__
        except OSError as exc:
            raise TierError(f"{path}: reading {len(view) - done} bytes at offset {offset + done} while "
                            f"loading failed: {exc.strerror or exc}") from exc
        if got == 0:
            raise TierError(f"{path} ended early while loading: the file changed under us; "
                            "check it with `engram-offload verify` and reopen it")
        done += got


class _ChunkReader:
    """Reads the data region in chunks on a thread, into a few reused page-aligned buffers,
    so the next chunk is read while the caller checks and copies the previous one."""

    def __init__(self, header: TableHeader, fd: int) -> None:
        layout = header.layout
        self.header, self.fd = header, fd
        self.chunk_pages = max(1, LOAD_CHUNK_BYTES // layout.page_bytes)
        self._free: queue.Queue = queue.Queue()
        self._full: queue.Queue = queue.Queue()
        for _ in range(LOAD_BUFFERS):
            self._free.put(aligned_empty(self.chunk_pages * layout.page_bytes))
        self._thread = threading.Thread(target=self._run, name="engram-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        layout = self.header.layout
        try:
            for first in range(0, layout.num_pages, self.chunk_pages):
                buf = self._free.get()
                if buf is None:  # the caller stopped
                    return
                pages = min(self.chunk_pages, layout.num_pages - first)
                _read_fully(self.fd, buf[: pages * layout.page_bytes],
                            layout.data_offset + first * layout.page_bytes, self.header.path)
                self._full.put((first, pages, buf))
            self._full.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._full.put(exc)

    def __iter__(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """(first page, pages, buffer holding them); hand the buffer back with ``release``."""
        while True:
            item = self._full.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def release(self, buf: np.ndarray) -> None:
        self._free.put(buf)

    def stop(self) -> None:
        self._free.put(None)
        self._thread.join()


class _Prefaulter:
    """Faults ``dense`` (uint8, flat) in, front to back, on ``threads`` threads taking
    64 MiB steps in turn: ``madvise(MADV_POPULATE_WRITE)`` through ctypes (the GIL
    released), or a write per page where the kernel lacks it. The kernel zeroes every new
    page (about 0.6 s of CPU per GB measured), more than one core's worth at a fast disk's
    rate, hence several threads."""

    def __init__(self, dense: np.ndarray, threads: int = PREFAULT_THREADS) -> None:
        self.dense = dense.reshape(-1)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, threads), name="engram-prefault", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, first: int, every: int) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            libc = None
        base, total = self.dense.ctypes.data, self.dense.nbytes
        for start in range(first * PREFAULT_STEP_BYTES, total, every * PREFAULT_STEP_BYTES):
            if self._stop.is_set():
                return
            length = min(PREFAULT_STEP_BYTES, total - start)
            if libc is None or libc.madvise(base + start, length, MADV_POPULATE_WRITE) != 0:
                libc = None  # not supported here: touch one byte a page (the copy writes them all later)
                self.dense[start: start + length: mmap.PAGESIZE] = 0

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def load_dense_rows(
    header: TableHeader, verify: bool | None = None, progress: bool | None = None, huge_pages: bool = False
) -> tuple[torch.Tensor, mmap.mmap, bool]:
    """Read a table's rows into a private anonymous mapping as dense ``uint8 [num_rows, row_bytes]``.

    Returns (rows, the mapping, whether MADV_HUGEPAGE was asked for and accepted). Reading (a thread,
    O_DIRECT where possible) overlaps checking and copying. ``verify`` (None or True) checks
    the page checksums (a bad page is read once more, then ``ChecksumError`` naming it);
    False checks nothing.
    """
    layout = header.layout
    nbytes = layout.num_rows * layout.row_bytes
    mm = private_mapping(nbytes)
    huge = huge_pages and madvise_quietly(mm, "MADV_HUGEPAGE")
    dense = np.frombuffer(mm, np.uint8, count=nbytes).reshape(layout.num_rows, layout.row_bytes)
    load_rows_into(header, dense, verify, progress)
    return torch.from_numpy(dense), mm, huge


def load_rows_into(header: TableHeader, dense: np.ndarray, verify: bool | None = None,
                   progress: bool | None = None, what: str = "loading",
                   on_chunk: Callable[[int], None] | None = None) -> None:
    """Read a table's rows into ``dense`` (``uint8 [num_rows, row_bytes]``, e.g. a shared
    segment), checking as ``load_dense_rows`` says; ``on_chunk(bytes done)`` after each chunk."""
    layout = header.layout
    page = layout.page_bytes
    pages_checked = verify is not False
    prefaulter = _Prefaulter(dense)
    try:
        fd = _open_for_load(header.path)
    except BaseException:
        prefaulter.stop()
        raise
    reader = _ChunkReader(header, fd)
    done = 0
    try:
        with byte_progress(f"{what} {header.path.name}", layout.data_bytes, progress) as advance:
            for first, pages, buf in reader:
                view = buf[: pages * page]
                if pages_checked:
                    _check_loaded_pages(header, fd, first, view)
                _compact(view, first, pages, layout, dense)
                reader.release(buf)
                advance(len(view))
                done += len(view)
                if on_chunk is not None:
                    on_chunk(done)
    finally:
        reader.stop()
        prefaulter.stop()
        os.close(fd)


def _check_loaded_pages(header: TableHeader, fd: int, first: int, view: np.ndarray) -> None:
    """Pages ``first..`` held in ``view`` against their checksums; a bad one is read again."""
    page = header.layout.page_bytes
    plan = run_of_pages(first, len(view) // page, header.layout)

    def reread(bad: np.ndarray) -> None:
        for i in bad.tolist():
            at = int(plan.dests[i])
            _read_fully(fd, view[at: at + page], int(plan.starts[i]), header.path)

    check_pages(header, plan, view, reread)


def _compact(view: np.ndarray, first: int, pages: int, layout, dense: np.ndarray) -> None:
    """Copy the rows of pages ``first..first+pages-1`` (``view``: those pages) into ``dense``."""
    rb, rpp, page = layout.row_bytes, layout.rows_per_page, layout.page_bytes
    row = first * rpp
    whole = min(pages, (layout.num_rows - row) // rpp)  # pages whose every row slot is a row
    if whole:
        np.copyto(dense[row: row + whole * rpp].reshape(whole, rpp * rb),
                  view[: whole * page].reshape(whole, page)[:, : rpp * rb])
    rest = min(layout.num_rows - row, pages * rpp) - whole * rpp  # rows of a last, partial page
    if rest > 0:
        at = whole * page
        dense[row + whole * rpp: row + whole * rpp + rest] = view[at: at + rest * rb].reshape(rest, rb)


class MemoryTier(Tier):
    """All rows in host memory; a read is one row gather (``rowcopy.move_rows``).

    Options: ``verify_reads`` (None or True, the default: check the page checksums while
    loading; False: no check),
    ``progress`` (bar while loading, with its GB/s; default for large tables),
    ``check_memory`` (refuse with ``TierError`` when the rows exceed ``MemAvailable``;
    False to insist), ``huge_pages`` (False, the default: 4 KiB pages; True: ask for
    transparent huge pages, faster random row reads, see the module's docstring).
    ``stats()`` has ``load_seconds``, ``load_bytes`` and ``huge_pages`` (asked for and
    accepted).
    """

    name = "memory"
    _mm: mmap.mmap | None  # the mapping behind the rows; None once released (or pinned elsewhere)

    def __init__(self, header: TableHeader, *, verify_reads: bool | None = None, progress: bool | None = None,
                 check_memory: bool = True, huge_pages: bool = False) -> None:
        super().__init__(header)
        if check_memory:
            check_free_memory(header, self.name)
        started = time.perf_counter()
        self._rows, self._mm, self.huge_pages = load_dense_rows(header, verify_reads, progress, huge_pages)
        self.load_seconds = time.perf_counter() - started
        self.verified_on_load = verify_reads is not False

    @property
    def rows(self) -> torch.Tensor:
        """The dense rows, uint8 ``[num_rows, row_bytes]`` (read only by convention)."""
        return self._rows

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        move_rows(self._rows, ids, out, None)
        self._count(bytes_read=len(ids) * self.row_bytes)

    def stats(self) -> dict:
        return {**super().stats(), "huge_pages": self.huge_pages, "verified_on_load": self.verified_on_load,
                "load_seconds": self.load_seconds, "load_bytes": self.layout.data_bytes}

    def _release(self) -> None:
        self._rows = None  # type: ignore[assignment]
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the GC frees it later
                pass
