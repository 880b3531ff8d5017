"""``shared`` tier: one copy of a table's rows per machine (and uid), in a shared-memory segment.

The first process to open a table loads its rows once into a segment; every later process
of the same uid, of any rank, maps the same pages read-only. N processes hold about one
table of DRAM, not N. The segment outlives its processes (the next start attaches without
loading); ``remove_segment`` removes it.

Who may touch a segment (docs/threat-model.md): only the operator's uid (and root). Segments
live in ``<shm_dir>/engram-uid-<uid>/`` (default ``/dev/shm/engram-uid-<uid>/engram-<fingerprint>``),
a folder created mode 0700 and checked on every open (a real folder, not a symbolic link, owned
by this uid, closed to others), so no other local user can create, swap or read a segment or
lock in it; a folder of that name made by someone else is refused, naming its owner. Every
file in it is opened relative to the folder's descriptor with ``O_NOFOLLOW`` and must be a
regular file of this uid closed to others: a segment is created with ``O_EXCL``, mode 0600,
and made read-only (0400) once loaded. Another uid gets a folder and a copy of its own.

A segment is::

    page 0   magic b"ENGRAMSH", u32 version, u32 state (0 loading, 1 ready), u64 table
             fingerprint, u64 data bytes, u32 loader pid, u32 path length, u64 progress
             (bytes allocated, then loaded), the table's real path
    data     dense rows ``uint8 [num_rows, row_bytes]`` from byte 4096

Loading: the loader is elected under an exclusive ``flock`` on ``<segment>.lock`` and holds
it until the ready flag is written (last, after every row, each page checked against the
table's checksums as it is read); the kernel drops the lock when a process dies, so a
process that takes the lock and finds a segment still marked loading removes and reloads
it. A waiter gives up with a ``TierError`` naming the lock and the loader after
``lock_timeout`` seconds in which the loader made no progress.

Attaching: the head (fingerprint, size) is checked under the lock, then, without it, every
page of the segment is compared with the table's page checksums (a version-1 table: its
block checksums), on a few threads. A segment that fails (changed, truncated) is replaced by
a fresh load, with a ``RuntimeWarning`` saying why; processes still attached to the damaged
one keep their mapping. A ready segment of another table (a reused ``segment=`` name) is
refused.

Reading: every copy out of the mapping is SIGBUS-guarded (``tiers/guarded.py``): a segment
truncated under an attached process gives a ``TierError``. Before each read an ``fstat``
checks the size and the modification time. Each read also checks the page of one of its rows
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
import errno
import fcntl
import mmap
import os
import random
import re
import stat
import struct
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from ..errors import ChecksumError, TierError
from ..table.format import TableHeader
from ..table.verify import bad_pages
from ._buffers import ThreadBuffers, gather_at
from .base import Tier
from .guarded import guarded_copy, guarded_copy_available
from .memory import MemoryTier, check_free_memory, load_rows_into
from .pagecheck import plan_pages

__all__ = ["SharedTier", "DEFAULT_SHM_DIR", "DEFAULT_LOCK_TIMEOUT", "process_pss", "remove_segment",
           "segment_name", "uid_folder"]

DEFAULT_SHM_DIR = "/dev/shm"
DEFAULT_LOCK_TIMEOUT = 60.0  # seconds a waiter allows the lock's holder without progress
MAGIC = b"ENGRAMSH"
VERSION = 2
LOADING, READY = 0, 1
# magic, version, state, fingerprint, data bytes, loader pid, path length, progress
HEAD = struct.Struct("<8sIIQQIIQ")
STATE_OFFSET = 12  # the u32 state inside HEAD
PROGRESS_OFFSET = 40  # the u64 progress inside HEAD
DATA_OFFSET = 4096
MAX_PATH = DATA_OFFSET - HEAD.size
LOCK_SUFFIX = ".lock"
LEGACY_NAME = re.compile(r"engram-[0-9a-f]{16}")  # where releases before the per-uid folder kept segments
MAX_NAME_BYTES = 200
ALLOCATE_STEP = 1 << 30  # posix_fallocate in steps, the progress updated after each
CHECK_CHUNK_BYTES = 4 << 20  # pages rebuilt and checked at a time while attaching
CHECK_THREADS = max(1, min(4, os.cpu_count() or 1))
REPLACE_ATTEMPTS = 3  # loads of a segment found damaged each time, then an error
LOCK_ATTEMPTS = 100  # lock files found replaced after taking them, then an error
POLL_MAX_SECONDS = 0.05
READ_ONLY, NO_FOLLOW = os.O_RDONLY | os.O_CLOEXEC, os.O_NOFOLLOW | os.O_NONBLOCK


def segment_name(header: TableHeader) -> str:
    """The default segment name of a table: ``engram-<fingerprint in hex>``."""
    return f"engram-{header.fingerprint():016x}"


def uid_folder(shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> Path:
    """The folder in ``shm_dir`` that holds this process's uid's segments."""
    return Path(shm_dir) / f"engram-uid-{os.geteuid()}"


def _address_of(mm: mmap.mmap) -> int:
    """The address a mapping starts at (read-only ones too)."""
    return int(np.frombuffer(mm, np.uint8, count=1).ctypes.data)


def _data_bytes(header: TableHeader) -> int:
    return header.layout.num_rows * header.layout.row_bytes


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


class SegmentHead(NamedTuple):
    """A segment's head (its page 0), as read back."""

    state: int
    fingerprint: int
    nbytes: int
    pid: int
    progress: int
    source: str


