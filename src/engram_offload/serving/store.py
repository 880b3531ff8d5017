"""``open_table`` and ``TableStore``: rows of one table through optional row caches in front of a tier.

Every store is a ``TableStore``; an uncached one simply has no cache levels. A fetch walks
the levels fastest first: a fast cache (GPU memory when there is one, else a tensor in
RAM), then a DRAM cache, then the tier behind them all. Each level pins what it holds; only
what no level holds is read from the tier, and those rows fill the last (DRAM) cache. Rows
found in a lower cache are promoted to the ones above it: a row asked for again is a hot row.

``fetch(unique_ids, hold=True)`` returns a ``Lease`` whose pins last until it is released,
which is how a prefetcher keeps a step's rows resident while the step runs. ``gather`` and
``read_raw`` (``rowstore.RowStore``'s, shared by every store) deduplicate their ids, fetch,
and put the rows back in the caller's order; rows are decoded in ``decode`` only.

With a ``device`` (``open_table(..., device="cuda")``) the store delivers rows to that device
(``gpu.delivery.DeviceRows``): the fast level is an ``HbmRowCache`` (device slots, host-side
policy, one launch a step); a ``memory`` or ``pinned`` table is read by the device in place
over UVA; any other tier's rows are read on the host through the DRAM levels into pinned
staging buffers and copied on a side stream. A ``Lease``'s rows are then on the device, ready
after ``lease.ready``; ``gather`` and ``read_raw`` return rows ready on the caller's stream.
Without a device nothing of this runs.

With ``columns`` (``open_table(..., columns=(c0, c1))``, a tensor-parallel rank's column
shard, ``sharding.shard_columns``) the store serves only the rows of those columns' heads
(``sharding.shard_rows``): any other id raises ``IndexError``, so its caches hold only the
shard's rows and two ranks never cache the same row. On ``memory`` or ``pinned`` the rank's
store is a ``layered.LayeredStore`` that loads only those rows (a rank's share of the table).

With ``row_server`` (``open_table(path, tier, row_server=socket)``) there is no local store:
the result is a ``rowserver.RowClient`` of the machine's row server, another ``RowStore``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping, Protocol, Sequence, overload

import numpy as np
import torch

from ..buffers.hostmem import device_reads_in_place
from ..buffers.rowcopy import move_rows, native_move_rows
from ..cache.admission import FrequencySketch
from ..cache.lease import Lease, Pins, RowsInPlace
from ..cache.levels import build_levels, capped_bytes
from ..cache.policy import DEFAULT_POLICY
from ..cache.row_cache import RowCache, native_hitpath
from ..cache.stats import LATENCY_SAMPLES, LevelStats, percentiles_ms
from ..engram.config import EngramConfig
from ..gpu.delivery import STAGING_BYTES, DeviceRows
from ..gpu.device_table import DeviceTable
from ..gpu.hbm_cache import HbmRowCache
from ..gpu.sync import DeviceSync, make_sync
from ..table.format import TableHeader, read_header
from ..tiers import Tier, as_row_ids, open_tier, tier_names
from ..tiers.memory import MemoryTier
from .layered import LayeredStore, open_layered
from .rowstore import RowLease, RowStore
from .sharding import Columns, ShardRows, check_columns, require_in_shard, shard_rows

if TYPE_CHECKING:
    from .rowserver.client import RowClient

__all__ = ["Lease", "RowLease", "RowSource", "RowStore", "TableStore", "open_table"]

_EMPTY = np.empty(0, np.int64)


class RowSource(Protocol):
    """What a store reads misses from: a tier (``tiers.base.Tier``) or a test's fake."""

    @property
    def num_rows(self) -> int: ...

    @property
    def row_bytes(self) -> int: ...

    def read_rows(self, ids: np.ndarray, out: torch.Tensor) -> torch.Tensor: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass
class _Served:
    """Rows one cache level served in a fetch: its pinned slots and where they go in the result."""

    level: RowCache
    slots: np.ndarray  # pinned slots of the rows it held
    positions: np.ndarray | None  # positions in the fetch's ids (None: all of them, in order)


