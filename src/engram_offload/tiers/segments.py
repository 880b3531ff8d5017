"""This uid's folder of shared-memory segments (the ``shared`` tier's), and what is done in it.

``SegmentFolder`` opens ``<shm_dir>/engram-uid-<uid>/`` (creating it mode 0700) and checks it:
a real folder, never a symbolic link, owned by this uid, closed to others. Every file in it is
opened relative to the folder's descriptor with ``O_NOFOLLOW`` and checked to be a regular
file of this uid closed to others (docs/threat-model.md).

In it: segments (a head, ``SegmentHead``, then the rows; ``tiers/shared.py``) and, beside each,
``<segment>.lock``. ``election`` holds a segment's lock (an exclusive ``flock``), waiting at
most ``timeout`` seconds in which its holder made no progress; ``claim_unused`` takes a
segment nobody loads, attaches or uses (each attached process holds a shared ``flock`` on
it), without waiting; ``remove_old_versions`` and ``listing`` are built on it.

The seal: once a segment is loaded (every page checked), ``seal`` writes into its head the
identity of its file (owner uid, ``st_dev``, ``st_ino``, ``st_ctime_ns``) and a digest over
those and the rest of the head (table fingerprint, size, path). ``seal_problem`` tells a later
process whether the file it opened is the one sealed, unchanged since: a copy, a file made
again or renamed, and any write, truncation, ``chmod`` or ``utime`` (each sets the ctime, which
only root, through the clock, can set back) break the seal. It is a check, not a signature: only this uid and
root can reach the folder, and they are trusted.

A segment found to differ from its table after it was sealed is marked damaged (``mark_damaged``:
its state, the page and the finder's pid in its head), which every attached process sees before
its next read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from ..errors import TierError
from ..units import format_bytes

__all__ = ["DEFAULT_SHM_DIR", "SegmentFolder", "SegmentHead", "HEAD", "MAGIC", "VERSION", "LOADING", "READY", "DAMAGED",
           "STATE_OFFSET",
           "PROGRESS_OFFSET", "DATA_OFFSET", "MAX_PATH", "LOCK_SUFFIX", "uid_folder", "read_head", "peek_head",
           "format_version", "seal", "seal_problem", "mark_damaged", "election", "claim_unused", "remove_files",
           "remove_old_versions", "listing"]

DEFAULT_SHM_DIR = "/dev/shm"
MAGIC = b"ENGRAMSH"
VERSION = 3
LOADING, READY, DAMAGED = 0, 1, 2
# the seal: owner uid, st_dev, st_ino, st_ctime_ns (the file's identity), digest
IDENTITY = struct.Struct("<I4xQQq")
SEAL = struct.Struct(IDENTITY.format + "16s")
# magic, version, state, fingerprint, data bytes, loader pid, path length, progress, the seal
HEAD = struct.Struct("<8sIIQQIIQ" + SEAL.format[1:])
STATE_OFFSET = 12  # the u32 state inside HEAD
PID_OFFSET = 32  # the u32 loader pid inside HEAD (the checker's, once damaged)
PROGRESS_OFFSET = 40  # the u64 progress inside HEAD
SEAL_OFFSET = 48  # the seal inside HEAD
SEAL_ATTEMPTS = 5  # seals written while the file's ctime kept moving, then it is left unsealed
DATA_OFFSET = 4096
MAX_PATH = DATA_OFFSET - HEAD.size
LOCK_SUFFIX = ".lock"
LOCK_ATTEMPTS = 100  # lock files found replaced after taking them, then an error
POLL_MAX_SECONDS = 0.05
READ_ONLY, NO_FOLLOW = os.O_RDONLY | os.O_CLOEXEC, os.O_NOFOLLOW | os.O_NONBLOCK


def uid_folder(shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> Path:
    """The folder in ``shm_dir`` that holds this process's uid's segments."""
    return Path(shm_dir) / f"engram-uid-{os.geteuid()}"


class SegmentHead(NamedTuple):
    """A segment's head (its page 0), as read back."""

    state: int
    fingerprint: int
    nbytes: int
    pid: int
    progress: int
    source: str


def read_head(fd: int) -> SegmentHead | None:
    """The head of the segment open as ``fd``; None for a file too short for one or of
    another magic or version (a loader died before writing it, or an older release's)."""
    raw = os.pread(fd, DATA_OFFSET, 0)
    if len(raw) < HEAD.size:
        return None
    magic, version, state, fingerprint, nbytes, pid, plen, progress, *_ = HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        return None
    source = raw[HEAD.size: HEAD.size + min(plen, MAX_PATH)].decode("utf-8", "replace")
    return SegmentHead(state, fingerprint, nbytes, pid, progress, source)


def format_version(fd: int) -> int | None:
    """The format version of the segment open as ``fd``; None for a file of another magic."""
    raw = os.pread(fd, 12, 0)
    return struct.unpack_from("<I", raw, 8)[0] if len(raw) == 12 and raw[:8] == MAGIC else None


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_uid, st.st_dev, st.st_ino, st.st_ctime_ns


def _digest(page: bytes, identity: tuple[int, int, int, int]) -> bytes:
    """The seal's digest: the head page, its seal replaced by ``identity``."""
    return hashlib.blake2b(page[:SEAL_OFFSET] + IDENTITY.pack(*identity) + page[HEAD.size: DATA_OFFSET],
                           digest_size=16).digest()


