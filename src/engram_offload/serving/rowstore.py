"""``RowStore``: what every row store shares (``TableStore``, ``LayeredStore``, ``RowClient``).

A store implements one primitive, ``_lease``: rows of checked, sorted distinct ids as a
``RowLease``, plus ``stats`` and ``close``. The rest is here: ``fetch`` (the ids' check),
``read_raw`` and ``gather`` (deduplicate, fetch without holding, put the rows back in the
caller's order), ``decode``, ``in_place_rows`` (None unless a store holds rows resident)
and the context manager.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import numpy as np
import torch

from ..buffers.recycle import RecycledArrays
from ..buffers.rowcopy import move_rows
from ..cache.lease import RowsInPlace, require_hold
from ..engram.config import EngramConfig
from ..engram.rows import decode_rows
from ..gpu.sync import MAIN, DeviceSync
from ..tiers import as_row_ids
from .dedup import Dedup, dedup
from .sharding import Columns

__all__ = ["EXPAND_RAW_FIRST", "RowLease", "RowStore"]

EXPAND_RAW_FIRST = 0.75  # gather: unique/requested above this -> order raw rows, then decode


class RowLease(Protocol):
    """What ``RowStore.fetch`` returns: a ``cache.lease.Lease``, or a row server's ``RemoteLease``."""

    ids: np.ndarray  # int64 [u]: the sorted distinct ids fetched
    ready: object  # the device event after which raw holds the rows (None: it does now)
    in_place: RowsInPlace | None  # the rows where a host cache holds them (fetch's in_place), or None

    @property
    def raw(self) -> torch.Tensor: ...  # uint8 [u, row_bytes]

    @property
    def host_raw(self) -> np.ndarray: ...  # the same rows as a NumPy array (host rows only)

    def release(self) -> None: ...


class RowStore(ABC):
    """Rows of one table (``num_rows`` of ``config``): what a consumer (the prefetcher, the
    plugins, the benchmarks) needs of a store. Subclasses implement ``_lease``, ``stats`` and
    ``close``."""

    device: torch.device = torch.device("cpu")  # where fetched raw rows are
    sync: DeviceSync | None = None  # orders the device work (None: rows are on the host when fetch returns)
    columns: Columns | None = None  # the column shard [c0, c1) whose rows alone it serves (None: every row)

    def __init__(self, config: EngramConfig, num_rows: int) -> None:
        self._config = config
        self._num_rows = int(num_rows)
        self._rb = int(config.row_bytes)
        self.closed = False

    @property
    def config(self) -> EngramConfig:
        """The table's EngramConfig (as written into its header)."""
        return self._config

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def row_bytes(self) -> int:
        return self._rb

    # ------------------------------------------------------------------ what a store implements
    @abstractmethod
    def _lease(self, ids: np.ndarray, hold: bool, requested: int | None, in_place: bool) -> RowLease:
        """Rows of ``ids`` (int64, sorted, distinct, in range) as a lease (see ``fetch``)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    def close(self) -> None: ...

    def in_place_rows(self, layer_id: int) -> tuple[torch.Tensor, int] | None:
        """Where this process holds layer ``layer_id``'s rows resident, for a device to read them
        in place: the host tensor ``uint8 [R, row_bytes]`` holding them and ``first``, the flat
        row id of its row 0 (flat id ``f`` is row ``f - first``; with ``columns``, only the
        shard's rows are there). None when this process does not hold them (a host-read tier, a
        row server's client, a pool)."""
        return None

    # ------------------------------------------------------------------ reading rows
    def fetch(self, unique_ids: np.ndarray, *, hold: bool = True, requested: int | None = None,
              in_place: bool = False) -> RowLease:
        """Raw rows of sorted distinct ids ``[u]`` -> a lease (``raw: uint8 [u, row_bytes]``).

        With ``hold`` the rows stay pinned in their caches until the lease is released;
        without it, only while they are copied. ``requested``: how many ids these distinct
        ids stand for before deduplication (default ``u``), for ``unique_ratio``. ``in_place``
        (with ``hold``): rows a host cache holds every one of may be left there, pinned
        (``lease.in_place``), not copied.
        """
        require_hold(in_place, hold)
        return self._lease(self._checked(unique_ids), hold, requested, in_place)

    def _checked(self, unique_ids: Any) -> np.ndarray:
        """``fetch``'s ids as int64, flat, sorted, distinct and in range (else ``IndexError``/``ValueError``)."""
        return as_row_ids(unique_ids, self.num_rows, sorted_distinct=True)

    def read_raw(self, row_ids: Any) -> torch.Tensor:
        """Raw rows ``uint8 [n, row_bytes]`` for ``row_ids`` (any int array-like, flattened)."""
        d = dedup(row_ids)
        return _in_order(self._unheld(d), d.inverse)

    def gather(self, row_ids: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized rows: ids of shape ``S`` -> ``[*S, head_dim]`` of ``dtype`` (a single
        id: ``[1, head_dim]``).

        When a step has few repeats, the raw rows (``row_bytes`` each) are put in the step's
        order before decoding rather than the decoded ones after: fewer bytes move.
        """
        d = dedup(row_ids)
        shape = d.shape or (1,)
        raw = self._unheld(d)
        if d.unique.size >= EXPAND_RAW_FIRST * d.requested:
            return self.decode(_in_order(raw, d.inverse), dtype).reshape(*shape, self._config.head_dim)
        rows = self.decode(raw, dtype)  # [u, head_dim]
        return rows.index_select(0, torch.from_numpy(d.inverse).to(rows.device)).reshape(*shape, -1)

    def _unheld(self, d: Dedup) -> torch.Tensor:
        """Raw rows ``[u, row_bytes]`` of ``d``'s distinct ids, fetched without holding, usable
        on the caller's stream."""
        ids = d.unique  # sorted and distinct: only the ends need a range check
        if ids.size and (ids[0] < 0 or ids[-1] >= self.num_rows):
            as_row_ids(ids, self.num_rows)  # raises, naming the bad id
        lease = self._lease(ids, False, d.requested, False)
        raw = lease.raw
        if self.sync is not None:  # device rows (host rows come with no sync)
            self.sync.wait(MAIN, lease.ready)
            self.sync.keep_alive(raw, MAIN)
        return raw

    def decode(self, raw: torch.Tensor | np.ndarray, dtype: torch.dtype = torch.float32, *,
               index: np.ndarray | None = None, index_base: int = 0, shape: tuple[int, ...] | None = None,
               buffers: RecycledArrays | None = None, slots: np.ndarray | None = None) -> torch.Tensor:
        """Raw rows ``uint8 [n, row_bytes]`` -> ``[n, head_dim]`` of ``dtype`` (on raw's device);
        with ``index`` (int64 of any shape, k entries) the rows ``raw[index - index_base]``,
        ``[k, head_dim]``; see ``rows.decode_rows`` (``shape``: the result's leading dimensions;
        ``slots``: rows left in a cache's arena, ``Lease.in_place``)."""
        return decode_rows(raw, self._config.row_format, self._config.head_dim, dtype, index=index,
                           index_base=index_base, shape=shape, buffers=buffers, slots=slots)

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> RowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _in_order(raw: torch.Tensor, inverse: np.ndarray) -> torch.Tensor:
    """Raw rows of distinct ids ``[u, row_bytes]`` -> the caller's order ``[n, row_bytes]``."""
    out = torch.empty((inverse.size, raw.shape[1]), dtype=torch.uint8, device=raw.device)  # [n, row_bytes]
    move_rows(raw, inverse, out, None)
    return out