class TableStore(RowStore):
    """Rows of one table through ``levels`` (row caches, fastest first; may be empty) in front
    of ``tier``; with ``device_rows``, delivered to its device (the HBM level, if any, above
    ``levels``). With ``columns``, only the rows of that column shard (see the module doc).
    Thread-safe; use as a context manager."""

    def __init__(self, tier: RowSource, config: EngramConfig, levels: Sequence[RowCache] = (), *,
                 header: TableHeader | None = None,
                 device_rows: DeviceRows | None = None, columns: Columns | None = None) -> None:
        if tier.row_bytes != config.row_bytes:
            raise ValueError(f"the tier's rows are {tier.row_bytes} bytes, the config's {config.row_bytes}")
        for level in levels:
            if level.row_bytes != tier.row_bytes:
                raise ValueError(f"cache {level.name!r} holds {level.row_bytes}-byte rows, the table has {tier.row_bytes}")
        super().__init__(config, tier.num_rows)
        self.tier = tier
        self.header = header
        self.levels = list(levels)
        self.device = self.levels[0].device if self.levels else self.device
        self._device_rows = device_rows
        self.hbm: HbmRowCache | None = None
        if device_rows is not None:
            if any(level.device.type != "cpu" for level in self.levels):
                raise ValueError("with a device the fast level is the HBM cache: give only host (DRAM) levels")
            self.device, self.sync, self.hbm = device_rows.device, device_rows.sync, device_rows.hbm
        self.tier_level = LevelStats("tier")  # what this store asked of the tier
        self._lock = threading.Lock()
        self._fetches = 0
        self._requested = 0
        self._unique = 0
        self._fetch_samples: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        native = native_hitpath()
        self._sorted_in_range = native.sorted_in_range if native is not None else None
        self._first_into = bool(self.levels) and self.levels[0].device.type == "cpu"
        # one CPU cache level (the usual host set-up): its misses take _one_level_misses
        self._move_bytes = native_move_rows()
        self._native_misses = native if (native is not None and self._move_bytes is not None
                                         and len(self.levels) == 1 and self._first_into
                                         and self.levels[0].native) else None
        self.columns = None if columns is None else check_columns(columns, config.cols_per_layer)
        self._shard: ShardRows | None = None if self.columns is None else shard_rows(config, self.columns)

    # ------------------------------------------------------------------ reading rows
    def _checked(self, unique_ids: Any) -> np.ndarray:
        check = self._sorted_in_range
        if check is not None and type(unique_ids) is np.ndarray and check(unique_ids, self.num_rows):
            return unique_ids  # already what as_row_ids would return: int64, flat, sorted, in range
        return as_row_ids(unique_ids, self.num_rows, sorted_distinct=True)

    def _lease(self, ids: np.ndarray, hold: bool, requested: int | None, in_place: bool) -> Lease:
        """Every row comes from a cache or the tier; a tier failure raises (pins are let go
        first). ``in_place``: rows a host cache holds every one of are left there (a decoder
        reads them there, saving a copy of each row)."""
        out, pins, ready = self._fetch(ids, hold, requested, in_place)
        return Lease(ids, out, pins, ready)

    # ------------------------------------------------------------------ the fetch path
    @overload
    def _fetch(self, ids: np.ndarray, hold: bool, requested: int | None,
               in_place: Literal[False] = ...) -> tuple[torch.Tensor | np.ndarray, Pins, object]: ...

    @overload
    def _fetch(self, ids: np.ndarray, hold: bool, requested: int | None,
               in_place: bool) -> tuple[torch.Tensor | np.ndarray | RowsInPlace, Pins, object]: ...

    def _fetch(self, ids: np.ndarray, hold: bool, requested: int | None, in_place: bool = False
               ) -> tuple[torch.Tensor | np.ndarray | RowsInPlace, Pins, object]:
        """Raw rows ``[u, row_bytes]`` of distinct ids (host rows a cache served whole: a NumPy
        array, or with ``in_place`` where the cache holds them), the pins held (none unless
        ``hold``), and the device event after which the rows are there (None: they are now)."""
        if self.closed:
            raise ValueError("this store is closed: open the table again")
        if self._shard is not None and self.columns is not None:
            require_in_shard(self._shard, self.columns, ids)
        t_start = time.perf_counter()
        u = ids.size
        ready = None
        pins: Pins
        out: torch.Tensor | np.ndarray | RowsInPlace
        if u == 0:
            out, pins = torch.empty((0, self._rb), dtype=torch.uint8, device=self.device), []
        elif self._device_rows is not None:
            out, pins, ready, uva_rows = self._device_rows.fetch(ids, lambda i, o: self._host_rows(i, o, hold))
            if uva_rows:  # misses the device read from the resident table
                self.tier_level.record(uva_rows, 0, uva_rows * self._rb, 0.0)
        elif not self.levels:
            out, pins = torch.empty((u, self._rb), dtype=torch.uint8), []  # [u, row_bytes]
            self._read_tier(ids, out)  # straight into the result
        else:
            out, pins = self._through_levels(ids, hold, t_start, in_place=in_place)
        self._account(u, requested, time.perf_counter() - t_start)
        return out, pins, ready

    def _host_rows(self, ids: np.ndarray, out: torch.Tensor, hold: bool) -> Pins:
        """Rows of distinct ids through the host levels and the tier into ``out`` (host
        ``uint8 [u, row_bytes]``, e.g. a staging buffer); returns the pins held."""
        if not self.levels:
            self._read_tier(ids, out)
            return []
        return self._through_levels(ids, hold, time.perf_counter(), out)[1]

    def _through_levels(self, ids: np.ndarray, hold: bool, t_start: float, out: torch.Tensor | None = None,
                        in_place: bool = False) -> tuple[torch.Tensor | np.ndarray | RowsInPlace, Pins]:
        """The first level's lookup; when it holds every row (the common case in steady
        decoding) one copy and done (none ``in_place``: the rows stay there, pinned), else the
        walk through every level. Rows go to ``out`` when given (host, contiguous)."""
        u, first = ids.size, self.levels[0]
        if self._first_into:  # a CPU cache: look up, and copy when everything hits, in one call
            if in_place and out is None:
                slots, nhit = first.acquire_counted(ids)  # hits pinned, as acquire_into's when one misses
                if nhit == u:
                    return RowsInPlace(first.host_rows, slots), self._all_hit(slots, hold, t_start)
                buf = np.empty((u, self._rb), np.uint8)
            else:
                buf = np.empty((u, self._rb), np.uint8) if out is None else out.numpy()
                slots, nhit = first.acquire_into(ids, buf, hold)
            if nhit == u and out is None:  # the rows as a NumPy array: no tensor made (see Lease)
                return buf, self._all_hit(slots, hold, t_start)
            if out is None and self._native_misses is not None:
                return buf, self._one_level_misses(ids, buf, slots, nhit, hold, t_start)
            out = torch.from_numpy(buf)  # [u, row_bytes]
        else:
            slots, nhit = first.acquire_counted(ids)
            if out is None:
                out = torch.empty((u, self._rb), dtype=torch.uint8, device=self.device)  # [u, row_bytes]
            if nhit == u:
                try:
                    _copy_from(first, slots, None, out)
                finally:
                    if not hold:
                        first.release(slots)
        if nhit < u:
            return self._walk(ids, out, (slots, nhit), hold, t_start)
        return out, self._all_hit(slots, hold, t_start)

    def _one_level_misses(self, ids: np.ndarray, buf: np.ndarray, slots: np.ndarray, nhit: int, hold: bool,
                          t_start: float) -> Pins:
        """``_walk`` for one CPU cache level in native calls and NumPy buffers: the hits copied
        (their pins from ``acquire_into`` taken over), the misses read from the tier into
        ``buf`` (``uint8 [u, row_bytes]``) and put into the cache. Returns the pins held (none
        unless ``hold``). No mask, fancy index or tensor op on the way: each would let go of
        the GIL, a thread switch while another thread waits for it."""
        level, native, move, rb, u = self.levels[0], self._native_misses, self._move_bytes, self._rb, ids.size
        assert native is not None and move is not None
        hit_slots, hit_src, hit_dst = np.empty(u, np.int64), np.empty(u, np.int64), np.empty(u, np.int64)
        miss_ids, miss_dst = np.empty(u, np.int64), np.empty(u, np.int64)
        native.split_slots(ids, slots, rb, hit_slots, hit_src, hit_dst, miss_ids, miss_dst)
        hit_slots, hit_src, hit_dst = hit_slots[:nhit], hit_src[:nhit], hit_dst[:nhit]
        miss_ids, miss_dst = miss_ids[:u - nhit], miss_dst[:u - nhit]
        out_bytes = buf.reshape(-1)
        filled = _EMPTY
        try:
            if nhit:
                move(level.data.numpy().reshape(-1), hit_src, out_bytes, hit_dst, rb)
            level.stats.record(u, nhit, nhit * rb, time.perf_counter() - t_start)
            missed = np.empty((miss_ids.size, rb), np.uint8)  # [misses, row_bytes]
            self._read_tier(miss_ids, torch.from_numpy(missed))
            move(missed.reshape(-1), None, out_bytes, miss_dst, rb)
            filled = _fill_level(level, miss_ids, missed, None, hold)
        except BaseException:
            level.release(hit_slots)
            raise
        if not hold:
            level.release(hit_slots)
            return []
        return [(level, s) for s in (hit_slots, filled) if s.size]

    def _all_hit(self, slots: np.ndarray, hold: bool, t_start: float) -> Pins:
        """Count a fetch the first level served whole; its pins (none unless ``hold``)."""
        first, u = self.levels[0], slots.size
        first.stats.record(u, u, u * self._rb, time.perf_counter() - t_start)
        for level in self.levels[1:]:
            level.stats.record(0, 0, 0, 0.0)
        return [(first, slots)] if hold else []

    def _walk(self, ids: np.ndarray, out: torch.Tensor, first: tuple[np.ndarray, int], hold: bool,
              t_start: float) -> tuple[torch.Tensor, Pins]:
        """Level by level, then the tier, then the fills. ``first``: the first level's
        ``acquire_counted`` result (its hits pinned, not yet copied)."""
        served: list[_Served] = []
        try:
            missed = self._look_up(ids, out, first, served, t_start)
            if missed.size:
                self._read_misses(ids, missed, out)
            fills = self._fill(ids, out, missed, served, hold)
        except BaseException:
            if not served:  # the first level's pins were not taken over yet
                self.levels[0].release(first[0][first[0] >= 0])
            _release(served)
            raise
        if not hold:
            _release(served)
            return out, []
        return out, [(s.level, s.slots) for s in served if s.slots.size] + fills

    def _look_up(self, ids: np.ndarray, out: torch.Tensor, first: tuple[np.ndarray, int],
                 served: list[_Served], t_start: float) -> np.ndarray:
        """Copy what each level holds into ``out``, appending to ``served``; returns the
        positions in ``ids`` that no level held."""
        remaining: np.ndarray | None = None  # None: all positions (before the first level)
        for li, level in enumerate(self.levels):
            t0 = t_start if li == 0 else time.perf_counter()
            asked = ids if remaining is None else ids[remaining]
            if asked.size == 0:
                served.append(_Served(level, _EMPTY, _EMPTY))
                level.stats.record(0, 0, 0, time.perf_counter() - t0)
                continue
            slots, nhit = first if li == 0 else level.acquire_counted(asked)
            hits, remaining = _split_hits(level, slots, nhit, remaining, ids.size)
            served.append(hits)
            if nhit:
                _copy_from(level, hits.slots, hits.positions, out)
            level.stats.record(asked.size, nhit, nhit * self._rb, time.perf_counter() - t0)
        assert remaining is not None  # the first level always splits the positions
        return remaining

    def _read_tier(self, ids: np.ndarray, out: torch.Tensor) -> None:
        """Rows ``ids`` from the tier into ``out`` (uint8 ``[len(ids), row_bytes]``, on the CPU)."""
        t0 = time.perf_counter()
        self.tier.read_rows(ids, out)
        self.tier_level.record(ids.size, 0, ids.size * self._rb, time.perf_counter() - t0)

    def _read_misses(self, ids: np.ndarray, positions: np.ndarray, out: torch.Tensor) -> None:
        """Rows ``ids[positions]`` from the tier into ``out[positions]`` (``out`` on any device)."""
        buf = torch.empty((positions.size, self._rb), dtype=torch.uint8)  # [misses, row_bytes]
        self._read_tier(ids[positions], buf)
        move_rows(buf, None, out, positions)

    def _fill(self, ids: np.ndarray, out: torch.Tensor, missed: np.ndarray, served: list[_Served],
              hold: bool) -> Pins:
        """Tier rows go into the last cache; rows found in a lower cache rise into the ones
        above. Returns the pins of the filled slots (none unless ``hold``)."""
        plans: Pins = [(self.levels[-1], missed)]
        for j, below in enumerate(served[1:], start=1):
            positions = _EMPTY if below.positions is None else below.positions
            plans.extend((self.levels[above], positions) for above in range(j))
        pins = []
        for level, positions in plans:
            slots = _fill_level(level, ids, out, positions, hold)
            if hold and slots.size:
                pins.append((level, slots))
        return pins

    def _account(self, u: int, requested: int | None, seconds: float) -> None:
        with self._lock:
            self._fetches += 1
            self._requested += u if requested is None else int(requested)
            self._unique += u
            self._fetch_samples.append(seconds)

    def in_place_rows(self, layer_id: int) -> tuple[torch.Tensor, int] | None:
        """The whole table's rows and 0 on a resident tier (``memory``, ``pinned``, ``shared``),
        else None (``RowStore.in_place_rows``)."""
        self.config.layer_row_base(layer_id)  # KeyError for a layer the table lacks
        return (self.tier.rows, 0) if isinstance(self.tier, MemoryTier) else None

    # ------------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        """Zero the store's and the levels' counters (the tier's own counters run on)."""
        for level in self.levels:
            level.stats.reset()
        if self.hbm is not None:
            self.hbm.stats.reset()
        self.tier_level.reset()
        with self._lock:
            self._fetches = self._requested = self._unique = 0
            self._fetch_samples.clear()

    def stats(self) -> dict[str, Any]:
        """``{"store", "levels", "tier", "table", "table_bytes"}``, as plain values.

        store: fetches (calls of fetch, gather and read_raw), rows requested, unique rows,
        unique_ratio, hit_rate (rows served by any cache), bytes_read from the tier, fetch
        latency p50/p90/p99. levels: per cache, then the tier as the store used it: requests,
        rows, hits, misses, hit_rate, bytes_read, latency, plus capacity, policy and evictions
        for caches. tier: the tier's own counters since opening (reads issued, device bytes,
        retries, engine). The store's counters restart at ``reset_stats``.
        """
        levels = [{**lv.stats.as_dict(), **lv.describe()}
                  for lv in ([self.hbm] if self.hbm is not None else []) + self.levels]
        tier_level = self.tier_level.as_dict()
        with self._lock:
            unique, requested = self._unique, self._requested
            store = {
                "fetches": self._fetches,
                "rows_requested": requested,
                "rows_unique": unique,
                "unique_ratio": unique / requested if requested else 1.0,
                "hit_rate": 1.0 - tier_level["rows"] / unique if unique else 0.0,
                "bytes_read": tier_level["bytes_read"],
                **{f"fetch_{k}": v for k, v in percentiles_ms(self._fetch_samples).items()},
            }
        table = self.header
        return {"store": store, "levels": levels + [tier_level], "tier": self.tier.stats(),
                "table": str(table.path) if table is not None else None,
                "table_bytes": table.layout.file_bytes if table is not None else None,
                "columns": list(self.columns) if self.columns is not None else None}

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        self.closed = True
        if self._device_rows is not None:
            self._device_rows.close()  # unregisters a resident table before the tier frees it
        self.tier.close()

    def __repr__(self) -> str:
        levels = ([self.hbm] if self.hbm is not None else []) + self.levels
        names = ", ".join(f"{lv.name}:{lv.capacity:,} rows" for lv in levels) or "no cache"
        where = f"{str(self.header.path)!r}, " if self.header is not None else ""
        shard = f", columns={self.columns}" if self.columns is not None else ""
        return f"TableStore({where}[{names}] over {type(self.tier).__name__}, rows={self.num_rows:,}{shard})"


