"""``shared`` tier: one copy of a table's rows per machine, in a POSIX shared-memory segment.

The first process to open a table loads its rows once into ``<shm_dir>/<segment>`` (by
default ``/dev/shm/engram-<fingerprint>``, the fingerprint hashing the table's header and
checksum trailer, so every copy of the same table shares one segment); every later
process, of any rank, maps the same pages read-only. N processes hold about one table of
DRAM, not N.

A segment is::

    page 0   magic b"ENGRAMSH", u32 version, u32 state (0 loading, 1 ready), u64 table
             fingerprint, u64 data bytes, u32 loader pid, u32 path length, the table's path
    data     dense rows ``uint8 [num_rows, row_bytes]`` from byte 4096

Who loads is decided under ``fcntl.flock`` on ``<segment>.lock``: the loader holds the lock
until the ready flag is written (last, after every row), and the kernel drops the lock
when a process dies. So a process that takes the lock and finds a segment still marked
loading knows its loader died (SIGKILL mid-load) and removes and reloads it. A ready
segment of another table (a reused ``segment=`` name) is refused with a ``TierError``.

The segment outlives the processes (the next start attaches without loading); remove it
with ``remove_segment``. ``rows`` is the host tensor (read-only pages), for the GPU path to
register in place (``cudaHostRegister`` with the read-only flag).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import shutil
import struct
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import TierError
from ..table.format import TableHeader
from .base import Tier
from .memory import MemoryTier, check_free_memory, load_rows_into

__all__ = ["SharedTier", "DEFAULT_SHM_DIR", "process_pss", "remove_segment", "segment_name"]

DEFAULT_SHM_DIR = "/dev/shm"
MAGIC = b"ENGRAMSH"
VERSION = 1
LOADING, READY = 0, 1
HEAD = struct.Struct("<8sIIQQII")  # magic, version, state, fingerprint, data bytes, loader pid, path length
STATE_OFFSET = 12  # the u32 state inside HEAD
DATA_OFFSET = 4096
MAX_PATH = DATA_OFFSET - HEAD.size


def segment_name(header: TableHeader) -> str:
    """The default segment name of a table: ``engram-<fingerprint in hex>``."""
    return f"engram-{header.fingerprint():016x}"


def _data_bytes(header: TableHeader) -> int:
    return header.layout.num_rows * header.layout.row_bytes


@contextlib.contextmanager
def _election(lock_path: Path) -> Iterator[None]:
    """Hold the segment's lock file (``flock``, dropped by the kernel if this process dies)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_head(path: Path) -> tuple[int, int, int, int, str] | None:
    """(state, fingerprint, data bytes, file size, source path) of a segment; None if absent.

    A segment too short for its head, or with a foreign magic, reads as loading: only a
    loader that died before writing its head leaves one.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(DATA_OFFSET)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return None
    if len(raw) < HEAD.size:
        return LOADING, 0, 0, size, "?"
    magic, version, state, fingerprint, nbytes, _, plen = HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        return LOADING, 0, 0, size, "?"
    source = raw[HEAD.size: HEAD.size + min(plen, MAX_PATH)].decode("utf-8", "replace")
    return state, fingerprint, nbytes, size, source


def _check_space(header: TableHeader, shm_dir: Path, check_memory: bool) -> None:
    if not check_memory:
        return
    check_free_memory(header, "shared")
    free = shutil.disk_usage(shm_dir).free
    need = DATA_OFFSET + _data_bytes(header)
    if need > free:
        raise TierError(
            f"{header.path}: the shared tier needs {need / 2**30:,.2f} GiB in {shm_dir} and "
            f"{free / 2**30:,.2f} GiB is free there: enlarge it (mount -o remount,size=...) or use "
            "the mmap or direct tier"
        )


def _load(header: TableHeader, path: Path, fingerprint: int, verify: bool, progress: bool | None) -> None:
    """Create the segment, write its head (loading), the rows, then the ready flag."""
    nbytes = _data_bytes(header)
    source = str(header.path).encode()[:MAX_PATH]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, DATA_OFFSET + nbytes)  # ENOSPC now, not SIGBUS mid-copy
        except OSError as exc:
            raise TierError(f"cannot create the shared segment {path} ({DATA_OFFSET + nbytes:,} bytes): "
                            f"{exc.strerror}; free space in {path.parent} or use another tier") from exc
        mm = mmap.mmap(fd, DATA_OFFSET + nbytes)
        dense = None
        try:
            mm[: HEAD.size + len(source)] = HEAD.pack(MAGIC, VERSION, LOADING, fingerprint, nbytes,
                                                      os.getpid(), len(source)) + source
            dense = np.frombuffer(mm, np.uint8, count=nbytes, offset=DATA_OFFSET)
            load_rows_into(header, dense.reshape(header.layout.num_rows, header.layout.row_bytes),
                           True if verify else None, progress, what="sharing")
            mm[STATE_OFFSET: STATE_OFFSET + 4] = struct.pack("<I", READY)  # last: the rows are all there
        finally:
            dense = None  # the mapping's last export here
            try:
                mm.close()
            except BufferError:  # a failed load's traceback still holds a view: the GC unmaps it
                pass
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _map_read_only(path: Path, nbytes: int) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), DATA_OFFSET + nbytes, prot=mmap.PROT_READ)


class SharedTier(MemoryTier):
    """All rows in a shared-memory segment, loaded once per machine; reads, ``rows`` (the
    dense rows, here on read-only shared pages) and closing are the memory tier's.

    Options: ``segment`` (name; default from the table's fingerprint), ``shm_dir``
    (default ``/dev/shm``), ``verify_reads`` (also check a version-1 table's blocks while loading; a version-2
    table's pages are always checked),
    ``progress``, ``check_memory`` (refuse to load more than is free; False to insist).
    ``loaded`` says whether this process loaded the segment (else it attached).
    """

    name = "shared"

    def __init__(self, header: TableHeader, *, segment: str | None = None, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
                 verify_reads: bool = False, progress: bool | None = None, check_memory: bool = True) -> None:
        Tier.__init__(self, header)  # not MemoryTier's: the rows come from the segment, not a private load
        started = time.perf_counter()
        directory = Path(shm_dir)
        if segment is not None and (not segment or Path(segment).name != segment or segment.startswith(".")):
            raise ValueError(f"segment must be a plain file name (no folders), got {segment!r}")
        if not directory.is_dir():
            raise TierError(f"the shared tier keeps its segment in {directory}, which is not a directory: "
                            "pass shm_dir= a tmpfs folder")
        self.segment = directory / (segment or segment_name(header))
        self.fingerprint = header.fingerprint()
        nbytes = _data_bytes(header)
        self.loaded = False
        with _election(self.segment.with_name(self.segment.name + ".lock")):
            found = _read_head(self.segment)
            if found is not None and found[0] != READY:  # its loader died: the lock was free
                self.segment.unlink()
                found = None
            if found is None:
                _check_space(header, directory, check_memory)
                _load(header, self.segment, self.fingerprint, verify_reads, progress)
                self.loaded = True
            else:
                self._check_segment(*found)
            self._mm = _map_read_only(self.segment, nbytes)
        with warnings.catch_warnings():  # the pages are read-only; the tier never writes them
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=DATA_OFFSET) if nbytes \
                else torch.empty(0, dtype=torch.uint8)
        self._rows = flat.view(header.layout.num_rows, header.layout.row_bytes)
        self.verify_reads = verify_reads
        self.verified_on_load = self.loaded and (header.page_sums is not None or verify_reads)  # by this process
        self.huge_pages = False  # tmpfs pages
        self.load_seconds = time.perf_counter() - started  # loading the segment, or attaching to it

    def _check_segment(self, state: int, fingerprint: int, nbytes: int, size: int, source: str) -> None:
        """A ready segment must hold this table: same fingerprint, same size."""
        if fingerprint != self.fingerprint:
            raise TierError(
                f"the shared segment {self.segment} holds another table ({source}, fingerprint "
                f"{fingerprint:016x}), not {self.header.path} (fingerprint {self.fingerprint:016x}): "
                "pick another segment name, or remove the stale one with "
                "engram_offload.tiers.shared.remove_segment (or rm) when no process uses it"
            )
        if nbytes != _data_bytes(self.header) or size < DATA_OFFSET + nbytes:
            raise TierError(
                f"the shared segment {self.segment} is {size:,} bytes, {DATA_OFFSET + _data_bytes(self.header):,} "
                f"expected for {self.header.path}: it is damaged; remove it and open the table again"
            )

    def stats(self) -> dict:
        return {**super().stats(), "segment": str(self.segment), "loaded_here": self.loaded,
                "segment_bytes": DATA_OFFSET + _data_bytes(self.header)}


def remove_segment(header: TableHeader, *, segment: str | None = None,
                   shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> bool:
    """Remove a table's segment (processes still attached keep their mapping until they
    close; the empty lock file stays, so no two loaders can ever hold different locks).
    Returns whether a segment was there."""
    path = Path(shm_dir) / (segment or segment_name(header))
    with _election(path.with_name(path.name + ".lock")):
        try:
            path.unlink()
        except FileNotFoundError:
            return False
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
