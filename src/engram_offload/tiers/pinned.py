"""``pinned`` tier: rows in page-locked host memory, gathered straight to the GPU.

With CUDA, the dense rows are page-locked where they were loaded (``cudaHostRegister``,
no second copy of the table), so device copies are asynchronous DMA and an
``out`` tensor on the GPU is filled by a host gather into a pinned staging buffer and
one non-blocking copy (the next read waits for that copy's event before it writes the
staging buffer again; the caller's stream is never synchronized). Without CUDA there is
nothing to pin for: the tier warns, reports ``pinned: False`` in its stats, and behaves
exactly as the memory tier.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import torch

from ..buffers.rowcopy import move_rows
from ..table.format import TableHeader
from .memory import MemoryTier

__all__ = ["PinnedTier"]


class PinnedTier(MemoryTier):
    name = "pinned"

    def __init__(self, header: TableHeader, *, verify_reads: bool | None = None, progress: bool | None = None,
                 check_memory: bool = True, huge_pages: bool = False) -> None:
        super().__init__(header, verify_reads=verify_reads, progress=progress, check_memory=check_memory,
                         huge_pages=huge_pages)
        self.pinned = torch.cuda.is_available()
        self._registration = None
        if self.pinned:
            from ..buffers.hostmem import register_host

            try:
                self._registration = register_host(self._rows)  # page-locked in place: no second copy
            except BaseException:
                self.close()
                raise
        else:
            warnings.warn(
                "pinned tier: CUDA is not available, so rows are kept in ordinary memory and "
                "the tier behaves as the memory tier",
                RuntimeWarning,
                stacklevel=3,
            )
        self._staging = threading.local()

    def _release(self) -> None:
        registration, self._registration = getattr(self, "_registration", None), None
        if registration is not None:
            registration.close()  # before the memory under it is unmapped
        super()._release()

    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        if not out.is_cuda:
            super()._read(ids, out)
            return
        staging = getattr(self._staging, "buf", None)
        copied = getattr(self._staging, "event", None)
        if copied is not None:
            copied.synchronize()  # the last copy out of this thread's staging buffer has finished
        if staging is None or staging.shape[0] < len(ids):
            staging = torch.empty((max(len(ids), 1024), self.row_bytes), dtype=torch.uint8, pin_memory=True)
            self._staging.buf = staging
        rows = staging[: len(ids)]  # [n, row_bytes] pinned
        move_rows(self._rows, ids, rows, None)
        stream = torch.cuda.current_stream(out.device)
        out.copy_(rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)  # waited on before the buffer is written again, not the whole stream now
        self._staging.event = event
        self._count(bytes_read=len(ids) * self.row_bytes)

    def stats(self) -> dict:
        return {**super().stats(), "pinned": self.pinned}