# ---------------------------------------------------------------------- fetch helpers
def _release(served: list[_Served]) -> None:
    for s in served:
        if s.slots.size:
            s.level.release(s.slots)


def _split_hits(level: RowCache, slots: np.ndarray, nhit: int, remaining: np.ndarray | None,
                u: int) -> tuple[_Served, np.ndarray]:
    """A level's ``acquire`` result over the positions ``remaining`` (None: all ``u``) ->
    what it served, and the positions still to find."""
    if nhit == slots.size:  # every row here: no masks
        return _Served(level, slots, remaining), _EMPTY
    hit = slots >= 0
    everywhere = np.arange(u) if remaining is None else remaining
    return _Served(level, slots[hit], everywhere[hit]), everywhere[~hit]


def _copy_from(level: RowCache, slots: np.ndarray, positions: np.ndarray | None, out: torch.Tensor) -> None:
    """Rows in ``level``'s pinned ``slots`` -> ``out[positions]`` (None: all of ``out``, in order)."""
    move_rows(level.data, slots, out, positions)


def _fill_level(level: RowCache, ids: np.ndarray, out: torch.Tensor | np.ndarray, positions: np.ndarray | None,
                hold: bool) -> np.ndarray:
    """Put rows ``out[positions]`` (ids ``ids[positions]``; None: every row of ``out``, ids
    ``ids``) into ``level`` where it takes them; returns the slots filled (pinned when ``hold``)."""
    asked = ids if positions is None else ids[positions]
    if asked.size == 0:
        return _EMPTY
    slots = level.reserve(asked)
    kept = slots >= 0
    if kept.all():
        rows_at = positions
    elif kept.any():
        rows_at = np.flatnonzero(kept) if positions is None else positions[kept]
        slots = slots[kept]
    else:
        return _EMPTY
    try:
        level.write(slots, out, rows_at)
    except BaseException:
        level.abandon(slots)
        raise
    level.publish(slots, keep_pinned=hold)
    return slots


