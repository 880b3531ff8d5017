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
import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from ..buffers.rowcopy import move_rows
from ..errors import TierError
from ..machine import available_memory_bytes
from ..table.checkpoint import checkpoint_of, load_rows
from ..table.format import TableHeader
from ..table.progress import byte_progress
from ..table.stream import ChunkReader, Span, open_for_load, read_fully
from ._buffers import madvise_quietly, private_mapping
from .base import Tier
from .pagecheck import check_pages, run_of_pages

__all__ = ["MemoryTier", "check_free_memory", "load_dense_rows"]

LOAD_CHUNK_BYTES = 16 << 20
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


_read_fully = read_fully  # what a load reads a span with (tests put faults in here)


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
    segment), checking as ``load_dense_rows`` says; ``on_chunk(bytes done)`` after each chunk.
    A checkpoint's rows (a ``CheckpointHeader``, or a slice of one: ``first_row`` of
    ``layered.window_header``; of its ``parts`` only for ``scales_header``) come from its shards,
    each page checked against its sidecar."""
    prefaulter = _Prefaulter(dense)
    try:
        checkpoint = checkpoint_of(header)
        if checkpoint is not None:
            first = getattr(header, "first_row", 0)
            load_rows(checkpoint, first, first + header.layout.num_rows, dense, parts=getattr(header, "parts", None),
                      verify=verify is not False, progress=progress, what=what, on_chunk=on_chunk,
                      chunk_bytes=LOAD_CHUNK_BYTES, read=_read_fully)
        else:
            _load_table(header, dense, verify is not False, progress, what, on_chunk)
    finally:
        prefaulter.stop()


def _load_table(header: TableHeader, dense: np.ndarray, verify: bool, progress: bool | None, what: str,
                on_chunk: Callable[[int], None] | None) -> None:
    """``load_rows_into`` of a table file: its data pages in chunks, checked, compacted into rows."""
    layout = header.layout
    page = layout.page_bytes
    chunk_pages = max(1, LOAD_CHUNK_BYTES // page)
    fd = open_for_load(header.path)

    def chunks():
        for first in range(0, layout.num_pages, chunk_pages):
            n = min(chunk_pages, layout.num_pages - first) * page
            yield (first, n // page), [Span(fd, layout.data_offset + first * page, n, n, header.path)]

    reader = ChunkReader(chunks(), chunk_pages * page, _read_fully)
    done = 0
    try:
        with byte_progress(f"{what} {header.path.name}", layout.data_bytes, progress) as advance:
            for (first, pages), buf in reader:
                view = buf[: pages * page]
                if verify:
                    _check_loaded_pages(header, fd, first, view)
                _compact(view, first, pages, layout, dense)
                reader.release(buf)
                advance(len(view))
                done += len(view)
                if on_chunk is not None:
                    on_chunk(done)
    finally:
        reader.stop()
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
