"""A cold start: the table file's own pages out of the page cache; the whole machine's only on request."""

from __future__ import annotations

import os

__all__ = ["DROP_CACHES", "FADVISE", "drop_all_caches", "evict_file_pages", "make_cold"]

DROP_CACHES = "/proc/sys/vm/drop_caches"
FADVISE = "posix_fadvise(DONTNEED)"


def evict_file_pages(path: str | os.PathLike[str]) -> str:
    """Write back and evict ``path``'s pages from the page cache (fsync, then
    ``posix_fadvise(POSIX_FADV_DONTNEED)``); returns the method's name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return FADVISE


def drop_all_caches() -> str | None:
    """Empty the page cache of the whole machine (every process's clean pages) through
    ``/proc/sys/vm/drop_caches``; the method's name, or None when this process may not."""
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("1\n")
    except OSError:
        return None
    return f"{DROP_CACHES}=1"


def make_cold(path: str | os.PathLike[str], *, drop_all: bool = False) -> list[str]:
    """Evict the table file's pages (and with ``drop_all`` the machine's whole page cache,
    where permitted); returns the methods that worked."""
    done = [evict_file_pages(path)]
    if drop_all:
        method = drop_all_caches()
        if method is not None:
            done.append(method)
    return done
