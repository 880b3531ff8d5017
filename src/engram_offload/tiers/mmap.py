"""``mmap`` tier: the file memory-mapped, rows served by the page cache (the baseline).

Reads fault in 4 KiB pages on demand (MADV_RANDOM turns readahead off; ``stats()``
reports whether the kernel took the advice). Every page holding a requested row is copied
out whole and checked against its checksum (a bad page is read once more with ``pread``,
then ``ChecksumError``).

``stats()["page_faults"]`` counts the major page faults the copies took (the calling
thread's, from ``getrusage(RUSAGE_THREAD)`` around each copy): the 4 KiB reads the drive
served, where ``pages_touched`` less them are the page cache's hits (with the native copy;
the ``pread`` fallback reports neither).

Two hazards of a mapping are kept away from readers: ``close`` waits for reads in flight
before unmapping (``Tier.close``), and every copy out of the mapping is guarded: the
native helper (``tiers/guarded.py``, ``tiers/_safecopy.c``) catches the SIGBUS of a page past the end of a
file truncated under the store, even mid-copy, and the tier raises ``TierError``; without
the helper the tier reads with ``pread`` instead of touching the mapping (a short read is
the same ``TierError``). Before each read an ``fstat`` (about a microsecond) also checks
the size and the modification time, so a table rewritten in place gives a ``TierError``
instead of a mix of old and new rows (a rewrite racing a read that already passed the
check is not covered: replace table files by renaming a new file over them, as
``make-table`` and ``convert`` do).

A checkpoint (``table.checkpoint``) is read the same way from its shards, each mapped: the
pages under each row's pieces copied out, checked against the sidecar's page sums, the row put
together (``pagecheck.plan_checkpoint``); each shard's size and mtime are checked before a read.
"""

from __future__ import annotations

import mmap
import os
import resource

import numpy as np
import torch

from ..errors import TierError
from ..table.format import TableHeader
from ..table.stream import PAGE
from ._buffers import ThreadBuffers, gather_at, madvise_quietly
from .base import Tier
from .guarded import guarded_copy, guarded_copy_available
from .pagecheck import check_pages, gather_pieces, plan_checkpoint, plan_pages

__all__ = ["MmapTier", "guarded_copy_available"]

