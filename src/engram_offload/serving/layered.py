"""A table whose Engram layers live on different tiers: ``open_table(path, tier={1: "memory", 14: "direct"})``.

The first Engram layer of a decode step runs a fraction of a millisecond after the step's
token is known, which is shorter than one NVMe read; a later layer has milliseconds. So the
early layer's rows can sit in DRAM while the later layer's are read from the drive.

Each layer's rows are a contiguous slice of the flat row space (``config.layer_row_base``),
so a placement routes id ranges: a ``LayeredStore`` holds one ``TableStore`` per layer,
splits every fetch's sorted ids at the layer bases and puts the rows back in order. A
layer on a resident tier (``memory``, ``pinned``, ``shared``) loads only the pages of its own
slice (``window_header``): its DRAM is that slice, not the whole table. Layers on the same
non-resident tier (``mmap``, ``direct``, ``remote``) share one opened tier. The row cache
budget goes to the layers on non-resident tiers only, split in proportion to their rows (a
token asks every layer for the same number of rows).

With ``columns`` (a tensor-parallel rank's column shard, ``sharding.shard_columns``) each
layer's range is that shard's rows of the layer (``sharding.shard_rows``): a layer on a
private resident tier (``memory``, ``pinned``) loads only the pages of those rows, a
non-resident layer's caches are sized for them, and any other id raises ``IndexError``. A
``shared`` layer still loads the whole layer: one copy a machine, whichever rank attaches.
``open_table(path, "pinned", columns=...)`` is this store with every layer on ``pinned``.

A placement is a mapping ``{layer_id: tier}`` or its text form ``"1=memory/14=direct"``
(wherever a tier name is accepted); every layer of the table must be named.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from ..cache.lease import Lease, Pins, RowsInPlace
from ..cache.levels import build_levels
from ..cache.policy import DEFAULT_POLICY
from ..cache.row_cache import RowCache
from ..cache.stats import LATENCY_SAMPLES, percentiles_ms
from ..engram.config import EngramConfig
from ..table.format import TableHeader, TableLayout, read_header
from ..tiers import TIERS, Tier, get_tier_class, is_resident, open_tier
from .rowstore import RowStore
from .sharding import Columns, check_columns, require_in_shard, shard_rows

__all__ = ["LayeredStore", "Placement", "dram_bytes", "is_layered", "open_layered", "parse_placement",
           "placement_text", "window_header"]

Placement = dict[int, str]  # layer id -> tier name
LayerStore = Callable[["_LayerRows", EngramConfig, Sequence[RowCache]], Any]  # makes a layer's TableStore


def is_layered(tier: object) -> bool:
    """Whether ``tier`` is a per-layer placement (a mapping, or text with ``=``) rather than one tier name."""
    return isinstance(tier, Mapping) or (isinstance(tier, str) and "=" in tier)


def parse_placement(tier: str | Mapping[int, str], layer_ids: tuple[int, ...] | None = None) -> Placement:
    """``"1=memory/14=direct"`` or ``{1: "memory", 14: "direct"}`` -> ``{1: "memory", 14: "direct"}``.

    With ``layer_ids`` (the table's), every layer must be named and no other. ``ValueError``
    (one line) for a malformed spec, an unknown tier, a layer named twice, missing or foreign.
    """
    items: list[tuple[Any, Any]]
    if isinstance(tier, Mapping):
        items = list(tier.items())
    else:
        items = []
        for part in str(tier).split("/"):
            layer, sep, name = part.partition("=")
            if not sep:
                raise ValueError(f"placement {tier!r}: {part!r} is not LAYER=TIER (write e.g. '1=memory/14=direct')")
            items.append((layer.strip(), name.strip()))
    placement: Placement = {}
    for layer, name in items:
        try:
            layer_id = int(layer)
        except (TypeError, ValueError):
            raise ValueError(f"placement {tier!r}: layer {layer!r} is not a layer id (an integer)") from None
        if not isinstance(name, str) or name not in TIERS:
            raise ValueError(f"placement {tier!r}: unknown tier {name!r} for layer {layer_id}; "
                             f"choose one of: {', '.join(TIERS)}")
        if layer_id in placement:
            raise ValueError(f"placement {tier!r}: layer {layer_id} is named twice")
        placement[layer_id] = str(name)
    if layer_ids is not None:
        missing = [i for i in layer_ids if i not in placement]
        foreign = [i for i in placement if i not in layer_ids]
        if missing or foreign:
            what = (f"misses layer(s) {', '.join(map(str, missing))}" if missing else
                    f"names layer(s) {', '.join(map(str, foreign))} the table does not have")
            raise ValueError(f"placement {tier!r} {what}: the table's Engram layers are "
                             f"{', '.join(map(str, layer_ids))}; name every one (e.g. "
                             f"'{'/'.join(f'{i}=memory' for i in layer_ids)}')")
    return placement


def placement_text(placement: Mapping[int, str]) -> str:
    """``{1: "memory", 14: "direct"}`` -> ``"1=memory/14=direct"`` (layers in ascending order)."""
    return "/".join(f"{layer}={placement[layer]}" for layer in sorted(placement))


# ---------------------------------------------------------------------- a layer's slice of the file
@dataclass(frozen=True)
class _WindowLayout(TableLayout):
    """The layout of whole data pages ``first_page..`` of a table, seen as a table of their
    rows (``window_rows``, from row ``first_page * rows_per_page``): what a resident tier loads."""

    first_page: int = 0
    window_rows: int = 0

    @property
    def num_rows(self) -> int:
        return self.window_rows


@dataclass(frozen=True)
class _WindowHeader(TableHeader):
    first_row: int = 0  # the window's first row in the whole table

    def fingerprint(self) -> int:
        """The table's fingerprint mixed with the window: a window's shared segment is its own."""
        h = xxhash.xxh3_64(int(super().fingerprint()).to_bytes(8, "little"))
        h.update(np.array([self.first_row, self.layout.num_rows], "<i8").tobytes())
        return h.intdigest()


def window_header(header: TableHeader, start: int, end: int) -> TableHeader:
    """A header for rows ``[start, end)`` widened to whole pages: resident tiers opened on it
    load and check only those pages. The window's row ``r`` is the table's row
    ``window.first_row + r`` (``first_row`` a multiple of ``rows_per_page``)."""
    layout = header.layout
    if not 0 <= start < end <= layout.num_rows:
        raise ValueError(f"rows [{start}, {end}) are not a slice of the table's {layout.num_rows:,} rows")
    rpp = layout.rows_per_page
    first_page, end_page = start // rpp, -(-end // rpp)
    first_row = first_page * rpp
    window = _WindowLayout(layout.config, layout.data_offset + first_page * layout.page_bytes, first_page=first_page,
                           window_rows=min(end_page * rpp, layout.num_rows) - first_row)
    sums = None if header.page_sums is None else header.page_sums[first_page:end_page]
    return _WindowHeader(header.path, window, header.sums_digest, sums, first_row=first_row)


class _LayerRows:
    """One layer's rows ``[0, count)`` as rows ``[offset, offset + count)`` of ``tier`` (a
    ``RowSource`` for that layer's ``TableStore``; no tier for a shard with no rows in the
    layer); the tier is closed by the ``LayeredStore``."""

    def __init__(self, tier: Tier | None, offset: int, count: int, row_bytes: int) -> None:
        self.tier, self.offset, self.count, self.row_bytes = tier, int(offset), int(count), int(row_bytes)

    @property
    def num_rows(self) -> int:
        return self.count

    def read_rows(self, ids: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        assert self.tier is not None, "a layer without rows is never read"
        return self.tier.read_rows(ids + self.offset, out)

    def stats(self) -> dict[str, Any]:
        return {} if self.tier is None else self.tier.stats()

    def close(self) -> None:
        """The tier may serve other layers: ``LayeredStore.close`` closes it."""


# ---------------------------------------------------------------------- the store
@dataclass
class _Layer:
    layer_id: int
    tier_name: str
    base: int  # first row in the flat row space (with columns: the shard's first row of the layer)
    count: int
    store: Any  # the layer's TableStore (ids 0..count-1)
    resident: Tier | None  # the window tier this layer alone holds in DRAM
    first_row: int = 0  # the flat row id of the resident window's row 0


class LayeredStore(RowStore):
    """Rows of one table, each Engram layer through its own ``TableStore`` on its own tier
    (a ``RowStore``; see the module doc); with ``columns``, only that shard's rows. Host rows
    only. Thread-safe; a context manager."""

    def __init__(self, config: EngramConfig, header: TableHeader, layers: list[_Layer], tiers: list[Tier],
                 columns: Columns | None = None) -> None:
        super().__init__(config, config.num_rows)
        self.header = header
        self.layers = sorted(layers, key=lambda lay: lay.base)
        self._tiers = tiers  # every tier opened, each closed once
        self._bounds = np.array([lay.base for lay in self.layers[1:]], np.int64)
        self.columns = None if columns is None else check_columns(columns, config.cols_per_layer)
        self._shard = None if self.columns is None else shard_rows(config, self.columns)
        self.placement = {lay.layer_id: lay.tier_name for lay in self.layers}
        self._lock = threading.Lock()
        self._requested = 0
        self._fetches = 0
        self._fetch_samples: deque[float] = deque(maxlen=LATENCY_SAMPLES)

    @property
    def levels(self) -> list:
        """Every layer's row caches (the figures' ``cached`` test)."""
        return [level for lay in self.layers for level in lay.store.levels]

    def _lease(self, ids: np.ndarray, hold: bool, requested: int | None, in_place: bool) -> Lease:
        """Each layer's rows from its own store; the lease holds every layer's pins. ``in_place``
        as ``TableStore``'s, for ids of one layer (those of several are copied together)."""
        if self.closed:
            raise ValueError("this store is closed: open the table again")
        if self._shard is not None and self.columns is not None:
            require_in_shard(self._shard, self.columns, ids)
        t0 = time.perf_counter()
        out, pins = self._fetch_layers(ids, hold, in_place)
        with self._lock:
            self._fetches += 1
            self._requested += ids.size if requested is None else int(requested)
            self._fetch_samples.append(time.perf_counter() - t0)
        return Lease(ids, out, pins)

    def _fetch_layers(self, ids: np.ndarray, hold: bool,
                      in_place: bool) -> tuple[torch.Tensor | np.ndarray | RowsInPlace, Pins]:
        """Each layer's ids from its own store, the rows back in the ids' order."""
        cuts = [0, *np.searchsorted(ids, self._bounds).tolist(), ids.size]
        parts = [(lay, cuts[i], cuts[i + 1]) for i, lay in enumerate(self.layers) if cuts[i + 1] > cuts[i]]
        if len(parts) == 1:  # one layer: its rows as they come
            lay, a, b = parts[0]
            out, pins, _ = lay.store._fetch(ids[a:b] - lay.base, hold, None, in_place)
            return out, pins
        out = torch.empty((ids.size, self._rb), dtype=torch.uint8)  # [u, row_bytes]
        dest = out.numpy()
        pins = []
        try:
            for lay, a, b in parts:
                rows, got, _ = lay.store._fetch(ids[a:b] - lay.base, hold, None)
                pins.extend(got)
                dest[a:b] = rows if isinstance(rows, np.ndarray) else rows.numpy()
        except BaseException:
            Lease(ids, out, pins).release()
            raise
        return out, pins

    def in_place_rows(self, layer_id: int) -> tuple[torch.Tensor, int] | None:
        """A resident layer's window rows ``uint8 [R, row_bytes]`` and the flat row id of its row
        0 (``RowStore.in_place_rows``); None for a layer on a non-resident tier."""
        lay = next((lay for lay in self.layers if lay.layer_id == layer_id), None)
        if lay is None:
            raise KeyError(f"layer {layer_id} is not an Engram layer; Engram layers: {list(self.config.layer_ids)}")
        return None if lay.resident is None else (lay.resident.rows, lay.first_row)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        for lay in self.layers:
            lay.store.reset_stats()
        with self._lock:
            self._requested = self._fetches = 0
            self._fetch_samples.clear()

    def stats(self) -> dict[str, Any]:
        """``TableStore.stats``'s keys over the whole table, plus ``layers`` (per layer: its
        tier, rows, DRAM and its own store's stats) and ``placement``.

        ``store.hit_rate`` is the share of distinct rows read from no drive or pool: rows of
        resident layers count as hits. ``levels`` lists every layer's levels, named
        ``L<layer>:<level>``; ``tier`` sums the counters of every tier opened.
        """
        per_layer: dict[str, Any] = {}
        levels: list[dict[str, Any]] = []
        unique = device_rows = bytes_read = 0
        for lay in self.layers:
            s = lay.store.stats()
            per_layer[str(lay.layer_id)] = {"tier": lay.tier_name, "row_base": lay.base, "rows": lay.count,
                                            "dram_bytes": _layer_dram(lay), **s}
            levels.extend({**lv, "level": f"L{lay.layer_id}:{lv['level']}"} for lv in s["levels"])
            unique += s["store"]["rows_unique"]
            bytes_read += s["store"]["bytes_read"]
            if lay.resident is None:
                device_rows += s["levels"][-1]["rows"]
        tier: dict[str, Any] = {"tier": placement_text(self.placement)}
        for t in self._tiers:
            for key, value in t.stats().items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "queue_depth":
                    tier[key] = tier.get(key, 0) + value
        with self._lock:
            requested, fetches = self._requested, self._fetches
            latency = {f"fetch_{k}": v for k, v in percentiles_ms(self._fetch_samples).items()}
        store = {"fetches": fetches, "rows_requested": requested, "rows_unique": unique,
                 "unique_ratio": unique / requested if requested else 1.0,
                 "hit_rate": 1.0 - device_rows / unique if unique else 0.0, "bytes_read": bytes_read, **latency}
        return {"store": store, "levels": levels, "tier": tier, "layers": per_layer,
                "placement": placement_text(self.placement), "table": str(self.header.path),
                "table_bytes": self.header.layout.file_bytes, "dram_bytes": dram_bytes(self),
                "columns": None if self.columns is None else list(self.columns)}

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        self.closed = True
        for lay in self.layers:
            lay.store.close()
        for t in self._tiers:
            t.close()

    def __repr__(self) -> str:
        shard = f", columns={self.columns}" if self.columns is not None else ""
        return f"LayeredStore({str(self.header.path)!r}, {placement_text(self.placement)}, rows={self.num_rows:,}{shard})"