@overload
def open_table(path: str | os.PathLike[str], tier: str = ..., *, cache_bytes: int | None = ..., policy: str = ...,
               fast_cache_bytes: int = ..., admission: bool | None = ..., device: str | torch.device | None = ...,
               sync: DeviceSync | None = ..., staging_bytes: int = ..., columns: Columns | None = ...,
               row_server: None = ..., **options: Any) -> TableStore | LayeredStore: ...


@overload
def open_table(path: str | os.PathLike[str], tier: Mapping[int, str], *, cache_bytes: int | None = ...,
               policy: str = ..., fast_cache_bytes: int = ..., admission: bool | None = ..., device: None = ...,
               sync: None = ..., staging_bytes: int = ..., columns: Columns | None = ..., row_server: None = ...,
               **options: Any) -> LayeredStore: ...


@overload
def open_table(path: str | os.PathLike[str], tier: str = ..., *, cache_bytes: int | None = ..., policy: str = ...,
               fast_cache_bytes: int = ..., admission: bool | None = ..., device: str | torch.device | None = ...,
               sync: DeviceSync | None = ..., staging_bytes: int = ..., columns: Columns | None = ...,
               row_server: str | os.PathLike[str], **options: Any) -> RowClient: ...


def open_table(
    path: str | os.PathLike[str],
    tier: str | Mapping[int, str] = "mmap",
    *,
    cache_bytes: int | None = None,
    policy: str = DEFAULT_POLICY,
    fast_cache_bytes: int = 0,
    admission: bool | None = None,
    device: str | torch.device | None = None,
    sync: DeviceSync | None = None,
    staging_bytes: int = STAGING_BYTES,
    columns: Columns | None = None,
    row_server: str | os.PathLike[str] | None = None,
    **options: Any,
) -> TableStore | LayeredStore | RowClient:
    """Open a table file on a tier (``memory``, ``pinned``, ``shared``, ``mmap``, ``direct``,
    ``remote``); or a checkpoint, its folder or the sidecar ``engram-offload index`` wrote, as the
    table ``convert`` would write from it (``table.checkpoint``: the rows read from its shards).
    ``shared`` is ``memory`` with one copy per machine: the first process loads
    the table into shared memory, the others attach to it read-only.

    ``remote`` reads the rows from a Redis pool the table was published to (``pool=`` its
    URL, ``fallback=`` an optional local table); ``path`` may then also be the pool URL
    ``redis://host:port[,...]/FINGERPRINT``, for a machine without the table file.

    ``options`` go to the tier (e.g. ``engine``, ``queue_depth``, ``verify_reads`` for
    ``direct``). Raises ``TableFormatError`` for a file that is not a valid table.

    ``cache_bytes`` puts a DRAM row cache of that size in front of the tier (and
    ``fast_cache_bytes`` a fast cache above it, on the GPU when there is one), evicting by
    ``policy`` (``lru`` or ``lfu``); each is capped at the table's size (at the shard's
    with ``columns``).

    ``device`` makes the store deliver rows to that device, ordered by ``sync`` (default:
    CUDA streams for a CUDA device, else immediate): the fast cache is then an HBM row cache
    on the device, a ``memory``/``pinned`` table is read in place over UVA (it is in DRAM
    already, so ``cache_bytes`` is refused), and other tiers' rows come through pinned
    staging buffers of ``staging_bytes``.

    ``columns=(c0, c1)`` (``shard_columns(config, rank, world)``): a tensor-parallel rank's
    store, serving only the rows of those columns' heads (others raise ``IndexError``); its
    caches hold those rows only. On ``memory`` or ``pinned`` it loads only those rows, a
    quarter of the table at 4 ranks: the result is a ``layered.LayeredStore`` with every layer
    on that tier (host rows, no ``device``; ``in_place_rows`` gives each layer's rows to a
    device). ``shared`` still holds the whole table, one copy a machine for every rank.

    ``row_server`` (the socket of ``rowserver.start_row_server``): connect to the machine's
    row server instead of opening the file, and return its ``RowClient`` (a ``RowStore``).
    The server owns the tier and the cache, so ``tier`` must be the server's and no cache,
    device or tier option is taken; ``columns`` still applies (checked in the client).

    ``tier`` may also place each Engram layer on its own tier: ``{1: "memory", 14: "direct"}``
    or ``"1=memory/14=direct"`` (every layer named); the result is then a ``layered.LayeredStore``
    (host rows; no ``device`` or ``row_server``; ``columns`` as above), see ``serving.layered``.
    """
    share = columns is not None and row_server is None and tier in tier_names(resident=True, private=True)
    if share or not isinstance(tier, str) or "=" in tier:  # layered.is_layered, narrowing tier
        given = [name for name, value in (("device", device), ("sync", sync), ("row_server", row_server))
                 if value is not None]
        if given:
            what = f"a rank's share of the {tier} tier" if share else "a per-layer placement"
            raise ValueError(f"{what} serves host rows from this process: drop {', '.join(given)} "
                             "(a device reads its rows in place through in_place_rows)")
        return open_layered(path, tier, TableStore, cache_bytes=cache_bytes, policy=policy, fast_cache_bytes=fast_cache_bytes,
                            admission=admission, columns=columns, **options)
    if row_server is not None:
        return _connect(path, tier, row_server, columns, cache_bytes=cache_bytes, fast_cache_bytes=fast_cache_bytes,
                        device=device, sync=sync, **options)
    if str(path).startswith("redis://"):
        if tier != "remote":
            raise ValueError(f"{path} is a pool URL: open it with tier='remote'")
        from ..tiers.remote import open_pool_table

        opened: Tier = open_pool_table(str(path), **options)
        header = opened.header
    else:
        header = read_header(path)
        opened = open_tier(tier, header, **options)
    try:
        rb, shard_size = header.layout.row_bytes, None
        if columns is not None:  # a shard never asks for more rows than it owns
            shard_size = shard_rows(header.config, columns).num_rows
            cache_bytes = capped_bytes(int(cache_bytes or 0), rb, shard_size)
            fast_cache_bytes = capped_bytes(int(fast_cache_bytes), rb, shard_size)
        device_rows = None
        if device is not None:
            device_rows = _device_rows(opened, header, torch.device(device), sync or make_sync(device),
                                       cache_bytes=int(cache_bytes or 0), fast_cache_bytes=int(fast_cache_bytes),
                                       policy=policy, admission=bool(admission), staging_bytes=staging_bytes)
            fast_cache_bytes = 0  # the HBM level is the fast one
        levels = build_levels(rb, int(cache_bytes or 0), policy, fast_cache_bytes=int(fast_cache_bytes),
                              admission=admission, num_rows=header.layout.num_rows)
    except BaseException:
        opened.close()
        raise
    return TableStore(opened, header.config, levels, header=header, device_rows=device_rows, columns=columns)