def _read_head(fd: int) -> SegmentHead | None:
    """The head of the segment open as ``fd``; None for a file too short for one or of
    another magic or version (a loader died before writing it, or an older release's)."""
    raw = os.pread(fd, DATA_OFFSET, 0)
    if len(raw) < HEAD.size:
        return None
    magic, version, state, fingerprint, nbytes, pid, plen, progress = HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        return None
    source = raw[HEAD.size: HEAD.size + min(plen, MAX_PATH)].decode("utf-8", "replace")
    return SegmentHead(state, fingerprint, nbytes, pid, progress, source)


def _check_options(segment: object, shm_dir: object, lock_timeout: object, sample_pages: object) -> Path:
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
    return Path(folder)


def _owner_problem(st: os.stat_result) -> str | None:
    """What is wrong with a file or folder of the segment folder's, from its ``lstat``/``fstat``."""
    me = os.geteuid()
    if st.st_uid != me:
        return (f"belongs to uid {st.st_uid}, not to this process's uid {me} (a shared copy is only used "
                "by the uid that made it)")
    if st.st_mode & 0o077:
        return f"is mode {stat.S_IMODE(st.st_mode):04o}: other users may reach it"
    return None


class _Folder:
    """This uid's segment folder: one descriptor, every file opened relative to it, never
    through a symbolic link, each checked to be a regular file of this uid closed to others."""

    def __init__(self, shm_dir: Path, create: bool = True) -> None:
        self.path = uid_folder(shm_dir)
        try:
            parent = os.open(shm_dir, READ_ONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            raise TierError(f"the shared tier keeps its segments in {shm_dir}, which is not a folder: pass "
                            f"shm_dir= a tmpfs folder (default {DEFAULT_SHM_DIR})") from None
        except PermissionError:
            raise TierError(f"this uid ({os.geteuid()}) may not enter {shm_dir}: pass shm_dir= a tmpfs folder "
                            "it may write") from None
        try:
            self.fd = self._open(parent, create)
        finally:
            os.close(parent)

    def _open(self, parent: int, create: bool) -> int:
        name = self.path.name
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:
                pass
            except PermissionError:
                raise TierError(f"cannot create {self.path}: uid {os.geteuid()} may not write to "
                                f"{self.path.parent}; pass shm_dir= a tmpfs folder it may write") from None
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            raise TierError(f"{self.path} does not exist") from None
        self._check(st)
        fd = os.open(name, READ_ONLY | os.O_DIRECTORY | NO_FOLLOW, dir_fd=parent)
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise TierError(f"{self.path} was replaced while it was opened: another process is "
                                "changing it; find out which, then open the table again")
            self._check(now)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check(self, st: os.stat_result) -> None:
        if not stat.S_ISDIR(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
            raise TierError(f"{self.path} is {kind}, not the folder the shared tier makes for uid {os.geteuid()} "
                            "(someone else put it there): remove it, or pass shm_dir= another tmpfs folder")
        problem = _owner_problem(st)
        if problem is not None:
            raise TierError(f"the shared tier's folder {self.path} {problem}: the segments in it cannot be "
                            f"trusted; remove it (rm -r, as root if needed), or pass shm_dir= another tmpfs folder")

    def open(self, name: str, flags: int, mode: int = 0o600) -> int | None:
        """``name`` opened with ``flags`` (plus no-follow), checked; None when absent."""
        try:
            fd = os.open(name, flags | os.O_CLOEXEC | NO_FOLLOW, mode, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise TierError(f"{self.path / name} is a symbolic link: the shared tier follows none; "
                                "remove it") from None
            raise TierError(f"cannot open {self.path / name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            problem = "is not a regular file" if not stat.S_ISREG(st.st_mode) else _owner_problem(st)
            if problem is not None:
                raise TierError(f"{self.path / name} {problem}: it cannot be trusted; remove it")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def holds(self, name: str, fd: int) -> bool:
        """Whether ``name`` is still the file open as ``fd``."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        now = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def segments(self) -> list[str]:
        return sorted(n for n in os.listdir(self.fd) if not n.endswith(LOCK_SUFFIX) and not n.startswith("."))

    def close(self) -> None:
        os.close(self.fd)


def _peek(folder: _Folder, name: str) -> SegmentHead | None:
    """The head of segment ``name`` (None when absent or unreadable); for progress and listings."""
    try:
        fd = folder.open(name, os.O_RDONLY)
    except TierError:
        return None
    if fd is None:
        return None
    try:
        return _read_head(fd)
    finally:
        os.close(fd)


def _wait_flock(fd: int, timeout: float, progress: Callable[[], object], stuck: Callable[[float], str]) -> None:
    """An exclusive ``flock`` on ``fd``; ``TierError(stuck(seconds))`` once the holder has made
    no progress (``progress()`` unchanged) for ``timeout`` seconds."""
    delay, last, since = 0.001, None, 0.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = progress()
        if since == 0.0 or now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= timeout:
            raise TierError(stuck(time.monotonic() - since))
        time.sleep(delay)
        delay = min(2 * delay, POLL_MAX_SECONDS)


@contextlib.contextmanager
def _election(folder: _Folder, name: str, timeout: float) -> Iterator[None]:
    """Hold segment ``name``'s lock file (exclusive ``flock``, dropped by the kernel if this
    process dies); a lock file removed while we waited is left for the one now at its name."""
    lock = name + LOCK_SUFFIX

    def progress() -> object:
        head = _peek(folder, name)
        return None if head is None else (head.state, head.progress)

    def stuck(seconds: float) -> str:
        head = _peek(folder, name)
        holder = (f"the loader of {name} (pid {head.pid}, its progress stopped at {head.progress:,} bytes "
                  "allocated and loaded)" if head is not None and head.state == LOADING
                  else "another process of this uid")
        return (f"waited {seconds:.0f} s for the lock {folder.path / lock}, held by {holder}, with no progress: "
                "that process is stopped or stuck; end it, or pass lock_timeout= (seconds without progress) "
                "to wait longer")

    for _ in range(LOCK_ATTEMPTS):
        fd = folder.open(lock, os.O_RDWR | os.O_CREAT)
        assert fd is not None  # O_CREAT
        try:
            _wait_flock(fd, timeout, progress, stuck)
            if folder.holds(lock, fd):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed (by remove_segment or a cleaner) while we waited: lock the new one
    else:
        raise TierError(f"the lock {folder.path / lock} was replaced each of the {LOCK_ATTEMPTS} times it was "
                        "taken: another process of this uid keeps removing it; find it (fuser -v), then retry")
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _claim_unused(folder: _Folder, name: str) -> Iterator[int | None]:
    """Segment ``name`` open and held exclusively (its lock and the segment itself), or None
    when a process loads, attaches or uses it (or it is gone), without waiting."""
    lock = folder.open(name + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT)
    assert lock is not None
    seg = None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seg = folder.open(name, os.O_RDONLY)
            if seg is not None:
                fcntl.flock(seg, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield seg if folder.holds(name + LOCK_SUFFIX, lock) else None
    finally:
        if seg is not None:
            os.close(seg)
        os.close(lock)


def _remove(folder: _Folder, name: str) -> None:
    """Remove segment ``name`` and its lock file (the caller holds the lock)."""
    folder.unlink(name)
    folder.unlink(name + LOCK_SUFFIX)


def _remove_old_versions(folder: _Folder, source: str, fingerprint: int, keep: str) -> list[str]:
    """Remove the segments of other versions of table ``source`` that no process holds."""
    removed = []
    for name in folder.segments():
        head = _peek(folder, name)
        if name == keep or head is None or head.source != source or head.fingerprint == fingerprint:
            continue
        with _claim_unused(folder, name) as seg:
            if seg is not None:
                _remove(folder, name)
                removed.append(name)
    return removed


def _listing(folder: _Folder, skip: str) -> str:
    """The other segments in ``folder``, for a message: name, size, table, whether in use."""
    entries = []
    for name in folder.segments():
        head = _peek(folder, name)
        if name == skip or head is None:
            continue
        with _claim_unused(folder, name) as seg:
            use = "in use" if seg is None else "unused"
        entries.append(f"{name} ({_gib(DATA_OFFSET + head.nbytes)}, {head.source}, {use})")
    message = (f"this uid's other segments there: {'; '.join(entries)} (remove unused ones with "
               "engram_offload.tiers.shared.remove_segment, or rm; those in use go when their processes exit)"
               if entries else "no other segments of this uid are there")
    legacy = _legacy_segments(folder.path.parent)
    if legacy:
        message += (f"; segments an earlier release left in {folder.path.parent}, unused by this one: "
                    f"{'; '.join(legacy)} (rm them once no process of that release runs)")
    return message


def _legacy_segments(shm_dir: Path) -> list[str]:
    """This uid's segments an earlier release kept directly in ``shm_dir`` (``engram-<16 hex>``)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(shm_dir):
            if LEGACY_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                if st.st_uid == os.geteuid():
                    found.append(f"{entry.name} ({_gib(st.st_size)})")
    return sorted(found)


def _check_space(header: TableHeader, folder: _Folder, name: str, check_memory: bool) -> None:
    if not check_memory:
        return
    check_free_memory(header, "shared")
    vfs = os.statvfs(folder.fd)
    free, need = vfs.f_bavail * vfs.f_frsize, DATA_OFFSET + _data_bytes(header)
    if need > free:
        raise TierError(
            f"{header.path}: the shared tier needs {_gib(need)} in {folder.path} and {_gib(free)} is free "
            f"there; {_listing(folder, name)}; or enlarge it (mount -o remount,size=...), or use the mmap or "
            "direct tier"
        )


def _load(header: TableHeader, folder: _Folder, name: str, source: bytes, progress: bool | None) -> None:
    """Create segment ``name`` (``O_EXCL``, 0600), write its head (loading), the rows (each
    page checked), the ready flag, and make it read-only (0400)."""
    nbytes = _data_bytes(header)
    total = DATA_OFFSET + nbytes
    fd = folder.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    assert fd is not None

    def advance(done: int) -> None:
        os.pwrite(fd, struct.pack("<Q", done), PROGRESS_OFFSET)

    try:
        os.pwrite(fd, HEAD.pack(MAGIC, VERSION, LOADING, header.fingerprint(), nbytes, os.getpid(), len(source), 0)
                  + source, 0)
        for start in range(0, total, ALLOCATE_STEP):
            try:
                os.posix_fallocate(fd, start, min(ALLOCATE_STEP, total - start))  # ENOSPC now, not SIGBUS later
            except OSError as exc:
                raise TierError(f"cannot create the shared segment {folder.path / name} ({total:,} bytes): "
                                f"{exc.strerror}; {_listing(folder, name)}") from exc
            advance(min(total, start + ALLOCATE_STEP))
        mm = mmap.mmap(fd, total)
        dense = None
        try:
            dense = np.frombuffer(mm, np.uint8, count=nbytes, offset=DATA_OFFSET)
            load_rows_into(header, dense.reshape(header.layout.num_rows, header.layout.row_bytes), True, progress,
                           what="sharing", on_chunk=lambda done: advance(total + done))
            mm[STATE_OFFSET: STATE_OFFSET + 4] = struct.pack("<I", READY)  # last: the rows are all there
        finally:
            dense = None  # the mapping's last export here
            try:
                mm.close()
            except BufferError:  # a failed load's traceback still holds a view: the GC unmaps it
                pass
        os.fchmod(fd, 0o400)  # nothing writes it again; a truncate needs write access
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
    default 1, 0 for none), ``verify_reads`` (check every page a read touches), ``progress``,
    ``check_memory`` (refuse to load more than is free; False to insist). ``loaded`` says
    whether this process loaded the segment (else it attached); ``replaced`` why it replaced a
    damaged one (or None).
    """

    name = "shared"

    def __init__(self, header: TableHeader, *, segment: str | None = None,
                 shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR, lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
                 sample_pages: int = 1, verify_reads: bool = False, progress: bool | None = None,
                 check_memory: bool = True) -> None:
        Tier.__init__(self, header)  # not MemoryTier's: the rows come from the segment, not a private load
        started = time.perf_counter()
        directory = _check_options(segment, shm_dir, lock_timeout, sample_pages)
        self.fingerprint = header.fingerprint()
        self.verify_reads = bool(verify_reads)
        self.sample_pages = sample_pages if header.page_sums is not None else 0
        self.huge_pages = False  # tmpfs pages
        self.loaded = False
        self.replaced: str | None = None
        self.attach_check_seconds = 0.0
        self._name = segment or segment_name(header)
        self._total = DATA_OFFSET + _data_bytes(header)
        self._staging = ThreadBuffers()
        self._rb, self._rpp, self._page = header.layout.row_bytes, header.layout.rows_per_page, header.layout.page_bytes
        self._row_spans = np.empty(0, np.int64), np.empty(0, np.int64)
        self._folder = _Folder(directory)
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
        self.verified_on_load = True  # loaded with every page checked, or attached and checked
        self.load_seconds = time.perf_counter() - started  # loading the segment, or attaching to it

    # ----------------------------------------------------------------------------- attach
    def _attach(self, header: TableHeader, lock_timeout: float, progress: bool | None,
                check_memory: bool) -> tuple[int, mmap.mmap]:
        """Load or attach, check, and replace a damaged segment; the segment's descriptor
        (holding a shared ``flock`` while this tier is open) and its read-only mapping."""
        for _ in range(REPLACE_ATTEMPTS):
            with _election(self._folder, self._name, lock_timeout):
                fd = self._open_or_load(header, progress, check_memory)
            try:
                mm = mmap.mmap(fd, self._total, prot=mmap.PROT_READ)
                self._mtime_ns = os.fstat(fd).st_mtime_ns
                if self.loaded:
                    return fd, mm
                checked = time.perf_counter()
                problem = self._check_all_pages(fd, mm)
                if problem is None and os.fstat(fd).st_mtime_ns != self._mtime_ns:
                    problem = "was modified while it was checked"
                self.attach_check_seconds += time.perf_counter() - checked
                if problem is None:
                    return fd, mm
                with _election(self._folder, self._name, lock_timeout):
                    if self._folder.holds(self._name, fd):  # not already replaced by another process
                        self._folder.unlink(self._name)
                        self._replaced(problem)
                with contextlib.suppress(BufferError):
                    mm.close()
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise TierError(f"the shared segment {self.segment} was damaged again each of {REPLACE_ATTEMPTS} times it "
                        "was loaded: something of this uid (or root) writes to it; find it (fuser -v), then open "
                        "the table again")

    def _replaced(self, problem: str) -> None:
        self.replaced = problem
        warnings.warn(f"the shared segment {self.segment} {problem}: replaced by a fresh load of "
                      f"{self.header.path} (processes still attached to the old one keep it)",
                      RuntimeWarning, stacklevel=4)

    def _open_or_load(self, header: TableHeader, progress: bool | None, check_memory: bool) -> int:
        """Under the election: the segment's descriptor, shared-locked; loaded here when
        absent, half-loaded, truncated or an unused older version of this table."""
        folder, name = self._folder, self._name
        source = str(header.path.resolve()).encode()[:MAX_PATH]
        found, fd = folder.open(name, os.O_RDONLY), None
        if found is not None:
            try:
                fd = self._usable(found, source.decode("utf-8", "replace"))  # closes it when it returns None
            except BaseException:
                os.close(found)
                raise
        if fd is None:
            _remove_old_versions(folder, source.decode("utf-8", "replace"), self.fingerprint, keep=name)
            _check_space(header, folder, name, check_memory)
            _load(header, folder, name, source, progress)
            self.loaded = True
            fd = folder.open(name, os.O_RDONLY)
            if fd is None:
                raise TierError(f"the shared segment {self.segment} vanished right after it was loaded: another "
                                "process of this uid removes segments; open the table again")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # this process uses it (see _claim_unused)
        except BlockingIOError:
            os.close(fd)
            raise TierError(f"the shared segment {self.segment} is locked by a process removing it: "
                            "open the table again") from None
        return fd

    def _usable(self, fd: int, source: str) -> int | None:
        """``fd`` when its ready segment holds this table with the right size; None (after
        removing it) for one a dead loader left, a truncated one, or an unused older version."""
        head, size = _read_head(fd), os.fstat(fd).st_size
        if head is None or head.state != READY:  # its loader died: the lock was free
            self._folder.unlink(self._name)
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
        if head.nbytes != _data_bytes(self.header) or size < self._total:
            self._folder.unlink(self._name)
            self._replaced(f"was {size:,} bytes, {self._total:,} expected (truncated or damaged)")
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

    def _check_all_pages(self, fd: int, mm: mmap.mmap) -> str | None:
        """Every page of the segment against the table's page checksums (version 1: its
        block checksums), on a few threads; what differs, or None."""
        layout = self.layout
        address = _address_of(mm)
        by_blocks = self.header.page_sums is None
        step = layout.block_size // layout.page_bytes if by_blocks else max(1, CHECK_CHUNK_BYTES // layout.page_bytes)

        def check(first: int) -> str | None:
            pages = np.arange(first, min(first + step, layout.num_pages), dtype=np.int64)
            buf = self._staging.get(len(pages) * layout.page_bytes)
            if not self._rebuild_pages(fd, address, pages, buf):
                return f"ended early ({os.fstat(fd).st_size:,} bytes; SIGBUS caught)"
            data = buf[: len(pages) * layout.page_bytes]
            if by_blocks:
                block = first // step
                if xxhash.xxh3_64_intdigest(data.data) != int(self.header.block_digests[block]):
                    return f"differs from the table in block {block}"
                return None
            bad = bad_pages(self.header, pages, data)
            if bad.size:
                page = int(pages[bad[0]])
                rows = layout.page_rows(page)
                return f"differs from the table at data page {page} (rows {rows[0]:,}..{rows[1]:,})"
            return None

        with ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="engram-shm-check") as pool:
            return next((p for p in pool.map(check, range(0, layout.num_pages, step)) if p is not None), None)

    # ------------------------------------------------------------------------------ reads
    def _changed(self, what: str) -> TierError:
        return TierError(f"the shared segment {self.segment} {what} after {self.header.path} was loaded into it: "
                         "close the store and open the table again (a fresh open replaces a damaged segment)")

    def _check_unchanged(self) -> None:
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
        if self.verify_reads and self.header.page_sums is not None:
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
                "verify_reads": self.verify_reads, "attach_check_seconds": self.attach_check_seconds}

    def _release(self) -> None:
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
    folder = _Folder(directory, create=False)
    name = segment or segment_name(header)
    try:
        with _election(folder, name, lock_timeout):
            fd = folder.open(name, os.O_RDONLY)
            if fd is None:
                folder.unlink(name + LOCK_SUFFIX)
                return False
            os.close(fd)
            _remove(folder, name)
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
