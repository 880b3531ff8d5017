"""This uid's shared-tier segments as an operator sees them: list them, drop the unused ones.

Built on ``tiers/segments.py`` (the folder ``<shm_dir>/engram-uid-<uid>/``, each file opened
without following links and checked to be this uid's): a segment in use (a process loads,
attaches or reads it: it holds a ``flock``) is never dropped; a lock file whose segment is gone
is dropped when no process holds it. Files an earlier release kept directly in ``shm_dir``
(``engram-<16 hex>`` and its ``.lock``, this uid's) are listed as legacy and dropped when no
process maps the segment (``/proc/*/maps``) or holds the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import TierError
from .segments import (
    DATA_OFFSET,
    DEFAULT_SHM_DIR,
    LOCK_SUFFIX,
    READY,
    SegmentFolder,
    claim_unused,
    peek_head,
    remove_files,
    uid_folder,
)

__all__ = ["SegmentEntry", "drop_segments", "list_segments"]

LEGACY = re.compile(r"engram-[0-9a-f]{16}(\.lock)?")  # an earlier release's files, directly in shm_dir


@dataclass(frozen=True)
class SegmentEntry:
    """One file of this uid's segment folder: a segment (``bytes``, ``state``, the table it
    copies, whether a process uses it) or a lock file left without its segment."""

    name: str
    path: str
    kind: str  # "segment", "lock", "legacy segment" or "legacy lock"
    bytes: int
    state: str  # "ready", "loading", "unreadable" (no head: a dead loader's or an older release's), "orphan lock"
    fingerprint: str | None
    table: str | None
    in_use: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _folder(shm_dir: str | os.PathLike[str]) -> SegmentFolder | None:
    return SegmentFolder(shm_dir, create=False) if uid_folder(shm_dir).exists() else None  # type: ignore[arg-type]


def _lock_in_use(folder: SegmentFolder, lock: str) -> bool:
    """Whether a process holds ``lock`` (a lock file), without waiting."""
    fd = folder.open(lock, os.O_RDONLY)
    return fd is not None and _flocked_elsewhere(fd)


def _flocked_elsewhere(fd: int) -> bool:
    """Whether another open file holds a ``flock`` on ``fd``'s file (tried without waiting);
    closes ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def list_segments(shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> list[SegmentEntry]:
    """Every segment of this uid in ``shm_dir``, every lock file left without its segment, and
    an earlier release's files (``legacy``)."""
    return _current_entries(shm_dir) + _legacy_entries(shm_dir)


def _current_entries(shm_dir: str | os.PathLike[str]) -> list[SegmentEntry]:
    folder = _folder(shm_dir)
    if folder is None:
        return []
    try:
        names = set(folder.segments())
        locks = sorted(n[: -len(LOCK_SUFFIX)] for n in os.listdir(folder.fd) if n.endswith(LOCK_SUFFIX))
        entries = []
        for name in sorted(names):
            head = peek_head(folder, name)
            try:
                size = os.stat(name, dir_fd=folder.fd, follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            with claim_unused(folder, name) as seg:
                in_use = seg is None
            state = "unreadable" if head is None else ("ready" if head.state == READY else "loading")
            entries.append(SegmentEntry(
                name, str(folder.path / name), "segment", size if head is None else DATA_OFFSET + head.nbytes, state,
                None if head is None else f"{head.fingerprint:016x}", None if head is None else head.source, in_use))
        for name in locks:
            if name not in names:
                lock = name + LOCK_SUFFIX
                entries.append(SegmentEntry(lock, str(folder.path / lock), "lock", 0, "orphan lock", None, None,
                                            _lock_in_use(folder, lock)))
        return entries
    finally:
        folder.close()


def drop_segments(names: list[str] | None, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR
                  ) -> tuple[list[str], list[str]]:
    """Remove the named segments (or, with ``names`` None, every unused one, every orphan lock
    file and every unused file of an earlier release) with their lock files; returns (dropped,
    kept because in use). A name that is not there is a ``TierError`` saying how to list them."""
    legacy = {e.name: e for e in _legacy_entries(shm_dir)}
    dropped: list[str] = []
    kept: list[str] = []
    for name in sorted(legacy) if names is None else [n for n in names if n in legacy]:
        (dropped if _drop_legacy(Path(shm_dir), name) else kept).append(name)
    names = None if names is None else [n for n in names if n not in legacy]
    if names == []:
        return dropped, kept
    folder = _folder(shm_dir)
    if folder is None:
        if names:
            raise TierError(f"no segment {names[0]}: {uid_folder(shm_dir)} does not exist (nothing to drop)")
        return dropped, kept
    try:
        present = set(folder.segments())
        orphan_locks = {n[: -len(LOCK_SUFFIX)] for n in os.listdir(folder.fd) if n.endswith(LOCK_SUFFIX)} - present
        wanted = sorted(present | orphan_locks) if names is None else \
            [n[: -len(LOCK_SUFFIX)] if n.endswith(LOCK_SUFFIX) else n for n in names]
        for name in wanted:
            if name not in present and name not in orphan_locks:
                raise TierError(f"no segment {name} in {folder.path}: engram-offload shared list names them")
            done = _drop_segment(folder, name) if name in present else _drop_orphan_lock(folder, name)
            (dropped if done else kept).append(name)
        return dropped, kept
    finally:
        folder.close()


def _drop_segment(folder: SegmentFolder, name: str) -> bool:
    """Remove segment ``name`` and its lock file unless a process uses it; whether removed."""
    with claim_unused(folder, name) as seg:
        if seg is None:
            return False
        remove_files(folder, name)
        return True


def _drop_orphan_lock(folder: SegmentFolder, name: str) -> bool:
    """Remove the lock file of absent segment ``name`` unless a process holds it (a loader
    holds it while it creates the segment); whether removed."""
    lock = name + LOCK_SUFFIX
    fd = folder.open(lock, os.O_RDONLY)
    if fd is None:
        return True  # gone meanwhile
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if name in folder.segments() or not folder.holds(lock, fd):
            return False  # a loader made the segment, or the lock was replaced, since we looked
        folder.unlink(lock)
        return True
    finally:
        os.close(fd)


def _legacy_entries(shm_dir: str | os.PathLike[str]) -> list[SegmentEntry]:
    """This uid's files an earlier release kept directly in ``shm_dir``."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(shm_dir):
            if not LEGACY.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != os.geteuid():
                continue
            lock = entry.name.endswith(LOCK_SUFFIX)
            found.append(SegmentEntry(entry.name, entry.path, "legacy lock" if lock else "legacy segment", st.st_size,
                                      "left by an earlier release", None, None, _legacy_in_use(Path(entry.path))))
    return sorted(found, key=lambda e: e.name)


def _legacy_in_use(path: Path) -> bool:
    """Whether a process holds ``path`` (an ``flock``, the way an earlier release's loader held
    its lock) or maps it (an earlier release's attached processes held no lock)."""
    if _held(path):
        return True
    if path.name.endswith(LOCK_SUFFIX):
        return False
    target = str(path)
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            if target in maps.read_text():
                return True
    return False


def _held(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return True  # not ours to judge: leave it
    return _flocked_elsewhere(fd)


def _drop_legacy(shm_dir: Path, name: str) -> bool:
    """Remove an earlier release's file unless a process holds or maps it; whether removed."""
    path = shm_dir / name
    if _legacy_in_use(path):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return True
