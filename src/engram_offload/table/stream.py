"""Reading files in large chunks on a thread, at the disk's sequential rate.

A ``ChunkReader`` reads chunks, each a list of page-aligned file spans read back to back into
one of a few reused page-aligned buffers (O_DIRECT where the file system takes it:
``open_for_load``), while its caller checks and places the chunk before. A span may run past
the end of its file (a safetensors shard's last page): those bytes read as zeros. Used by the
resident tiers' loads and by a checkpoint's ``index`` and ``verify``.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..errors import TierError

__all__ = ["PAGE", "Span", "ChunkReader", "aligned_empty", "open_for_load", "read_fully"]

PAGE = 4096
BUFFERS = 3  # one being read, one being checked and placed, one spare


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised, page-aligned ``np.uint8 [nbytes]`` (a private anonymous mapping)."""
    mm = mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mm, np.uint8, count=nbytes)


def open_for_load(path: str | os.PathLike[str]) -> int:
    """A descriptor on ``path``: O_DIRECT where the file system takes it (no page-cache copy,
    no cache pollution), else buffered."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    probe = aligned_empty(PAGE)
    try:  # some file systems take O_DIRECT at open and refuse it at read
        os.preadv(fd, [probe], 0)  # type: ignore[list-item]  # NumPy's stubs lack __buffer__
    except OSError as exc:
        os.close(fd)
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return fd


def read_fully(fd: int, view: np.ndarray, offset: int, path: Any, valid: int | None = None) -> None:
    """Fill ``view`` (uint8) with the file's bytes at ``offset``; the file may end after ``valid``
    bytes of it (default: all of them), the rest then reads as zeros. ``TierError`` otherwise."""
    valid = len(view) if valid is None else valid
    done = 0
    while done < len(view):
        try:
            got = os.preadv(fd, [view[done:]], offset + done)  # type: ignore[list-item]  # NumPy's stubs lack __buffer__
        except OSError as exc:
            raise TierError(f"{path}: reading {len(view) - done} bytes at offset {offset + done} while "
                            f"loading failed: {exc.strerror or exc}") from exc
        if got == 0:
            if done >= valid:
                view[done:] = 0
                return
            raise TierError(f"{path} ended early while loading: the file changed under us; "
                            "check it with `engram-offload verify` and reopen it")
        done += got


class Span(NamedTuple):
    """Whole pages of one file: ``nbytes`` at ``offset`` (page aligned), of which the file holds
    ``valid`` (the rest lies past its end)."""

    fd: int
    offset: int
    nbytes: int
    valid: int
    path: Path


class ChunkReader:
    """Reads ``chunks`` (``(tag, spans)``, each chunk's spans back to back) on a thread into a few
    page-aligned buffers of ``buffer_bytes``; iterate for ``(tag, buffer)`` and hand each buffer
    back with ``release``; ``stop`` ends the thread. ``read``: the function reading one span's
    pages (``read_fully``'s signature)."""

    def __init__(self, chunks: Iterable[tuple[Any, list[Span]]], buffer_bytes: int,
                 read: Callable[..., None] = read_fully) -> None:
        self._chunks, self._read = chunks, read
        self._free: queue.Queue = queue.Queue()
        self._full: queue.Queue = queue.Queue()
        for _ in range(BUFFERS):
            self._free.put(aligned_empty(buffer_bytes))
        self._thread = threading.Thread(target=self._run, name="engram-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for tag, spans in self._chunks:
                buf = self._free.get()
                if buf is None:  # the caller stopped
                    return
                at = 0
                for span in spans:
                    view = buf[at: at + span.nbytes]
                    if span.valid == span.nbytes:
                        self._read(span.fd, view, span.offset, span.path)
                    else:
                        self._read(span.fd, view, span.offset, span.path, span.valid)
                    at += span.nbytes
                self._full.put((tag, buf))
            self._full.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._full.put(exc)

    def __iter__(self) -> Iterator[tuple[Any, np.ndarray]]:
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
