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
"""

from __future__ import annotations

import mmap
import os
import resource

import numpy as np
import torch

from ..errors import TierError
from ..table.format import TableHeader
from ._buffers import ThreadBuffers, gather_at, madvise_quietly
from .base import Tier
from .guarded import guarded_copy, guarded_copy_available
from .pagecheck import check_pages, plan_pages

__all__ = ["MmapTier", "guarded_copy_available"]

class MmapTier(Tier):
    """Rows copied out of the mapped table file, every page checked against the table's page sums."""

    name = "mmap"

    def __init__(self, header: TableHeader) -> None:
        super().__init__(header)
        self._fd = os.open(header.path, os.O_RDONLY)  # kept for the size check and the pread path
        try:
            # Private mapping: writable as far as Python knows (torch wants that), never written.
            self._mm = mmap.mmap(self._fd, header.layout.file_bytes, access=mmap.ACCESS_COPY)
        except BaseException:
            os.close(self._fd)
            raise
        self._mtime_ns = os.fstat(self._fd).st_mtime_ns
        self.random_advice = madvise_quietly(self._mm, "MADV_RANDOM")
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)  # [file_bytes]
        self._staging = ThreadBuffers()

    def _check_unchanged(self) -> None:
        st = os.fstat(self._fd)
        if st.st_size < self.layout.file_bytes:
            what = f"shrank to {st.st_size:,} bytes (the table has {self.layout.file_bytes:,})"
        elif st.st_mtime_ns != self._mtime_ns:
            what = "was modified (its mtime changed)"
        else:
            return
        raise self._changed(what)

    def _changed(self, what: str) -> TierError:
        return TierError(
            f"{self.header.path} {what} while open: it was truncated or rewritten in place; "
            "close the store and reopen the table once it is whole (verify it first)"
        )

    def _copy(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dests: np.ndarray) -> None:
        """Copy file byte ranges into ``dest`` (uint8) at ``dests``; ``TierError``, never a
        signal, when the file shrank under the mapping."""
        if not guarded_copy(self._bytes.data_ptr(), self.layout.file_bytes, self._fd, offsets, lengths, dest, dests):
            raise self._changed("shrank during a read (SIGBUS caught)" if guarded_copy_available()
                                else "ended early during a read")

    def _faulting_copy(self, offsets: np.ndarray, lengths: np.ndarray, dest: np.ndarray, dests: np.ndarray,
                       pages: int) -> None:
        """``_copy``, counting the ``pages`` it touches and the major faults (drive reads) it
        took; the ``pread`` fallback takes no faults and counts neither."""
        if not guarded_copy_available():
            self._copy(offsets, lengths, dest, dests)
            return
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_majflt
        self._copy(offsets, lengths, dest, dests)
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_majflt - before
        self._count(pages_touched=pages, page_faults=faults)

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        self._check_unchanged()
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

    def stats(self) -> dict:
        return {**super().stats(), "madv_random": self.random_advice, "guarded_copy": guarded_copy_available()}

    def _release(self) -> None:
        self._bytes = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps later
            pass
        os.close(self._fd)
