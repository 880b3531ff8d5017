"""``open_table``: an opened table on one tier, returning raw or dequantized rows.

The store checks row ids, reads raw rows from its tier and decodes them with the
table's row format; row caches in front of the tier are a later addition.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import torch

from .config import EngramConfig
from .rows import decode_rows
from .table.format import TableHeader, read_header
from .tiers import Tier, as_row_ids, open_tier

__all__ = ["TableStore", "open_table"]


class TableStore:
    """Rows of one table file served from one tier. Thread-safe; use as a context manager."""

    def __init__(self, header: TableHeader, tier: Tier) -> None:
        self.header = header
        self.tier = tier
        self._lock = threading.Lock()
        self._requests = 0
        self._rows = 0
        self._seconds = 0.0

    @property
    def config(self) -> EngramConfig:
        """The table's EngramConfig (as written into its header)."""
        return self.header.config

    @property
    def num_rows(self) -> int:
        return self.header.layout.num_rows

    @property
    def row_bytes(self) -> int:
        return self.header.layout.row_bytes

    def read_raw(self, row_ids: Any) -> torch.Tensor:
        """Raw rows ``uint8 [n, row_bytes]`` for ``row_ids`` (any int array-like, flattened)."""
        ids = as_row_ids(row_ids, self.num_rows)
        out = torch.empty((len(ids), self.row_bytes), dtype=torch.uint8)
        t0 = time.perf_counter()
        self.tier.read_rows(ids, out)
        with self._lock:
            self._requests += 1
            self._rows += len(ids)
            self._seconds += time.perf_counter() - t0
        return out

    def gather(self, row_ids: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized rows: ids of shape ``S`` -> ``[*S, head_dim]`` of ``dtype``."""
        shape = tuple(row_ids.shape) if hasattr(row_ids, "shape") else (len(np.asarray(row_ids).reshape(-1)),)
        raw = self.read_raw(row_ids)  # [n, row_bytes]
        rows = decode_rows(raw, self.config.row_format, self.config.head_dim, dtype)  # [n, head_dim]
        return rows.reshape(*shape, self.config.head_dim)

    def stats(self) -> dict[str, Any]:
        """Store and tier counters: requests, rows, reads issued, bytes read, read seconds, ..."""
        with self._lock:
            mine = {"requests": self._requests, "rows": self._rows, "read_seconds": self._seconds}
        return {**self.tier.stats(), **mine, "table": str(self.header.path),
                "table_bytes": self.header.layout.file_bytes}

    def close(self) -> None:
        self.tier.close()

    def __enter__(self) -> "TableStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TableStore({str(self.header.path)!r}, tier={self.tier.name!r}, rows={self.num_rows:,})"


def open_table(
    path: str | os.PathLike[str],
    tier: str = "mmap",
    *,
    cache_bytes: int | None = None,
    policy: str = "lru",
    fast_cache_bytes: int = 0,
    admission: bool | None = None,
    **options: Any,
) -> Any:
    """Open a table file on a tier (``memory``, ``pinned``, ``mmap``, ``direct``).

    ``options`` go to the tier (e.g. ``engine``, ``queue_depth``, ``verify_reads`` for
    ``direct``). Raises ``TableFormatError`` for a file that is not a valid table.

    ``cache_bytes`` puts a DRAM row cache of that size in front of the tier (and
    ``fast_cache_bytes`` a fast cache above it, on the GPU when there is one), evicting by
    ``policy`` (``lru`` or ``lfu``); the result is then a ``cache.CachedStore``, with the
    same methods plus ``fetch`` and per-level statistics.
    """
    header = read_header(path)
    store = TableStore(header, open_tier(tier, header, **options))
    if not cache_bytes and not fast_cache_bytes:
        return store
    from .cache import CachedStore, build_levels

    try:
        levels = build_levels(header.layout.row_bytes, int(cache_bytes or 0), policy,
                              fast_cache_bytes=int(fast_cache_bytes), admission=admission,
                              num_rows=header.layout.num_rows)
    except BaseException:
        store.close()
        raise
    return CachedStore(store.tier, store.config, levels, inner=store)
