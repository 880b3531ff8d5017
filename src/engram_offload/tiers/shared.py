"""``shared`` tier: one copy of a table's rows per machine (and uid), in a shared-memory segment.

The first process to open a table loads its rows once into a segment; every later process
of the same uid, of any rank, maps the same pages read-only. N processes hold about one
table of DRAM, not N. The segment outlives its processes (the next start attaches without
loading); ``remove_segment`` removes it.

Who may touch a segment (docs/threat-model.md): only the operator's uid (and root). Segments
live in ``<shm_dir>/engram-uid-<uid>/`` (default ``/dev/shm/engram-uid-<uid>/engram-<fingerprint>``),
a folder of this uid's closed to others, every file in it opened without following links and
checked (``tiers/segments.py``): no other local user can create, swap or read a segment or lock
in it. A segment is created with ``O_EXCL``, mode 0600, and made read-only (0400) once loaded.
Another uid gets a folder and a copy of its own.

A segment is::

    page 0   magic b"ENGRAMSH", u32 version (3), u32 state (0 loading, 1 ready, 2 damaged), u64
             table fingerprint, u64 data bytes, u32 loader pid (once damaged: the pid that found
             it), u32 path length, u64 progress (bytes allocated, then loaded; once damaged: the
             data page that differs), the seal (u32 owner uid, u64 st_dev, u64 st_ino,
             i64 st_ctime_ns, 16-byte digest), the table's real path
    data     dense rows ``uint8 [num_rows, row_bytes]`` from byte 4096

Loading: the loader is elected under an exclusive ``flock`` on ``<segment>.lock`` and holds
it until the segment is ready and sealed: every row, each page checked against the table's
checksums as it is read, then the ready flag, mode 0400, and the seal (``segments.seal``),
which binds the head (fingerprint, size, path) to the file's identity (owner, device, inode,
ctime). The kernel drops the lock when a process dies, so a process that takes the lock and
finds a segment still marked loading removes and reloads it. A waiter gives up with a
``TierError`` naming the lock and the loader after ``lock_timeout`` seconds in which the
loader made no progress.

Attaching: the head (fingerprint, size) is checked under the lock, then, without it, the seal
against the ``fstat`` of the file opened and a sample of pages against the table's page
checksums (``verify_attach``, 32 by default: one at random in each of as many equal stretches
of the table). A segment whose seal does not hold (a copy, a file made again, one written,
truncated, chmod-ed or touched since: each moves its ctime) has every page checked, on a few
threads, as has every segment with ``verify_attach="full"``. A segment that fails (changed,
truncated) is replaced by a fresh load, with a ``RuntimeWarning`` saying why, as is a segment
of an older format; processes still attached to the replaced one keep their mapping. A ready
segment of another table (a reused ``segment=`` name) is refused. A page changed after sealing
without moving the ctime (through a writable mapping made before, or by the hardware) is seen
only if the sample or a read's check meets it, or the scrubber (``tiers/scrub.py``): one of the
attached processes checks every page again in the background, a pass every ``scrub_seconds``.
A segment found damaged there, or replaced by an attach, is marked damaged in its head
(``segments.mark_damaged``): every process still attached refuses to read it from then on.

Reading: every copy out of the mapping is SIGBUS-guarded (``tiers/guarded.py``): a segment
truncated under an attached process gives a ``TierError``. Before each read the mapped head's
state (a segment marked damaged is a ``TierError`` naming the page), then an ``fstat`` checks
the size and the modification time. Each read also checks the page of one of its rows
at random against its checksum (``sample_pages``), and every page it touches with
``verify_reads``: a page changed after loading gives ``ChecksumError``.

Old versions: each attached process holds a shared ``flock`` on its segment. Loading a table
removes the segments of earlier versions of the same file (same path, other fingerprint)
that no process holds; a load that does not fit names the segments still there.

``rows`` is the host tensor (read-only pages), for the GPU path to register in place
(``cudaHostRegister`` with the read-only flag); reads through it are neither guarded nor
checked.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import random
import struct
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType

import numpy as np
import torch

from ..errors import ChecksumError, TierError
from ..table.format import TableHeader
from ..table.verify import bad_pages
from ..units import format_bytes
from ._buffers import ThreadBuffers, gather_at
from .base import Tier
from .guarded import guarded_copy, guarded_copy_available
from .memory import MemoryTier, check_free_memory, load_rows_into
from .pagecheck import plan_pages
from .scrub import SCRUB_SECONDS, Scrubber
from .segments import (
    DATA_OFFSET,
    DEFAULT_SHM_DIR,
    HEAD,
    LOADING,
    LOCK_SUFFIX,
    MAGIC,
    MAX_PATH,
    PROGRESS_OFFSET,
    READY,
    STATE_OFFSET,
    VERSION,
    SegmentFolder,
    election,
    format_version,
    listing,
    mark_damaged,
    read_head,
    remove_files,
    remove_old_versions,
    seal,
    seal_problem,
    uid_folder,
)

__all__ = ["SharedTier", "DEFAULT_SHM_DIR", "DEFAULT_LOCK_TIMEOUT", "DEFAULT_ATTACH_PAGES", "process_pss",
           "remove_segment", "segment_name", "uid_folder"]

DEFAULT_LOCK_TIMEOUT = 60.0  # seconds a waiter allows the lock's holder without progress
DEFAULT_ATTACH_PAGES = 32  # pages of a sealed segment an attaching process checks
MAX_NAME_BYTES = 200
ALLOCATE_STEP = 1 << 30  # posix_fallocate in steps, the progress updated after each
CHECK_CHUNK_BYTES = 4 << 20  # pages rebuilt and checked at a time while attaching
CHECK_THREADS = max(1, min(4, os.cpu_count() or 1))
REPLACE_ATTEMPTS = 3  # loads of a segment found damaged each time, then an error
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def segment_name(header: TableHeader) -> str:
    """The default segment name of a table: ``engram-<fingerprint in hex>``."""
    return f"engram-{header.fingerprint():016x}"


def _address_of(mm: mmap.mmap) -> int:
    """The address a mapping starts at (read-only ones too)."""
    return int(np.frombuffer(mm, np.uint8, count=1).ctypes.data)


def _data_bytes(header: TableHeader) -> int:
    return header.layout.num_rows * header.layout.row_bytes


def _outside_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` for its caller's first caller outside this package."""
    frame: FrameType | None = sys._getframe(2)  # the caller of warn's caller
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def _check_options(segment: object, shm_dir: object, lock_timeout: object, sample_pages: object,
                   verify_attach: object = "full", scrub_seconds: object = None) -> Path:
    """``ValueError`` (one line, naming the value) for an option the tier cannot use; the folder."""
    if segment is not None:
        if not isinstance(segment, str):
            raise ValueError(f"segment must be a file name (str), got {type(segment).__name__} {segment!r}")
        if (not segment or "/" in segment or "\0" in segment or segment.startswith(".")
                or segment.endswith(LOCK_SUFFIX) or len(segment.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES
                or not segment.isprintable()):
            raise ValueError(f"segment must be a plain file name (no folders, not hidden, not ending in "
                             f"{LOCK_SUFFIX}, printable, at most {MAX_NAME_BYTES} bytes), got {segment!r}")
    if not isinstance(shm_dir, (str, os.PathLike)) or isinstance(os.fspath(shm_dir), bytes):
        raise ValueError(f"shm_dir must be a folder path (str), got {type(shm_dir).__name__} {shm_dir!r}")
    folder = os.fspath(shm_dir)
    if not folder or "\0" in folder or not os.path.isabs(folder):
        raise ValueError(f"shm_dir must be an absolute path to a tmpfs folder (such as {DEFAULT_SHM_DIR}), "
                         f"got {folder!r}")
    if isinstance(lock_timeout, bool) or not isinstance(lock_timeout, (int, float)) or not lock_timeout > 0:
        raise ValueError(f"lock_timeout must be a positive number of seconds, got {lock_timeout!r}")
    if isinstance(sample_pages, bool) or not isinstance(sample_pages, int) or sample_pages < 0:
        raise ValueError(f"sample_pages must be a whole number >= 0, got {sample_pages!r}")
    if verify_attach != "full" and (isinstance(verify_attach, bool) or not isinstance(verify_attach, int)
                                    or verify_attach < 0):
        raise ValueError(f'verify_attach must be "full" or a whole number of pages >= 0, got {verify_attach!r}')
    if scrub_seconds is not None and (isinstance(scrub_seconds, bool) or not isinstance(scrub_seconds, (int, float))
                                      or not 0 < scrub_seconds < math.inf):
        raise ValueError(f"scrub_seconds must be a positive number of seconds (or None: no background check), "
                         f"got {scrub_seconds!r}")
    return Path(folder)


def _check_space(header: TableHeader, folder: SegmentFolder, name: str, check_memory: bool) -> None:
    if not check_memory:
        return
    check_free_memory(header, "shared")
    vfs = os.statvfs(folder.fd)
    free, need = vfs.f_bavail * vfs.f_frsize, DATA_OFFSET + _data_bytes(header)
    if need > free:
        raise TierError(
            f"{header.path}: the shared tier needs {format_bytes(need)} in {folder.path} and {format_bytes(free)} is free "
            f"there; {listing(folder, name)}; or enlarge it (mount -o remount,size=...), or use the mmap or "
            "direct tier"
        )


def _load(header: TableHeader, folder: SegmentFolder, name: str, source: bytes, progress: bool | None) -> None:
    """Create segment ``name`` (``O_EXCL``, 0600), write its head (loading), the rows (each
    page checked), the ready flag, make it read-only (0400), and seal it."""
    nbytes = _data_bytes(header)
    total = DATA_OFFSET + nbytes
    fd = folder.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    assert fd is not None

    def advance(done: int) -> None:
        os.pwrite(fd, struct.pack("<Q", done), PROGRESS_OFFSET)

    try:
        os.pwrite(fd, HEAD.pack(MAGIC, VERSION, LOADING, header.fingerprint(), nbytes, os.getpid(), len(source), 0,
                            0, 0, 0, 0, bytes(16)) + source, 0)
        for start in range(0, total, ALLOCATE_STEP):
            try:
                os.posix_fallocate(fd, start, min(ALLOCATE_STEP, total - start))  # ENOSPC now, not SIGBUS later
            except OSError as exc:
                raise TierError(f"cannot create the shared segment {folder.path / name} ({total:,} bytes): "
                                f"{exc.strerror}; {listing(folder, name)}") from exc
            advance(min(total, start + ALLOCATE_STEP))
        mm = mmap.mmap(fd, total)
        dense = None
        try:
            dense = np.frombuffer(mm, np.uint8, count=nbytes, offset=DATA_OFFSET)
            load_rows_into(header, dense.reshape(header.layout.num_rows, header.layout.row_bytes), True, progress,
                           what="sharing", on_chunk=lambda done: advance(total + done))
            mm[STATE_OFFSET: STATE_OFFSET + 4] = struct.pack("<I", READY)  # the rows are all there
            os.fchmod(fd, 0o400)  # nothing writes it again; a truncate needs write access
            seal(fd, mm)  # last
        finally:
            dense = None  # the mapping's last export here
            try:
                mm.close()
            except BufferError:  # a failed load's traceback still holds a view: the GC unmaps it
                pass
    except BaseException:
        folder.unlink(name)
        raise
    finally:
        os.close(fd)


class SharedTier(MemoryTier):
    """All rows in a shared-memory segment, loaded once per machine and uid; ``rows`` is the
    dense rows on read-only shared pages.

    Options: ``segment`` (name; default from the table's fingerprint), ``shm_dir`` (the tmpfs
    folder holding this uid's folder of segments; default ``/dev/shm``), ``lock_timeout``
    (seconds a waiter allows the process loading the segment without progress; default 60),
    ``sample_pages`` (pages each read checks against their checksums, of rows picked at random;
    default 1, 0 for none), ``verify_reads`` (check every page a read touches),
    ``verify_attach`` (pages of a sealed segment checked when attaching, spread over the table;
    default 32; "full" for every page), ``scrub_seconds`` (a pass of the background check of every
    page, by one attached process a segment; default 570, None for none; ``scrubber``),
    ``progress``, ``check_memory`` (refuse to load more than is free; False to insist). ``loaded`` says whether this process loaded the segment (else it
    attached); ``replaced`` why it replaced a damaged one (or None); ``attach_check`` how an
    attach was checked ("loaded", "sample", or "full: " and why) and ``attach_pages_checked``
    how many pages.
    """

    name = "shared"

    def __init__(self, header: TableHeader, *, segment: str | None = None,
                 shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR, lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
                 sample_pages: int = 1, verify_reads: bool = False, verify_attach: int | str = DEFAULT_ATTACH_PAGES,
                 scrub_seconds: float | None = SCRUB_SECONDS, progress: bool | None = None,
                 check_memory: bool = True) -> None:
        Tier.__init__(self, header)  # not MemoryTier's: the rows come from the segment, not a private load
        started = time.perf_counter()
        directory = _check_options(segment, shm_dir, lock_timeout, sample_pages, verify_attach, scrub_seconds)
        self.fingerprint = header.fingerprint()
        self.verify_reads = bool(verify_reads)
        self.sample_pages = sample_pages
        self.verify_attach = verify_attach
        self.attach_check = "loaded"
        self.attach_pages_checked = 0
        self.huge_pages = False  # tmpfs pages
        self.loaded = False
        self.replaced: str | None = None
        self.attach_check_seconds = 0.0
        self._name = segment or segment_name(header)
        self._lock_timeout = lock_timeout
        self.scrubber: Scrubber | None = None
        self._total = DATA_OFFSET + _data_bytes(header)
        self._staging = ThreadBuffers()
        self._rb, self._rpp, self._page = header.layout.row_bytes, header.layout.rows_per_page, header.layout.page_bytes
        self._row_spans = np.empty(0, np.int64), np.empty(0, np.int64)
        self._folder = SegmentFolder(directory)
        self.segment = Path(os.path.realpath(self._folder.path)) / self._name
        try:
            self._fd, self._mm = self._attach(header, lock_timeout, progress, check_memory)
        except BaseException:
            self._folder.close()
            raise
        with warnings.catch_warnings():  # the pages are read-only; the tier never writes them
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            nbytes = _data_bytes(header)
            flat = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=DATA_OFFSET) if nbytes \
                else torch.empty(0, dtype=torch.uint8)
        self._rows = flat.view(header.layout.num_rows, header.layout.row_bytes)  # [num_rows, row_bytes]
        self._address = _address_of(self._mm)
        self.verified_on_load = True  # loaded with every page checked, here or by the loader that sealed it
        self.load_seconds = time.perf_counter() - started  # loading the segment, or attaching to it
        if scrub_seconds is not None:
            self.scrubber = Scrubber(self, scrub_seconds)

    # ----------------------------------------------------------------------------- attach
    def _attach(self, header: TableHeader, lock_timeout: float, progress: bool | None,
                check_memory: bool) -> tuple[int, mmap.mmap]:
        """Load or attach, check, and replace a damaged segment; the segment's descriptor
        (holding a shared ``flock`` while this tier is open) and its read-only mapping."""
        for _ in range(REPLACE_ATTEMPTS):
            with election(self._folder, self._name, lock_timeout):
                fd = self._open_or_load(header, progress, check_memory)
            try:
                mm, problem = self._map(fd)
                if mm is not None:
                    if self.loaded:
                        return fd, mm
                    checked = time.perf_counter()
                    problem = self._check_attach(fd, mm)
                    now = os.fstat(fd)
                    if problem is None and (now.st_mtime_ns, now.st_ctime_ns) != (self._mtime_ns, self._ctime_ns):
                        problem = "was modified while it was checked"
                    self.attach_check_seconds += time.perf_counter() - checked
                    if problem is None:
                        return fd, mm
                with election(self._folder, self._name, lock_timeout):
                    if self._folder.holds(self._name, fd):  # not already replaced by another process
                        if mm is not None:  # its attached processes stop reading it
                            mark_damaged(fd, self._bad_page)
                        self._folder.unlink(self._name)
                        self._replaced(str(problem))
                if mm is not None:
                    with contextlib.suppress(BufferError):
                        mm.close()
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise TierError(f"the shared segment {self.segment} was damaged again each of {REPLACE_ATTEMPTS} times it "
                        "was loaded: something of this uid (or root) writes to it; find it (fuser -v), then open "
                        "the table again")

    def _map(self, fd: int) -> tuple[mmap.mmap | None, str | None]:
        """The segment's read-only mapping; or None and why, for one cut short since its size was checked."""
        try:
            mm = mmap.mmap(fd, self._total, prot=mmap.PROT_READ)
        except ValueError:  # shorter than the mapping: truncated after _usable's check
            return None, (f"was truncated to {os.fstat(fd).st_size:,} bytes ({self._total:,} expected) "
                          "before it was mapped")
        st = os.fstat(fd)
        self._mtime_ns, self._ctime_ns = st.st_mtime_ns, st.st_ctime_ns
        return mm, None

    def _replaced(self, problem: str) -> None:
        """Record and warn why the segment was replaced, at the first caller outside this package."""
        self.replaced = problem
        warnings.warn(f"the shared segment {self.segment} {problem}: replaced by a fresh load of "
                      f"{self.header.path} (processes still attached to the old one keep it)",
                      RuntimeWarning, stacklevel=_outside_stacklevel())

    def _open_or_load(self, header: TableHeader, progress: bool | None, check_memory: bool) -> int:
        """Under the election: the segment's descriptor, shared-locked; loaded here when
        absent, half-loaded, truncated or an unused older version of this table."""
        folder, name = self._folder, self._name
        source = os.fsencode(header.path.resolve())[:MAX_PATH]  # any bytes the file system allows
        found, fd = folder.open(name, os.O_RDONLY), None
        if found is not None:
            try:
                fd = self._usable(found, source.decode("utf-8", "replace"))  # closes it when it returns None
            except BaseException:
                os.close(found)
                raise
        if fd is None:
            remove_old_versions(folder, source.decode("utf-8", "replace"), self.fingerprint, keep=name)
            _check_space(header, folder, name, check_memory)
            _load(header, folder, name, source, progress)
            self.loaded, self.attach_check = True, "loaded"
            fd = folder.open(name, os.O_RDONLY)
            if fd is None:
                raise TierError(f"the shared segment {self.segment} vanished right after it was loaded: another "
                                "process of this uid removes segments; open the table again")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # this process uses it (see segments.claim_unused)
        except BlockingIOError:
            os.close(fd)
            raise TierError(f"the shared segment {self.segment} is locked by a process removing it: "
                            "open the table again") from None
        return fd

    def _usable(self, fd: int, source: str) -> int | None:
        """``fd`` when its ready segment holds this table with the right size; None (after
        removing it) for one a dead loader left, a truncated one, or an unused older version."""
        head, size = read_head(fd), os.fstat(fd).st_size
        if head is None or head.state != READY:  # its loader died (the lock was free), or an older release's
            version = format_version(fd)
            self._folder.unlink(self._name)
            if version is not None and version != VERSION:
                self._replaced(f"is of segment format {version}, which this release does not read "
                               f"(it writes {VERSION})")
            os.close(fd)
            return None
        if head.fingerprint != self.fingerprint:
            older = head.source == source
            try:  # nobody else holds it while we hold its lock: an attached process keeps a shared flock
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                unused = True
            except BlockingIOError:
                unused = False
            if older and unused:
                self._folder.unlink(self._name)
                os.close(fd)
                return None
            what = "an older version of this table" if older else f"another table ({head.source})"
            fix = ("close the processes using it" if older and not unused
                   else "remove the stale one with engram_offload.tiers.shared.remove_segment (or rm) when no process "
                   "uses it")
            raise TierError(f"the shared segment {self.segment} holds {what}, fingerprint {head.fingerprint:016x}, "
                            f"not {self.header.path} (fingerprint {self.fingerprint:016x}): pick another segment "
                            f"name, or {fix}")
        nbytes = _data_bytes(self.header)
        if head.nbytes != nbytes or size < self._total:
            self._folder.unlink(self._name)
            self._replaced(f"was {size:,} bytes, {self._total:,} expected (truncated or damaged)" if size < self._total
                           else f"says it holds {head.nbytes:,} bytes of rows, {nbytes:,} expected (damaged)")
            os.close(fd)
            return None
        return fd

    # ------------------------------------------------------------------------- page checks
    def _rebuild_pages(self, fd: int, address: int, pages: np.ndarray, buf: np.ndarray) -> bool:
        """Lay the rows of data pages ``pages`` (int64 ``[m]``, ascending) out in ``buf`` as the
        table file holds them (``[m, page_bytes]``, zero padded); False when the segment ended early."""
        rb, rpp, page = self._rb, self._rpp, self._page
        first = pages * rpp
        lengths = np.minimum(rpp, self.layout.num_rows - first) * rb  # a last page holds fewer rows
        ok = guarded_copy(address, self._total, fd, DATA_OFFSET + first * rb, lengths, buf,
                          np.arange(len(pages), dtype=np.int64) * page)
        held = buf[: len(pages) * page].reshape(len(pages), page)
        if page > rpp * rb:
            held[:, rpp * rb:] = 0
        if lengths[-1] < rpp * rb:
            held[-1, int(lengths[-1]):] = 0
        return ok

    def _check_attach(self, fd: int, mm: mmap.mmap) -> str | None:
        """The seal and a sample of pages, or every page on a few threads (asked for, or the seal
        does not hold), against the table's page checksums; what differs, or None."""
        layout = self.layout
        n = layout.num_pages
        self._bad_page = n  # none found (yet)
        why = "asked for" if self.verify_attach == "full" else seal_problem(fd, os.fstat(fd))
        self.attach_check = "sample" if why is None else f"full: {why}"
        step = max(1, CHECK_CHUNK_BYTES // layout.page_bytes)
        if why is None and int(self.verify_attach) < n:  # one page at random in each of k equal stretches
            edges = np.linspace(0, n, int(self.verify_attach) + 1).astype(np.int64)
            sample = edges[:-1] + (np.random.default_rng().random(len(edges) - 1) * np.diff(edges)).astype(np.int64)
            chunks = (sample[i: i + step] for i in range(0, len(sample), step))
        else:
            chunks = (np.arange(first, min(first + step, n), dtype=np.int64) for first in range(0, n, step))
        address = _address_of(mm)

        def check(pages: np.ndarray) -> str | int:
            buf = self._staging.get(len(pages) * layout.page_bytes)
            if not self._rebuild_pages(fd, address, pages, buf):
                return f"ended early ({os.fstat(fd).st_size:,} bytes; SIGBUS caught)"
            bad = bad_pages(self.header, pages, buf[: len(pages) * layout.page_bytes])
            if bad.size:
                page = self._bad_page = int(pages[bad[0]])
                rows = layout.page_rows(page)
                return f"differs from the table at data page {page} (rows {rows[0]:,}..{rows[1]:,})"
            return len(pages)

        with contextlib.ExitStack() as stack:  # a sample here (a thread's start costs more), every page on a few
            run = map if why is None else stack.enter_context(
                ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="engram-shm-check")).map
            for got in run(check, chunks):  # what differs, or the pages checked
                if isinstance(got, str):
                    return got
                self.attach_pages_checked += got
        return None

    # ------------------------------------------------------------------------------ reads
    def _changed(self, what: str) -> TierError:
        return TierError(f"the shared segment {self.segment} {what} after {self.header.path} was loaded into it: "
                         "close the store and open the table again (a fresh open replaces a damaged segment)")

    def _damaged(self) -> TierError:
        """The error of a read of a segment marked damaged: who found what."""
        head = read_head(self._fd)
        pid, page = (head.pid, head.progress) if head is not None else (0, self.layout.num_pages)
        first, last = self.layout.page_rows(min(page, self.layout.num_pages - 1))
        where = (f"data page {page} (rows {first:,}..{last:,}) differs from {self.header.path}"
                 if page < self.layout.num_pages else "it was changed")
        return TierError(f"the shared segment {self.segment} was found damaged by process {pid}'s check ({where}): "
                         "close the store and open the table again (a fresh open loads a new copy)")

    def _marked(self) -> bool:
        """Whether the segment was marked damaged (``segments.mark_damaged``), from its mapped head."""
        return self._mm is not None and self._mm[STATE_OFFSET] != READY

    def _check_unchanged(self) -> None:
        if self._marked():
            raise self._damaged()
        st = os.fstat(self._fd)
        if st.st_size < self._total:
            raise self._changed(f"shrank to {st.st_size:,} bytes ({self._total:,} expected)")
        if st.st_mtime_ns != self._mtime_ns:
            raise self._changed("was modified (its mtime changed)")

    def _check_pages(self, pages: np.ndarray) -> np.ndarray:
        """Data pages ``pages`` (int64 ``[m]``, ascending) rebuilt from the segment and checked
        against their checksums: the buffer holding them; ``ChecksumError`` for one that differs."""
        buf = self._staging.get(len(pages) * self._page)
        if not self._rebuild_pages(self._fd, self._address, pages, buf):
            raise self._shrank()
        self._count(pages_checked=len(pages))
        bad = bad_pages(self.header, pages, buf[: len(pages) * self._page])
        if bad.size:
            page = int(pages[bad[0]])
            first, last = self.layout.page_rows(page)
            raise ChecksumError(
                f"the shared segment {self.segment} differs from {self.header.path} at data page {page} "
                f"(rows {first:,}..{last:,}): it was changed after it was loaded; close the store and open "
                "the table again (a fresh open replaces a damaged segment)")
        return buf

    def _shrank(self) -> TierError:
        return self._changed("shrank during a read (SIGBUS caught)" if guarded_copy_available()
                             else "ended early during a read")

    def _spans(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(row lengths, destination offsets): int64 ``[n]`` each, for copying ``n`` dense rows."""
        lengths, dests = self._row_spans
        if len(lengths) < n:
            size = max(n, 2 * len(lengths))
            lengths, dests = np.full(size, self._rb, np.int64), np.arange(size, dtype=np.int64) * self._rb
            self._row_spans = lengths, dests  # replaced whole: other threads keep the one they read
        return lengths[:n], dests[:n]

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        self._check_unchanged()
        rb, n = self._rb, len(ids)
        if self.verify_reads:
            plan = plan_pages(self.layout.row_offsets(ids), self.layout)
            gather_at(torch.from_numpy(self._check_pages(plan.pages)), plan.positions, out)
            self._count(bytes_read=n * rb)
            return
        if self.sample_pages:  # the pages of a few rows picked at random
            pages = ids[[random.randrange(n) for _ in range(min(self.sample_pages, n))]] // self._rpp
            self._check_pages(pages if len(pages) == 1 else np.unique(pages))
        dest = out.numpy() if out.is_contiguous() else np.empty(tuple(out.shape), np.uint8)  # [n, rb]
        lengths, dests = self._spans(n)
        if not guarded_copy(self._address, self._total, self._fd, DATA_OFFSET + ids * rb, lengths, dest, dests):
            raise self._shrank()
        if not out.is_contiguous():
            out.copy_(torch.from_numpy(dest))
        self._count(bytes_read=n * rb)

    def stats(self) -> dict:
        return {**super().stats(), "segment": str(self.segment), "loaded_here": self.loaded,
                "segment_bytes": self._total, "replaced": self.replaced, "sample_pages": self.sample_pages,
                "verify_reads": self.verify_reads, "verify_attach": self.verify_attach,
                "attach_check": self.attach_check, "attach_pages_checked": self.attach_pages_checked,
                "attach_check_seconds": self.attach_check_seconds,
                **(self.scrubber.stats() if self.scrubber is not None else {})}

    def _release(self) -> None:
        if self.scrubber is not None:
            self.scrubber.stop()
        super()._release()  # the rows and the mapping
        os.close(self._fd)  # drops this process's shared flock: the segment may now be cleaned
        self._folder.close()


def remove_segment(header: TableHeader, *, segment: str | None = None,
                   shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
                   lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> bool:
    """Remove a table's segment and its lock file from this uid's folder (processes still
    attached keep their mapping until they close). Returns whether a segment was there."""
    directory = _check_options(segment, shm_dir, lock_timeout, 0)
    if not uid_folder(directory).exists():
        return False
    folder = SegmentFolder(directory, create=False)
    name = segment or segment_name(header)
    try:
        with election(folder, name, lock_timeout):
            fd = folder.open(name, os.O_RDONLY)
            if fd is None:
                folder.unlink(name + LOCK_SUFFIX)
                return False
            os.close(fd)
            remove_files(folder, name)
    finally:
        folder.close()
    return True


def process_pss(pid: int | None = None, mapping: str | os.PathLike[str] | None = None) -> int:
    """Proportional set size in bytes of process ``pid`` (default: this one): the whole
    process (``/proc/<pid>/smaps_rollup``), or only its mappings of the file ``mapping``
    (``/proc/<pid>/smaps``). Summed over processes, PSS counts a shared page once."""
    proc = f"/proc/{pid or os.getpid()}"
    if mapping is None:
        with open(f"{proc}/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    target, total, inside = str(mapping), 0, False
    with open(f"{proc}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line: range perms offset dev inode [path]
                inside = len(fields) >= 6 and fields[5] == target
            elif inside and fields[0] == "Pss:":
                total += int(fields[1]) * 1024
    return total