def _layer_dram(lay: _Layer) -> int:
    held = sum(level.capacity * level.row_bytes for level in lay.store.levels if level.device.type == "cpu")
    if lay.resident is not None:
        held += lay.resident.num_rows * lay.resident.row_bytes
    return int(held)


def dram_bytes(store: Any) -> int:
    """The DRAM a store holds: a resident tier's rows (a layered store's: its layers' slices, a
    rank's share: its columns' pages), its host row caches and, with a device, its staging buffers."""
    if isinstance(store, LayeredStore):
        return sum(_layer_dram(lay) for lay in store.layers)
    held = sum(level.capacity * level.row_bytes for level in getattr(store, "levels", ())
               if level.device.type == "cpu")
    tier = getattr(store, "tier", None)
    if tier is not None and getattr(tier, "name", "") in TIERS and is_resident(tier.name):
        held += tier.num_rows * tier.row_bytes
    device_rows = getattr(store, "_device_rows", None)
    if device_rows is not None:
        held += int(getattr(device_rows, "staging_bytes", 0) or 0)
    return int(held)


# ---------------------------------------------------------------------- opening
def _tier_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options tier ``name`` takes (each tier its own: ``queue_depth`` is ``direct``'s)."""
    params = inspect.signature(get_tier_class(name).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in params}


def open_layered(path: Any, tier: str | Mapping[int, str], layer_store: LayerStore, *, cache_bytes: int | None = None,
                 policy: str = DEFAULT_POLICY, fast_cache_bytes: int = 0, admission: bool | None = None,
                 columns: Columns | None = None, **options: Any) -> LayeredStore:
    """Open ``path`` with each Engram layer on the tier ``tier`` names (a placement, or one tier
    name for every layer), serving only the rows of ``columns`` when given (see the module doc);
    ``open_table`` calls it, with ``layer_store`` its ``TableStore`` class (each layer's store
    over that layer's rows, config and caches). ``options`` go to the tiers that take them."""
    if str(path).startswith("redis://"):
        raise ValueError("a per-layer placement or a rank's share of a resident tier loads slices of the table "
                         "file: pass its path, and the pool as pool=")
    header = read_header(path)
    config = header.config
    placement = parse_placement(tier if is_layered(tier) else {i: str(tier) for i in config.layer_ids},
                                config.layer_ids)
    unused = [k for k in options if not any(k in _tier_options(n, {k: 1}) for n in set(placement.values()))]
    if unused:
        raise ValueError(f"no tier of placement {placement_text(placement)} takes option(s) {', '.join(unused)}")
    rows = config.rows_per_layer
    whole = {i: (config.layer_row_base(i), config.layer_row_base(i) + rows[i]) for i in config.layer_ids}
    spans = whole if columns is None else dict(zip(config.layer_ids, shard_rows(config, columns).ranges.tolist()))
    cached_rows = sum(hi - lo for i, (lo, hi) in spans.items() if not is_resident(placement[i]))
    tiers: list[Tier] = []
    shared: dict[str, Tier] = {}  # non-resident tiers, one per name
    layers: list[_Layer] = []
    try:
        for layer_id in config.layer_ids:
            name, (lo, hi) = placement[layer_id], spans[layer_id]
            opened: Tier | None
            resident: Tier | None = None
            levels: list[RowCache] = []
            first_row = 0
            if lo == hi:  # a rank past the last column: no rows of this layer to hold or read
                opened, offset = None, 0
            elif is_resident(name):  # a private tier loads the range's pages; shared, the whole layer's
                window = window_header(header, *((lo, hi) if TIERS[name].private else whole[layer_id]))
                opened = resident = open_tier(name, window, **_tier_options(name, options))
                tiers.append(opened)
                first_row = window.first_row  # type: ignore[attr-defined]
                offset = lo - first_row
            else:
                if name not in shared:
                    shared[name] = open_tier(name, header, **_tier_options(name, options))
                    tiers.append(shared[name])
                opened, offset = shared[name], lo
                share = (hi - lo) / cached_rows
                levels = build_levels(config.row_bytes, int((cache_bytes or 0) * share), policy,
                                      fast_cache_bytes=int(fast_cache_bytes * share), admission=admission,
                                      num_rows=hi - lo)
            source = _LayerRows(opened, offset, hi - lo, config.row_bytes)
            layers.append(_Layer(layer_id, name, lo, hi - lo, layer_store(source, config, levels), resident, first_row))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return LayeredStore(config, header, layers, tiers, columns)