def seal(fd: int, mm: mmap.mmap) -> None:
    """Seal the segment open as ``fd``, mapped writable as ``mm``, once nothing else will change
    it: its head page already written through ``mm``, so this write faults nothing in and leaves
    the ctime it binds; written again while the ctime moved anyway, then left unsealed."""
    for _ in range(SEAL_ATTEMPTS):
        identity = _identity(os.fstat(fd))
        mm[SEAL_OFFSET: HEAD.size] = SEAL.pack(*identity, _digest(mm[:DATA_OFFSET], identity))
        if _identity(os.fstat(fd)) == identity:
            return


def seal_problem(fd: int, st: os.stat_result) -> str | None:
    """Why the segment open as ``fd`` (``st`` its ``fstat``) is not the file sealed, unchanged
    since; None when the seal holds."""
    page = os.pread(fd, DATA_OFFSET, 0)
    uid, dev, ino, ctime, digest = SEAL.unpack_from(page, SEAL_OFFSET)
    if digest == bytes(16):
        return "is not sealed (its loader did not finish sealing it)"
    if (uid, dev, ino) != _identity(st)[:3]:
        return (f"was sealed as another file (uid {uid}, device {dev}, inode {ino}; this one is uid {st.st_uid}, "
                f"device {st.st_dev}, inode {st.st_ino}): a copy, or made again")
    if ctime != st.st_ctime_ns:
        return "was changed after it was sealed (its ctime moved)"
    if digest != _digest(page, (uid, dev, ino, ctime)):
        return "does not match its seal (its head was changed)"
    return None


def mark_damaged(fd: int, page: int) -> None:
    """Mark the segment open as ``fd`` damaged: this pid, the data page that differs, then the
    state, written into its head (its mtime moves). Made writable for the write (0400 again after);
    reopened through ``/proc/self/fd``, so a segment no longer at its name is marked too."""
    os.fchmod(fd, 0o600)
    try:
        rw = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC)
    finally:
        os.fchmod(fd, 0o400)
    try:
        os.pwrite(rw, struct.pack("<I", os.getpid()), PID_OFFSET)
        os.pwrite(rw, struct.pack("<Q", page), PROGRESS_OFFSET)
        os.pwrite(rw, struct.pack("<I", DAMAGED), STATE_OFFSET)  # last: readers look at the state
    finally:
        os.close(rw)


def _owner_problem(st: os.stat_result) -> str | None:
    """What is wrong with a file or folder of the segment folder's, from its ``lstat``/``fstat``."""
    me = os.geteuid()
    if st.st_uid != me:
        return (f"belongs to uid {st.st_uid}, not to this process's uid {me} (a shared copy is only used "
                "by the uid that made it)")
    if st.st_mode & 0o077:
        return f"is mode {stat.S_IMODE(st.st_mode):04o}: other users may reach it"
    return None


class SegmentFolder:
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
            except OSError as exc:  # /proc, a read-only file system, ...
                raise TierError(f"cannot create {self.path} ({exc.strerror}): {self.path.parent} is not a folder "
                                "segments can be made in; pass shm_dir= a tmpfs folder (default "
                                f"{DEFAULT_SHM_DIR})") from None
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


def peek_head(folder: SegmentFolder, name: str) -> SegmentHead | None:
    """The head of segment ``name`` (None when absent or unreadable); for progress and listings."""
    try:
        fd = folder.open(name, os.O_RDONLY)
    except TierError:
        return None
    if fd is None:
        return None
    try:
        return read_head(fd)
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
def election(folder: SegmentFolder, name: str, timeout: float) -> Iterator[None]:
    """Hold segment ``name``'s lock file (exclusive ``flock``, dropped by the kernel if this
    process dies); a lock file removed while we waited is left for the one now at its name."""
    lock = name + LOCK_SUFFIX

    def progress() -> object:
        head = peek_head(folder, name)
        return None if head is None else (head.state, head.progress)

    def stuck(seconds: float) -> str:
        head = peek_head(folder, name)
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
def claim_unused(folder: SegmentFolder, name: str) -> Iterator[int | None]:
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


def remove_files(folder: SegmentFolder, name: str) -> None:
    """Remove segment ``name`` and its lock file (the caller holds the lock)."""
    folder.unlink(name)
    folder.unlink(name + LOCK_SUFFIX)


def remove_old_versions(folder: SegmentFolder, source: str, fingerprint: int, keep: str) -> list[str]:
    """Remove the segments of other versions of table ``source`` that no process holds."""
    removed = []
    for name in folder.segments():
        head = peek_head(folder, name)
        if name == keep or head is None or head.source != source or head.fingerprint == fingerprint:
            continue
        with claim_unused(folder, name) as seg:
            if seg is not None:
                remove_files(folder, name)
                removed.append(name)
    return removed


def listing(folder: SegmentFolder, skip: str) -> str:
    """The other segments in ``folder``, for a message: name, size, table, whether in use."""
    entries = []
    for name in folder.segments():
        head = peek_head(folder, name)
        if name == skip or head is None:
            continue
        with claim_unused(folder, name) as seg:
            use = "in use" if seg is None else "unused"
        entries.append(f"{name} ({format_bytes(DATA_OFFSET + head.nbytes)}, {head.source}, {use})")
    message = (f"this uid's other segments there: {'; '.join(entries)} (remove unused ones with "
               "engram_offload.tiers.shared.remove_segment, or rm; those in use go when their processes exit)"
               if entries else "no other segments of this uid are there")
    return message
