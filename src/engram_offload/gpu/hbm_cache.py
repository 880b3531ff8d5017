"""``HbmRowCache``: the hottest rows in device memory, the fastest level of a store with a device.

Device side: slots ``uint8 [capacity, row_bytes]`` and, unless ``device_map=False``, a slot
map ``int32 [num_rows]`` (the slot holding each table row, or -1). Without it a step's
slots (known on the host from ``lookup``) go to the kernel with the step, one per id. One step is one ``tiered_gather``: hits read their HBM
slot, misses read the table, in a single launch. The table is either the whole table in
host memory the device reads over UVA (``table``), or, for a tier that is read on the host,
the step's misses staged to the device (``read`` with a step-local slot map).

Host side: a mirror of the slot map, so admission and eviction are decided on the host by
the DRAM caches' own policies (``engram_offload.cache.policy``, optionally the admission
sketch of ``engram_offload.cache.admission``). After a step, one ``gather_raw`` of the
admitted rows (from the table, or from the step's rows already on the device) fills the
victim slots, on a fill stream that first waits for every earlier step: an HBM slot or
slot-map entry is overwritten only after the last step reading it has finished. The next
step waits for the fill. Host arrays (ids, slot maps, fill indices) reach the device through
``DeviceSync.upload``, never a blocking copy. Not thread-safe: its user serializes the calls.

The device slot map is dense (``int32 [num_rows]``: 3.07 GB of HBM for V4.1-Flash's 768 M
rows); a store's HBM level goes without it (``device_map=False``: per-step slots), and only
``gather`` with ids already on the device needs it. The host mirror is int32.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from ..cache.admission import FrequencySketch
from ..cache.policy import DEFAULT_POLICY, make_policy
from ..cache.stats import LevelStats
from ..engram.config import EngramConfig
from .kernels import gather_raw, tiered_gather
from .sync import MAIN, Access, DeviceSync, ImmediateSync

__all__ = ["HbmRowCache"]

FILL_STREAM = "hbm_fill"
MAX_PENDING = 64


class HbmRowCache:
    """Hot rows kept in ``capacity`` device slots, in front of ``table uint8 [R, row_bytes]``
    (a table the device reads) or of rows staged per step (``table=None``: give ``num_rows``
    and ``row_bytes``)."""

    def __init__(self, table: torch.Tensor | None, capacity: int, *, device: torch.device | str,
                 policy: str = DEFAULT_POLICY, sync: DeviceSync | None = None,
                 admission: FrequencySketch | None = None, num_rows: int | None = None,
                 row_bytes: int | None = None, name: str = "hbm", device_map: bool = True) -> None:
        if table is not None:
            if table.dtype != torch.uint8 or table.dim() != 2:
                raise ValueError(f"table must be packed rows uint8 [rows, row_bytes], got {table.dtype} "
                                 f"{tuple(table.shape)}")
            num_rows, row_bytes = table.shape
        elif num_rows is None or row_bytes is None:
            raise ValueError("an HBM cache without a table needs num_rows and row_bytes")
        if capacity < 1:
            raise ValueError(f"an HBM cache needs at least one slot, got capacity {capacity}")
        self.table = table
        self.name = name
        self.capacity = int(capacity)
        self.row_bytes = int(row_bytes)
        self.device = torch.device(device)
        self.sync = sync or ImmediateSync()
        self.policy = make_policy(policy, self.capacity)
        self.admission = admission
        self.stats = LevelStats(name)
        self.evictions = 0
        self.slots = torch.empty((self.capacity, self.row_bytes), dtype=torch.uint8, device=self.device)
        self.slot_of_row: torch.Tensor | None = (
            torch.full((int(num_rows),), -1, dtype=torch.int32, device=self.device) if device_map else None)
        if table is not None and table.device.type == "cpu":
            self.sync.host_mapped(table)
        self._slot_host = np.full(int(num_rows), -1, np.int32)  # host mirror of slot_of_row
        self._row_host = np.full(self.capacity, -1, np.int64)  # the row each slot holds, or -1
        made = self.sync.record(MAIN)  # the slot map's -1 fill runs on the caller's stream
        self._pending: list[object] = [made]  # events of steps not yet known to be finished
        self._fill_event: object = made

    @property
    def resident(self) -> int:
        return int((self._row_host >= 0).sum())

    def describe(self) -> dict[str, Any]:
        return {"level": self.name, "device": str(self.device), "capacity_rows": self.capacity,
                "capacity_bytes": self.capacity * self.row_bytes, "resident_rows": self.resident,
                "evictions": self.evictions, "admission": self.admission is not None,
                **self.policy.describe()}

    # ------------------------------------------------------------------ a step
    def lookup(self, unique: np.ndarray) -> np.ndarray:
        """Slots of sorted distinct ids ``[u]`` (-1: not here); the hits count as used."""
        if unique.size and (unique[0] < 0 or unique[-1] >= self._slot_host.size):
            raise IndexError(f"row ids must lie in [0, {self._slot_host.size}), got "
                             f"[{unique[0]}, {unique[-1]}]")
        slots = self._slot_host[unique].astype(np.int64)
        hit_slots = slots[slots >= 0]
        if hit_slots.size:
            self.policy.touch(hit_slots)
        return slots

    def read(self, source: torch.Tensor, slot_map: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
             hit_slots: np.ndarray, *, stream: str, config_or_format: EngramConfig | str | None = None,
             reads: Access | None = None, by_position: bool = False) -> object:
        """One ``tiered_gather`` on ``stream``: ``out[i]`` from slot ``slot_map[ids[i]]`` where it
        is >= 0, else ``source[ids[i]]``; ``hit_slots`` are the slots it reads. Waits for the
        last fill first; returns the step's event (the fill after it waits for it). Host
        ``ids`` and ``slot_map`` are uploaded on ``stream`` (a pinned ring, no blocking copy);
        ``reads`` names ``source`` for ``DeviceSync`` when it is a buffer written by other work;
        ``by_position``: ``slot_map`` holds a slot per id (a step's slots), not per table row."""
        self.sync.wait(stream, self._fill_event)
        if slot_map.device != self.device:
            slot_map = self.sync.upload(stream, slot_map.numpy(), self.device)
        if ids.device != self.device:
            ids = self.sync.upload(stream, ids.numpy(), self.device)

        def step() -> None:
            tiered_gather(source, self.slots, slot_map, ids, out, config_or_format=config_or_format,
                          slots_by_position=by_position)

        map_read = {} if by_position else {"slot_map": None}
        self.sync.run(stream, step, reads={"hbm_slots": hit_slots, **map_read, **(reads or {})})
        event = self.sync.record(stream)
        self._pending.append(event)
        if len(self._pending) > MAX_PENDING:  # many steps without a fill: forget finished ones
            self._pending = [e for e in self._pending if not self.sync.done(e)]
        return event

    def admit(self, misses: np.ndarray, protected: np.ndarray, source: torch.Tensor | None = None,
              source_ids: np.ndarray | None = None, *, ready: object = None) -> None:
        """Choose slots for this step's sorted ``misses`` (never evicting ``protected`` slots)
        and enqueue their fill from ``source``: the table (``None``), or the step's rows
        ``uint8 [u, row_bytes]`` on the device, whose row ``i`` is id ``source_ids[i]``, and
        which hold them once event ``ready`` has completed."""
        if misses.size == 0:
            return
        if self.admission is not None:
            self.admission.record(misses)
        free = np.flatnonzero(self._row_host < 0)[: misses.size]
        if free.size < misses.size and self.admission is not None:
            extra = misses[free.size:]
            misses = np.concatenate([misses[: free.size], extra[self.admission.admit(extra)]])
        evictable = self._row_host >= 0
        evictable[protected] = False  # rows this step reads stay
        victims = self.policy.victims(misses.size - free.size, evictable)
        targets = np.concatenate([free, victims]).astype(np.int64)
        admitted = misses[: targets.size]
        if targets.size == 0:
            return
        evicted = self._row_host[victims]
        self.evictions += int(victims.size)
        self._slot_host[evicted] = -1
        self.policy.remove(victims)
        self._slot_host[admitted] = targets.astype(np.int32)
        self._row_host[targets] = admitted
        self.policy.insert(targets)
        if source is None:
            if self.table is None:
                raise ValueError("this HBM cache has no table: fill it from the step's rows")
            source, rows = self.table, admitted
        else:
            assert source_ids is not None, "the step's rows come with their ids"
            rows = np.searchsorted(source_ids, admitted)  # positions of the admitted rows in source
            self.sync.keep_alive(source, FILL_STREAM)
        self._fill(source, rows, admitted, targets, evicted, ready)

    def _fill(self, source: torch.Tensor, rows: np.ndarray, admitted: np.ndarray, targets: np.ndarray,
              evicted: np.ndarray, ready: object) -> None:
        """One ``gather_raw`` of ``source[rows]`` into the slots, after every earlier step."""
        for event in [*self._pending, ready]:
            self.sync.wait(FILL_STREAM, event)
        self._pending = []  # later fills follow this one on the same stream
        k, e = admitted.size, evicted.size
        # [rows k | admitted k | targets k | evicted e], one upload
        indices = self.sync.upload(FILL_STREAM, np.concatenate([rows, admitted, targets, evicted]).astype(np.int64),
                                   self.device)

        def fill() -> None:
            rows_dev, ids_dev = indices[:k], indices[k:2 * k]
            slots_dev, evicted_dev = indices[2 * k:3 * k], indices[3 * k:3 * k + e]
            self.slots.index_copy_(0, slots_dev, gather_raw(source, rows_dev))
            if self.slot_of_row is not None:
                self.slot_of_row.index_fill_(0, evicted_dev, -1)
                self.slot_of_row.index_copy_(0, ids_dev, slots_dev.to(torch.int32))

        self.sync.run(FILL_STREAM, fill, writes={"hbm_slots": targets, "slot_map": None})
        self._fill_event = self.sync.record(FILL_STREAM)

    # ------------------------------------------------------------------ one call
    def gather(self, ids: torch.Tensor, out: torch.Tensor, *, stream: str = "main",
               config_or_format: EngramConfig | str | None = None) -> torch.Tensor:
        """Rows ``ids [n]`` of the table into ``out`` (raw ``uint8 [n, row_bytes]`` or
        dequantized, see ``tiered_gather``) on ``stream``, then admit this step's misses.

        Ids on the device are copied to the host (admission is decided there), which waits.
        """
        if self.table is None:
            raise ValueError("gather reads misses from the table; this HBM cache has none")
        start = time.perf_counter()
        if self.slot_of_row is None:
            raise ValueError("gather needs the device slot map: make the cache with device_map=True")
        ids_host = ids.detach().cpu().numpy().astype(np.int64, copy=False)
        unique = np.unique(ids_host)
        slots = self.lookup(unique)
        hit = slots >= 0
        ids_dev = self.sync.upload(stream, ids_host, self.device)  # [n]
        self.read(self.table, self.slot_of_row, ids_dev, out, slots[hit], stream=stream,
                  config_or_format=config_or_format)
        self.admit(unique[~hit], slots[hit])
        hits = int(hit[np.searchsorted(unique, ids_host)].sum()) if ids_host.size else 0
        self.stats.record(ids_host.size, hits, hits * self.row_bytes, time.perf_counter() - start)
        return out
