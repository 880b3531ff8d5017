"""This uid's shared-tier segments as an operator sees them: list them, drop the unused ones.

Built on ``tiers/segments.py`` (the folder ``<shm_dir>/engram-uid-<uid>/``, each file opened
without following links and checked to be this uid's): a segment in use (a process loads,
attaches or reads it: it holds a ``flock``) is never dropped; a lock file whose segment is gone
is dropped when no process holds it.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import TierError
from .segments import (
    DAMAGED,
    DATA_OFFSET,
    DEFAULT_SHM_DIR,
    LOADING,
    LOCK_SUFFIX,
    READY,
    SegmentFolder,
    claim_unused,
    peek_head,
    remove_files,
    uid_folder,
)

__all__ = ["SegmentEntry", "drop_segments", "list_segments"]

STATES = {LOADING: "loading", READY: "ready", DAMAGED: "damaged"}


@dataclass(frozen=True)
class SegmentEntry:
    """One file of this uid's segment folder: a segment (``bytes``, ``state``, the table it
    copies, whether a process uses it) or a lock file left without its segment."""

    name: str
    path: str
    kind: str  # "segment" or "lock"
    bytes: int
    state: str  # "ready", "loading", "damaged" (left by a process still attached to it), "unreadable" (no head:
    # a dead loader's or an older release's), "orphan lock"
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
    """Every segment of this uid in ``shm_dir`` and every lock file left without its segment."""
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
            state = "unreadable" if head is None else STATES.get(head.state, "unreadable")
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
    """Remove the named segments (or, with ``names`` None, every unused one and every orphan
    lock file) with their lock files; returns (dropped, kept because in use). A name that is
    not there is a ``TierError`` saying how to list them."""
    dropped: list[str] = []
    kept: list[str] = []
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
