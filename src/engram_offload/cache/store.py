"""``CachedStore``: dedup, then row caches level by level, then the tier; statistics per level.

The levels run fastest first: a fast cache (GPU memory when there is one, else a tensor in
RAM), then a DRAM cache, then the tier behind them all. A step's ids are deduplicated once;
each level pins what it holds; only what no level holds is read from the tier, and those
rows fill the last (DRAM) cache. Rows found in a lower cache are promoted to the ones
above it: a row asked for again is a hot row.

``fetch(unique_ids, hold=True)`` returns a ``Lease`` whose pins last until it is released,
which is how a prefetcher keeps a step's rows resident while the step runs.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..config import EngramConfig
from ..dedup import dedup
from ..rows import decode_rows
from ..tiers.base import as_row_ids
from .row_cache import RowCache, native_hitpath, wide_view
from .stats import LATENCY_SAMPLES, LevelStats, percentiles_ms

__all__ = ["CachedStore", "Lease", "RowSource"]

_EMPTY = np.empty(0, np.int64)
EXPAND_RAW_FIRST = 0.75  # gather: unique/requested above this -> order raw rows, then decode


class RowSource(Protocol):
    """What a cached store reads misses from: a tier (``tiers.base.Tier``) or a fake."""

    num_rows: int
    row_bytes: int

    def read_rows(self, ids: np.ndarray, out: torch.Tensor) -> torch.Tensor: ...


class Lease:
    """Raw rows of distinct ids (``raw: uint8 [u, row_bytes]``) and the cache pins behind them.

    ``release()`` (or leaving the ``with`` block) unpins; releasing twice is harmless.
    """

    def __init__(self, ids: np.ndarray, raw: torch.Tensor, held: list[tuple[RowCache, np.ndarray]]) -> None:
        self.ids = ids
        self.raw = raw
        self._held = held
        self._lock = threading.Lock()

    @property
    def pinned_rows(self) -> int:
        return sum(int(s.size) for _, s in self._held)

    def release(self) -> None:
        if not self._held:  # nothing pinned (or already released): no lock needed
            return
        with self._lock:
            held, self._held = self._held, []
        for level, slots in held:
            level.release(slots)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a forgotten lease must not pin rows forever
        try:
            self.release()
        except Exception:
            pass


class CachedStore:
    """Rows of one table through row caches in front of a ``RowSource``. Thread-safe.

    Offers the store interface (``gather``, ``read_raw``, ``config``, ``num_rows``,
    ``row_bytes``, ``stats``, ``close``) plus ``fetch`` for prefetchers. ``inner`` is the
    uncached store the source belongs to (closed with this one; its stats are included).
    """

    def __init__(
        self,
        source: RowSource,
        config: EngramConfig,
        levels: Sequence[RowCache] = (),
        *,
        inner: Any = None,
        promote: bool = True,
    ) -> None:
        if source.row_bytes != config.row_bytes:
            raise ValueError(f"source rows are {source.row_bytes} bytes, the config's {config.row_bytes}")
        for level in levels:
            if level.row_bytes != source.row_bytes:
                raise ValueError(f"cache {level.name!r} holds {level.row_bytes}-byte rows, the table has {source.row_bytes}")
        self.source = source
        self._config = config
        self._rb = int(config.row_bytes)  # == the source's (checked above)
        self.levels = list(levels)
        self.inner = inner
        self.promote = promote
        self.device = self.levels[0].device if self.levels else torch.device("cpu")
        self.tier_stats = LevelStats("tier")
        self._lock = threading.Lock()
        self._steps = 0
        self._requested = 0
        self._unique = 0
        self._stall = 0.0
        self._stall_samples: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self._fetch_samples: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self.closed = False
        native = native_hitpath()
        self._sorted_in_range = native.sorted_in_range if native is not None else None
        self._first_into = bool(self.levels) and self.levels[0].device.type == "cpu"

    # ------------------------------------------------------------------ store interface
    @property
    def config(self) -> EngramConfig:
        return self._config

    @property
    def num_rows(self) -> int:
        return int(self.source.num_rows)

    @property
    def row_bytes(self) -> int:
        return int(self.source.row_bytes)

    def read_raw(self, row_ids: Any) -> torch.Tensor:
        """Raw rows ``uint8 [n, row_bytes]`` for ``row_ids`` (any int array-like, flattened)."""
        d = dedup(row_ids)
        raw = self._fetch(self._ends_in_range(d.unique), False, d.requested)[0]
        return wide_view(raw).index_select(0, torch.from_numpy(d.inverse).to(raw.device)).view(torch.uint8)

    def gather(self, row_ids: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized rows: ids of shape ``S`` -> ``[*S, head_dim]`` of ``dtype``.

        When a step has few repeats, the raw rows (``row_bytes`` each) are put in the step's
        order before decoding rather than the decoded ones after: fewer bytes move.
        """
        d = dedup(row_ids)
        raw = self._fetch(self._ends_in_range(d.unique), False, d.requested)[0]
        if d.unique.size >= EXPAND_RAW_FIRST * d.requested:
            raw = wide_view(raw).index_select(0, torch.from_numpy(d.inverse).to(raw.device)).view(torch.uint8)
            return self.decode(raw, dtype).reshape(*d.shape, self._config.head_dim)
        return d.expand(self.decode(raw, dtype))  # [*S, head_dim]

    def decode(self, raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Raw rows ``uint8 [n, row_bytes]`` -> ``[n, head_dim]`` of ``dtype`` (on raw's device)."""
        return decode_rows(raw, self._config.row_format, self._config.head_dim, dtype)

    # ------------------------------------------------------------------ the fetch path
    def _ends_in_range(self, ids: np.ndarray) -> np.ndarray:
        """Sorted distinct ids (from ``dedup``): only the ends need a range check."""
        if ids.size and (ids[0] < 0 or ids[-1] >= self.num_rows):
            as_row_ids(ids, self.num_rows)  # raises, naming the bad id
        return ids

    def fetch(self, unique_ids: np.ndarray, *, hold: bool = True, requested: int | None = None) -> Lease:
        """Raw rows of sorted distinct ids ``[u]`` -> ``Lease`` (``raw: uint8 [u, row_bytes]``).

        Every row comes from a cache or the tier; a tier failure raises (pins are let go
        first). With ``hold`` the rows stay pinned in their caches until the lease is
        released; without it, only while they are copied.
        """
        check = self._sorted_in_range
        if check is not None and type(unique_ids) is np.ndarray and check(unique_ids, self.num_rows):
            ids = unique_ids  # already what as_row_ids would return: int64, flat, sorted, in range
        else:
            ids = as_row_ids(unique_ids, self.num_rows, sorted_distinct=True)
        out, held = self._fetch(ids, hold, requested)
        return Lease(ids, out, held)

    def _fetch(self, ids: np.ndarray, hold: bool, requested: int | None) -> tuple[torch.Tensor, list]:
        """Raw rows ``[u, row_bytes]`` of distinct ids, and the pins held (none unless ``hold``)."""
        if self.closed:
            raise ValueError("this store is closed: open the table again")
        t_start = time.perf_counter()
        if not self.levels:
            return self._fetch_levels(ids, hold, requested, t_start, None, 0)
        first = self.levels[0]
        u = ids.size
        if self._first_into:  # a CPU cache: look up, and copy when everything hits, in one call
            buf = np.empty((u, self._rb), np.uint8)
            slots, nhit = first.acquire_into(ids, buf, hold)
            out = torch.from_numpy(buf)
            if nhit < u:
                return self._fetch_levels(ids, hold, requested, t_start, slots, nhit, out)
        else:
            slots, nhit = first.acquire_counted(ids)
            if nhit < u:
                return self._fetch_levels(ids, hold, requested, t_start, slots, nhit)
            # every row in the first cache (the common case in steady decoding): one copy,
            # no masks, no fills
            try:
                out = self._copy_all(first, slots, u)
            except BaseException:
                first.release(slots)
                raise
            if not hold:
                first.release(slots)
        t_end = time.perf_counter()
        first.stats.record(nhit, nhit, nhit * self._rb, t_end - t_start)
        for level in self.levels[1:]:
            level.stats.record(0, 0, 0, 0.0)
        self._account(ids.size, requested, t_end - t_start)
        return out, [(first, slots)] if hold else []

    def _copy_all(self, level: RowCache, slots: np.ndarray, u: int) -> torch.Tensor:
        """A new ``[u, row_bytes]`` tensor on this store's device holding ``level``'s pinned slots."""
        out = torch.empty((u, self._rb), dtype=torch.uint8, device=self.device)
        if u:
            self._copy_from(level, slots, None, out)
        return out

    def _account(self, u: int, requested: int | None, seconds: float) -> None:
        with self._lock:
            self._steps += 1
            self._requested += u if requested is None else int(requested)
            self._unique += u
            self._fetch_samples.append(seconds)

    def _fetch_levels(self, ids: np.ndarray, hold: bool, requested: int | None, t_start: float,
                      first_slots: np.ndarray | None, first_hits: int,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
        """The general path: level by level, then the tier, then fills. ``first_slots`` (with
        ``first_hits`` hits) is the first level's ``acquire`` result when it was already made;
        ``out`` the result tensor when it was already allocated."""
        u, rb = ids.size, self.row_bytes
        if out is None:
            out = torch.empty((u, rb), dtype=torch.uint8, device=self.device)  # [u, row_bytes]
        held: list[tuple[RowCache, np.ndarray]] = []
        found: list[np.ndarray | None] = []  # per level: positions (in ids) it served; None: all
        remaining: np.ndarray | None = None if u else _EMPTY  # positions no level has served yet; None: all
        try:
            for li, level in enumerate(self.levels):
                t0 = t_start if li == 0 else time.perf_counter()
                asked = ids if remaining is None else ids[remaining]
                if li == 0 and first_slots is not None:
                    slots, nhit = first_slots, first_hits
                    first_slots = None
                elif asked.size == 0:
                    found.append(remaining)
                    level.stats.record(0, 0, 0, time.perf_counter() - t0)
                    continue
                else:
                    slots, nhit = level.acquire_counted(asked)
                if nhit == asked.size:  # every row here: no masks, and no positions when it is all of them
                    hit_slots, hit_pos, left = slots, remaining, _EMPTY
                else:
                    hit = slots >= 0
                    everywhere = np.arange(u) if remaining is None else remaining
                    hit_slots, hit_pos, left = slots[hit], everywhere[hit], everywhere[~hit]
                held.append((level, hit_slots))
                if nhit:
                    self._copy_from(level, hit_slots, hit_pos, out)
                found.append(hit_pos)
                level.stats.record(asked.size, nhit, nhit * rb, time.perf_counter() - t0)
                remaining = left
            if remaining is None or remaining.size:
                t0 = time.perf_counter()
                asked = ids if remaining is None else ids[remaining]
                if remaining is None and out.device.type == "cpu":
                    self.source.read_rows(asked, out)  # no cache: straight into the result
                else:
                    buf = torch.empty((asked.size, rb), dtype=torch.uint8)  # [misses, row_bytes]
                    self.source.read_rows(asked, buf)
                    wide_view(out).index_copy_(0, torch.from_numpy(remaining).to(self.device),
                                               wide_view(buf.to(self.device)))
                self.tier_stats.record(asked.size, 0, asked.size * rb, time.perf_counter() - t0)
            if self.levels:
                assert remaining is not None
                self._fill(ids, out, remaining, found, held, hold)
        except BaseException:
            if first_slots is not None:  # acquired, but the loop failed before taking it over
                self.levels[0].release(first_slots)
            for level, slots in held:
                level.release(slots)
            raise
        if not hold:
            for level, slots in held:
                level.release(slots)
            held = []
        self._account(u, requested, time.perf_counter() - t_start)
        return out, held

    @staticmethod
    def _copy_from(level: RowCache, slots: np.ndarray, positions: np.ndarray | None, out: torch.Tensor) -> None:
        """Rows in ``level``'s pinned ``slots`` -> ``out[positions]`` (``None``: all of ``out``, in order)."""
        index = torch.from_numpy(slots).to(level.device)
        if positions is None and level.device == out.device:
            torch.index_select(wide_view(level.data), 0, index, out=wide_view(out))  # one copy, no scatter
            return
        rows = wide_view(level.data).index_select(0, index).to(out.device)
        if positions is None:
            wide_view(out).copy_(rows)
        else:
            wide_view(out).index_copy_(0, torch.from_numpy(positions).to(out.device), rows)

    def _fill(self, ids: np.ndarray, out: torch.Tensor, missed: np.ndarray, found: list[np.ndarray | None],
              held: list[tuple[RowCache, np.ndarray]], hold: bool) -> None:
        """Tier rows go into the last cache; rows found in a lower cache rise into the ones above."""
        plans: list[tuple[int, np.ndarray]] = [(len(self.levels) - 1, missed)]
        if self.promote:
            for j in range(1, len(self.levels)):
                for above in range(j):
                    plans.append((above, _EMPTY if found[j] is None else found[j]))
            # tier rows also enter the upper caches when those have room to spare
        for li, positions in plans:
            if positions.size == 0:
                continue
            level = self.levels[li]
            slots = level.reserve(ids[positions])
            kept = slots >= 0
            if not kept.any():
                continue
            slots = slots[kept]
            try:
                rows = wide_view(out).index_select(0, torch.from_numpy(positions[kept]).to(out.device)).view(torch.uint8)
                level.write(slots, rows)
            except BaseException:
                level.abandon(slots)
                raise
            level.publish(slots, keep_pinned=hold)
            if hold:
                held.append((level, slots))

    # ------------------------------------------------------------------ statistics
    def record_stall(self, seconds: float) -> None:
        """Time a consumer waited for rows (called by the prefetcher)."""
        with self._lock:
            self._stall += seconds
            self._stall_samples.append(seconds)

    def reset_stats(self) -> None:
        for level in self.levels:
            level.stats.reset()
        self.tier_stats.reset()
        with self._lock:
            self._steps = self._requested = self._unique = 0
            self._stall = 0.0
            self._stall_samples.clear()
            self._fetch_samples.clear()

    def stats(self) -> dict[str, Any]:
        """``{"store": ..., "levels": [...], "tier": ...}``: counters per level, as plain values.

        store: requests (fetches), rows requested, unique rows, unique_ratio, hit_rate (rows
        served by any cache), bytes_read from the tier, fetch latency p50/p90/p99, stall.
        levels: per cache and for the tier: requests, rows, hits, misses, hit_rate, bytes_read,
        latency p50/p90/p99, plus capacity, policy and evictions for caches.
        """
        levels = [{**lv.stats.as_dict(), **lv.describe()} for lv in self.levels]
        tier = {**self.tier_stats.as_dict(), "level": "tier"}
        with self._lock:
            unique = self._unique
            store = {
                "requests": self._steps,
                "rows_requested": self._requested,
                "rows_unique": unique,
                "unique_ratio": unique / self._requested if self._requested else 1.0,
                "hit_rate": 1.0 - tier["rows"] / unique if unique else 0.0,
                "bytes_read": tier["bytes_read"],
                "stall_seconds": self._stall,
                "stall_events": len(self._stall_samples),
                **{f"fetch_{k}": v for k, v in percentiles_ms(self._fetch_samples).items()},
                **{f"stall_{k}": v for k, v in percentiles_ms(self._stall_samples).items()},
            }
        result: dict[str, Any] = {"store": store, "levels": levels + [tier]}
        if self.inner is not None and hasattr(self.inner, "stats"):
            result["backing"] = self.inner.stats()
        return result

    def close(self) -> None:
        self.closed = True
        if self.inner is not None:
            self.inner.close()
        elif hasattr(self.source, "close"):
            self.source.close()

    def __enter__(self) -> "CachedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        names = ", ".join(f"{lv.name}:{lv.capacity:,} rows" for lv in self.levels)
        return f"CachedStore([{names}] over {type(self.source).__name__}, rows={self.num_rows:,})"


def build_levels(
    row_bytes: int,
    cache_bytes: int,
    policy: str = "lru",
    *,
    fast_cache_bytes: int = 0,
    fast_device: str | torch.device | None = None,
    admission: bool | None = None,
    num_rows: int | None = None,
) -> list[RowCache]:
    """The caches for ``cache_bytes`` of DRAM (and ``fast_cache_bytes`` of fast memory above it).

    The fast level lives on the GPU when CUDA is available (or on ``fast_device``).
    ``admission=None`` means off: on the standard-library trace at 10% of a V4.1-Flash table
    the sketch's admission lowered the hit rate slightly (LFU 60.49% -> 60.36%, LRU 59.84% ->
    59.80%; benchmarks/results/cache.json), so it is opt-in. ``num_rows`` (the table's row
    count) lets each cache index ids with a plain array when that is no larger than a hash
    table (``cache.index.make_index``).
    """
    if admission is None:
        admission = False
    levels = []
    if fast_cache_bytes:
        device = fast_device or ("cuda" if torch.cuda.is_available() else "cpu")
        levels.append(RowCache(fast_cache_bytes, row_bytes, policy, device=device, admission=admission,
                               name="fast", num_rows=num_rows))
    if cache_bytes:
        levels.append(RowCache(cache_bytes, row_bytes, policy, admission=admission, name="dram",
                               num_rows=num_rows))
    return levels
