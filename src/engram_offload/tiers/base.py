"""The tier interface: read raw rows of an opened table into a caller's buffer.

A tier moves bytes and counts what it did; it knows nothing of caches or row formats.
Every tier is safe to call from several threads at once, and never returns made-up
data: a read either fills ``out`` with the table's bytes or raises.

Closing waits for the reads in flight, then releases the medium (descriptor, mapping,
rings); reads that start after ``close`` began raise ``ValueError``. So no descriptor is
closed and no mapping unmapped under a reader.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch

from ..table.format import TableHeader

__all__ = ["Tier", "as_row_ids"]


def as_row_ids(row_ids: Any, num_rows: int, *, sorted_distinct: bool = False) -> np.ndarray:
    """Row ids (any int array-like) -> flat contiguous ``np.int64`` array; ``IndexError`` names a bad id.

    ``sorted_distinct`` also requires strictly increasing ids (``ValueError`` otherwise);
    the range check then only needs the first and the last id.
    """
    if isinstance(row_ids, torch.Tensor):
        row_ids = row_ids.detach().cpu().numpy()
    ids = np.asarray(row_ids)
    if ids.dtype.kind not in "iu":
        if ids.size == 0:
            return np.empty(0, np.int64)
        raise TypeError(f"row ids must be integers, got dtype {ids.dtype}")
    ids = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)  # views with any stride too
    ordered = sorted_distinct and (ids.size < 2 or bool((ids[1:] > ids[:-1]).all()))
    if ids.size and (not ordered or ids[0] < 0 or ids[-1] >= num_rows):
        bad = np.flatnonzero((ids < 0) | (ids >= num_rows))
        if bad.size:
            i = int(bad[0])
            raise IndexError(
                f"row id {int(ids[i])} (at position {i}) is out of range: the table has "
                f"{num_rows:,} rows (ids 0..{num_rows - 1:,})"
            )
    if sorted_distinct and not ordered:
        raise ValueError("row ids must be sorted distinct ids (strictly increasing): pass dedup(ids).unique")
    return ids


class Tier(ABC):
    """A medium holding one table's rows.

    Subclasses implement ``_read(ids, out)`` and ``_release()``; ``read_rows`` checks
    arguments and counts, ``close`` waits for the reads in flight before ``_release``.
    """

    name: ClassVar[str] = "tier"

    def __init__(self, header: TableHeader) -> None:
        self.header = header
        self.layout = header.layout
        self._stats_lock = threading.Lock()
        self._counts = {"requests": 0, "rows": 0, "reads": 0, "bytes_read": 0, "retries": 0,
                        "pages_checked": 0, "page_rereads": 0}
        self._users = threading.Condition(threading.Lock())
        self._in_flight = 0  # read_rows calls between their check of `closed` and their return
        self.closed = False

    @property
    def num_rows(self) -> int:
        return self.layout.num_rows

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    def read_rows(self, ids: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        """Copy rows ``ids`` (int64 ``[n]``) into ``out`` (uint8 ``[n, row_bytes]``); return ``out``."""
        ids = as_row_ids(ids, self.num_rows)
        if out.dtype != torch.uint8 or tuple(out.shape) != (len(ids), self.row_bytes):
            raise ValueError(
                f"out must be uint8 [{len(ids)}, {self.row_bytes}], got {out.dtype} {tuple(out.shape)}"
            )
        with self._in_use():
            if len(ids):
                self._read(ids, out)
        self._count(requests=1, rows=len(ids))
        return out

    @contextmanager
    def _in_use(self) -> Iterator[None]:
        """Holds off ``close`` (and the release of the medium) while the block runs."""
        with self._users:
            if self.closed:
                raise ValueError(f"the {self.name} tier of {self.header.path} is closed")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._users:
                self._in_flight -= 1
                if not self._in_flight:
                    self._users.notify_all()

    @abstractmethod
    def _read(self, ids: np.ndarray, out: torch.Tensor) -> None:
        """Fill ``out`` (uint8 ``[n, row_bytes]``) with rows ``ids`` (checked int64 ``[n]``)."""

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for key, value in deltas.items():
                self._counts[key] = self._counts.get(key, 0) + value

    def stats(self) -> dict[str, Any]:
        """Counters since opening: requests, rows, reads issued, bytes read, retries, ..."""
        with self._stats_lock:
            return {"tier": self.name, **self._counts}

    def close(self) -> None:
        """Refuse new reads, wait for those in flight, release the medium. Idempotent."""
        with self._users:
            if self.closed:
                return
            self.closed = True
            self._users.wait_for(lambda: not self._in_flight)
        self._release()

    def _release(self) -> None:
        """Free what the tier holds (descriptor, mapping, memory); no read is running."""

    def __enter__(self) -> "Tier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.header.path)!r}, rows={self.num_rows:,})"