class MmapTier(Tier):
    """Rows copied out of the mapped table file, every page checked against the table's page sums."""

    name = "mmap"

    def __init__(self, header: TableHeader) -> None:
        super().__init__(header)
        self._checkpoint = getattr(header, "checkpoint", None)
        files = [header.path] if self._checkpoint is None else list(self._checkpoint.shards)
        sizes = [header.layout.file_bytes] if self._checkpoint is None else self._checkpoint.sizes.tolist()
        self._files: list[tuple[int, mmap.mmap, int, int, int]] = []  # fd, mapping, its address, size, mtime
        try:
            for path, size in zip(files, sizes):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # kept for the size check and the pread path
                try:
                    # Private mapping: writable as far as Python knows (torch wants that), never written.
                    mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
                except BaseException:
                    os.close(fd)
                    raise
                address = int(np.frombuffer(mm, np.uint8, count=1).ctypes.data)
                self._files.append((fd, mm, address, size, os.fstat(fd).st_mtime_ns))
        except BaseException:
            self._release()
            raise
        self._fd, self._mm = self._files[0][:2]
        self.random_advice = all([madvise_quietly(f[1], "MADV_RANDOM") for f in self._files])
        self._staging = ThreadBuffers()

    def _check_unchanged(self) -> None:
        for fd, _, _, size, mtime_ns in self._files:
            st = os.fstat(fd)
            if st.st_size < size:
                raise self._changed(f"shrank to {st.st_size:,} bytes (it had {size:,})", fd)
            if st.st_mtime_ns != mtime_ns:
                raise self._changed("was modified (its mtime changed)", fd)

    def _changed(self, what: str, fd: int | None = None) -> TierError:
        path = self.header.path
        if self._checkpoint is not None and fd is not None:
            path = self._checkpoint.shards[[f[0] for f in self._files].index(fd)]
        return TierError(
            f"{path} {what} while open: it was truncated or rewritten in place; "
            "close the store and reopen the table once it is whole (verify it first)"
        )

    def _copy(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dests: np.ndarray,
              file: int = 0) -> None:
        """Copy byte ranges of file ``file`` into ``dest`` (uint8) at ``dests``; ``TierError``,
        never a signal, when the file shrank under the mapping."""
        fd, _, address, size, _ = self._files[file]
        if not guarded_copy(address, size, fd, offsets, lengths, dest, dests):
            raise self._changed("shrank during a read (SIGBUS caught)" if guarded_copy_available()
                                else "ended early during a read", fd)

    def _faulting_copy(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dests: np.ndarray,
                       pages: int, file: int = 0) -> None:
        """``_copy``, counting the ``pages`` it touches and the major faults (drive reads) it
        took; the ``pread`` fallback takes no faults and counts neither."""
        if not guarded_copy_available():
            self._copy(offsets, lengths, dest, dests, file)
            return
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_majflt
        self._copy(offsets, lengths, dest, dests, file)
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_majflt - before
        self._count(pages_touched=pages, page_faults=faults)

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        self._check_unchanged()
        if self._checkpoint is not None:
            self._read_checkpoint(ids, out)
            return
        plan = plan_pages(self.layout.row_offsets(ids), self.layout)
        page = self.layout.page_bytes
        buf = self._staging.get(plan.nbytes)
        self._faulting_copy(plan.starts, np.full(len(plan.starts), page, np.int64), buf, plan.dests, len(plan.pages))

        def reread(bad: np.ndarray) -> None:  # from the file, not the mapping
            self._count(page_rereads=len(bad))
            view = memoryview(buf)  # type: ignore[arg-type]  # NumPy's stubs lack __buffer__
            for start, d in zip(plan.starts[bad].tolist(), plan.dests[bad].tolist()):
                if os.preadv(self._fd, [view[d: d + page]], start) != page:
                    raise self._changed("ended early during a read")

        self._count(reads=len(ids), bytes_read=plan.nbytes, pages_checked=len(plan.pages))
        check_pages(self.header, plan, buf, reread)
        gather_at(torch.from_numpy(buf[: plan.nbytes]), plan.positions, out)

    def _read_checkpoint(self, ids: np.ndarray, out: torch.Tensor) -> None:
        """A checkpoint's rows: the pages under their pieces copied out of the shards' mappings
        (a page a shard ends in: its bytes, then zeros), checked, the pieces put together."""
        ck = self._checkpoint
        assert ck is not None
        plan = plan_checkpoint(ids, ck)
        assert plan.files is not None and plan.valid is not None
        files, valid = plan.files, plan.valid
        buf = self._staging.get(plan.nbytes)

        def copy(which: np.ndarray, faults: bool) -> None:
            for file in np.unique(files[which]).tolist():
                sel = which[files[which] == file]
                if faults:
                    self._faulting_copy(plan.starts[sel], valid[sel], buf, plan.dests[sel], len(sel), file)
                else:
                    self._count(page_rereads=len(sel))
                    view = memoryview(buf)  # type: ignore[arg-type]  # NumPy's stubs lack __buffer__
                    for start, d, n in zip(plan.starts[sel].tolist(), plan.dests[sel].tolist(), valid[sel].tolist()):
                        if os.preadv(self._files[file][0], [view[d: d + n]], start) != n:
                            raise self._changed("ended early during a read", self._files[file][0])
            for i in which[valid[which] < PAGE].tolist():
                buf[plan.dests[i] + valid[i]: plan.dests[i] + PAGE] = 0

        copy(np.arange(len(plan.pages)), True)
        self._count(reads=len(ids), bytes_read=plan.nbytes, pages_checked=len(plan.pages))
        check_pages(self.header, plan, buf, lambda bad: copy(bad, False))
        gather_pieces(buf, plan, ck, out)

    def stats(self) -> dict:
        return {**super().stats(), "madv_random": self.random_advice, "guarded_copy": guarded_copy_available()}

    def _release(self) -> None:
        files, self._files = getattr(self, "_files", []), []
        for fd, mm, _, _, _ in files:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps later
                pass
            os.close(fd)
