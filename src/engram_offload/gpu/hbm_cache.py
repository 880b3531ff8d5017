"""``HbmRowCache``: the hottest rows in device memory, in front of a table the GPU reads over UVA.

Device side: slots ``uint8 [capacity, row_bytes]`` and a slot map ``int32 [num_rows]`` (the
slot holding each table row, or -1). One step is one ``tiered_gather``: hits read their HBM
slot, misses read the table, in a single launch.

Host side: a mirror of the slot map, so admission and eviction are decided on the host by
the DRAM caches' own policies (``engram_offload.cache.policy``, optionally the admission
sketch of ``engram_offload.cache.admission``). After a step, one ``gather_raw`` of the
admitted rows from the table fills the victim slots, on a fill stream that first waits for
every earlier step: an HBM slot or slot-map entry is overwritten only after the last step
reading it has finished. The next step waits for the fill.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..cache.admission import FrequencySketch
from ..cache.policy import make_policy
from ..cache.stats import LevelStats
from ..config import EngramConfig
from .kernels import gather_raw, tiered_gather
from .sync import DeviceSync, ImmediateSync

__all__ = ["HbmRowCache"]

FILL_STREAM = "hbm_fill"
MAX_PENDING = 64


class HbmRowCache:
    """Hot rows of ``table uint8 [R, row_bytes]`` kept in ``capacity`` device slots."""

    def __init__(self, table: torch.Tensor, capacity: int, *, device: torch.device | str,
                 policy: str = "lru", sync: DeviceSync | None = None,
                 admission: FrequencySketch | None = None) -> None:
        if table.dtype != torch.uint8 or table.dim() != 2:
            raise ValueError(f"table must be packed rows uint8 [rows, row_bytes], got {table.dtype} "
                             f"{tuple(table.shape)}")
        if capacity < 1:
            raise ValueError(f"an HBM cache needs at least one slot, got capacity {capacity}")
        num_rows, row_bytes = table.shape
        self.table = table
        self.capacity = int(capacity)
        self.device = torch.device(device)
        self.sync = sync or ImmediateSync()
        self.policy = make_policy(policy, self.capacity)
        self.admission = admission
        self.stats = LevelStats("hbm")
        self.slots = torch.empty((self.capacity, row_bytes), dtype=torch.uint8, device=self.device)
        self.slot_of_row = torch.full((num_rows,), -1, dtype=torch.int32, device=self.device)
        self._slot_host = np.full(num_rows, -1, np.int64)  # host mirror of slot_of_row
        self._row_host = np.full(self.capacity, -1, np.int64)  # the row each slot holds, or -1
        self._pending: list[object] = []  # events of steps not yet known to be finished
        self._fill_event: object = None

    @property
    def resident(self) -> int:
        return int((self._row_host >= 0).sum())

    def gather(self, ids: torch.Tensor, out: torch.Tensor, *, stream: str = "main",
               config_or_format: EngramConfig | str | None = None) -> torch.Tensor:
        """Rows ``ids [n]`` into ``out`` (raw ``uint8 [n, row_bytes]`` or dequantized, see
        ``tiered_gather``) on ``stream``, then admit this step's misses.

        Ids on the device are copied to the host (admission is decided there), which waits.
        """
        start = time.perf_counter()
        ids_host = ids.detach().cpu().numpy().astype(np.int64, copy=False)
        if ids_host.size and (ids_host.min() < 0 or ids_host.max() >= self._slot_host.size):
            raise IndexError(f"row ids must lie in [0, {self._slot_host.size}), got "
                             f"[{ids_host.min()}, {ids_host.max()}]")
        unique = np.unique(ids_host)
        slots = self._slot_host[unique]
        hit = slots >= 0
        hit_slots = slots[hit]
        if hit_slots.size:
            self.policy.touch(hit_slots)

        self.sync.wait(stream, self._fill_event)
        ids_dev = torch.from_numpy(ids_host).to(out.device)

        def step() -> None:
            tiered_gather(self.table, self.slots, self.slot_of_row, ids_dev, out,
                          config_or_format=config_or_format)

        self.sync.run(stream, step, reads={"hbm_slots": hit_slots, "slot_map": None})
        self._pending.append(self.sync.record(stream))
        if len(self._pending) > MAX_PENDING:  # many steps without a fill: forget finished ones
            self._pending = [e for e in self._pending if not self.sync.done(e)]
        self._admit(unique[~hit], hit_slots)
        hits = int(hit[np.searchsorted(unique, ids_host)].sum()) if ids_host.size else 0
        self.stats.record(ids_host.size, hits, (ids_host.size - hits) * self.table.shape[1],
                          time.perf_counter() - start)
        return out

    def _admit(self, misses: np.ndarray, protected: np.ndarray) -> None:
        """Choose the slots for this step's misses and enqueue their fill."""
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
        self._slot_host[evicted] = -1
        self.policy.remove(victims)
        self._slot_host[admitted] = targets
        self._row_host[targets] = admitted
        self.policy.insert(targets)
        self._fill(admitted, targets, evicted)

    def _fill(self, admitted: np.ndarray, targets: np.ndarray, evicted: np.ndarray) -> None:
        """One ``gather_raw`` of the admitted rows into their slots, after every earlier step."""
        for event in self._pending:
            self.sync.wait(FILL_STREAM, event)
        self._pending = []  # later fills follow this one on the same stream
        device = self.device

        def fill() -> None:
            rows_dev = torch.from_numpy(admitted).to(device)
            slots_dev = torch.from_numpy(targets).to(device)
            self.slots.index_copy_(0, slots_dev, gather_raw(self.table, rows_dev))
            self.slot_of_row.index_fill_(0, torch.from_numpy(evicted).to(device), -1)
            self.slot_of_row.index_copy_(0, rows_dev, slots_dev.to(torch.int32))

        self.sync.run(FILL_STREAM, fill, writes={"hbm_slots": targets, "slot_map": None})
        self._fill_event = self.sync.record(FILL_STREAM)