def _connect(path: str | os.PathLike[str], tier: str, row_server: str | os.PathLike[str],
             columns: Columns | None, **local: Any) -> RowClient:
    """``open_table``'s ``row_server`` branch: the machine's row server, after checking that
    nothing asks for a local tier, cache or device."""
    from .rowserver.client import RowClient

    given = sorted(name for name, value in local.items() if value)
    if given:
        raise ValueError(f"the row server owns the tier and the cache: drop {', '.join(given)} (size the "
                         "server's cache with start_row_server(..., cache_bytes=))")
    client = RowClient(row_server, table=path, columns=columns)
    if client.tier != tier:
        client.close()
        raise ValueError(f"the row server at {row_server} reads the table on the {client.tier} tier, not "
                         f"{tier}: pass tier={client.tier!r}")
    return client


def _device_rows(tier: RowSource, header: TableHeader, device: torch.device, sync: DeviceSync, *,
                 cache_bytes: int, fast_cache_bytes: int, policy: str, admission: bool,
                 staging_bytes: int) -> DeviceRows:
    """The device branch of a store: the HBM level, and the table in place or a staging ring."""
    num_rows, row_bytes = header.layout.num_rows, header.layout.row_bytes
    table = None
    # a table in DRAM is read in place where the device can (UVA coherent; read-only shared
    # pages only with read-only registration), else through pinned staging like a file tier
    if isinstance(tier, MemoryTier) and device_reads_in_place(tier.rows, device):
        if cache_bytes:
            raise ValueError(f"the {tier.name} tier holds the table in DRAM and the device reads it there: "
                             "drop cache_bytes (fast_cache_bytes sizes the HBM cache)")
        table = DeviceTable(tier.rows, device)
    hbm = None
    if fast_cache_bytes:
        capacity = capped_bytes(fast_cache_bytes, row_bytes, num_rows) // row_bytes
        sketch = FrequencySketch(max(256, 4 * capacity)) if admission else None
        try:
            hbm = HbmRowCache(table.table if table is not None else None, capacity, device=device, policy=policy,
                              sync=sync, admission=sketch, num_rows=num_rows, row_bytes=row_bytes,
                              device_map=False)  # per-step slots: no int32 [num_rows] map in HBM
        except BaseException:
            if table is not None:
                table.close()
            raise
    return DeviceRows(device=device, sync=sync, row_bytes=row_bytes, table=table, hbm=hbm,
                      staging_bytes=staging_bytes)
