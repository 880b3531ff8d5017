"""``DeviceRows``: the device branch of a store's fetch; rows of distinct ids land on the device.

Three sources, fastest first, all enqueued on the fetch stream (``sync.FETCH``):

- the HBM level (``HbmRowCache``), when the store has one: hits read their device slot;
- a table the device reads in place (``DeviceTable``: a ``memory`` or ``pinned`` tier): the
  misses are read over UVA by the same launch (``tiered_gather``, or ``gather_raw`` with no
  HBM level);
- otherwise the host: the store reads the misses through its DRAM levels and the tier
  (``read_host``) straight into a pinned ``StagingRing`` buffer, a ``non_blocking`` copy
  moves each buffer to the device on the copy stream, and the fetch stream waits for its
  event. With HBM hits in the step, one ``tiered_gather`` with step-local addressing puts
  hits and staged misses in order: staged rows are rows ``[0, m)`` of the source, and rows
  ``[m, u)`` stand for the hits through a step-local slot map.

The step's misses are then admitted into the HBM level, filled from the step's rows already
on the device (never read over the link a second time). Ids, slot maps and row orders reach
the device through ``DeviceSync.upload`` (a pinned ring, ``non_blocking``): a fetch never
blocks the host on the device. Staged rows land in blocks allocated on the copy stream
that writes them and kept alive on the fetch stream that reads them (the caching allocator
orders a block's reuse only on its own stream, and waits for the streams it was kept alive
on), so the copies never wait for the fetch stream. ``close`` waits for the fetch, fill
and copy streams before the table is unregistered. Calls are serialized by a lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..cache.lease import Pins
from .device_table import DeviceTable
from .hbm_cache import FILL_STREAM, HbmRowCache
from .kernels import gather_raw
from .sync import FETCH, DeviceSync, StagingRing

__all__ = ["DeviceRows", "Delivery", "STAGING_BYTES"]

STAGING_BYTES = 16 << 20  # per staging buffer: a step's misses larger than this go in pieces
ReadHost = Callable[[np.ndarray, torch.Tensor], Pins]  # (sorted ids [m], host out uint8 [m, row_bytes]) -> pins


class Delivery(NamedTuple):
    raw: torch.Tensor  # uint8 [u, row_bytes] on the device
    pins: Pins  # host cache pins held for these rows
    ready: object  # the event after which ``raw`` holds the rows
    uva_rows: int  # misses read from host memory over UVA (none when staged)


class DeviceRows:
    """Rows of a table with ``row_bytes``-byte rows delivered to ``device`` (see the module doc)."""

    def __init__(self, *, device: torch.device | str, sync: DeviceSync, row_bytes: int,
                 table: DeviceTable | None = None, hbm: HbmRowCache | None = None,
                 staging_buffers: int = 2, staging_bytes: int = STAGING_BYTES, stream: str = FETCH) -> None:
        self.device = torch.device(device)
        self.sync = sync
        self.row_bytes = int(row_bytes)
        self.table = table
        self.hbm = hbm
        self.stream = stream
        self.ring = None if table is not None else StagingRing(
            staging_buffers, max(int(staging_bytes), self.row_bytes), device=self.device, sync=sync)
        self._lock = threading.Lock()
        self._numbers = itertools.count()  # names each fetch's staged rows for DeviceSync
        if table is not None and table.table.device.type == "cpu":
            sync.host_mapped(table.table)  # pinned or registered: the device reads it in place

    def fetch(self, ids: np.ndarray, read_host: ReadHost) -> Delivery:
        """Raw rows of sorted distinct ids ``[u]`` (u >= 1) on the device; ``read_host`` reads
        the rows no device level holds (unused with a table the device reads)."""
        with self._lock:
            return self._fetch(ids, read_host)

    def _empty(self, rows: int) -> torch.Tensor:
        """``uint8 [rows, row_bytes]`` on the device, allocated for the fetch stream."""
        return self.sync.empty(self.stream, (rows, self.row_bytes), torch.uint8, self.device)

    def _empty_staged(self, rows: int) -> torch.Tensor:
        """``uint8 [rows, row_bytes]`` allocated on the copy stream that writes it (so the
        copies need not wait for the fetch stream), kept alive on the fetch stream that reads it."""
        assert self.ring is not None
        buffer = self.sync.empty(self.ring.stream, (rows, self.row_bytes), torch.uint8, self.device)
        self.sync.keep_alive(buffer, self.stream)
        return buffer

    def _fetch(self, ids: np.ndarray, read_host: ReadHost) -> Delivery:
        start = time.perf_counter()
        u, hbm = ids.size, self.hbm
        slots = hbm.lookup(ids) if hbm is not None else np.full(u, -1, np.int64)
        hit = slots >= 0
        hit_slots = slots[hit]
        staged_only = self.table is None and hit_slots.size == 0  # the copies land in the result
        out = self._empty_staged(u) if staged_only else self._empty(u)  # [u, row_bytes]
        pins: Pins = []
        uva_rows = 0
        staged_name = f"staged_rows{next(self._numbers)}"
        if self.table is not None:  # misses over UVA, in the same launch as the hits
            uva_rows = u - hit_slots.size
            ids_t, table = self.sync.upload(self.stream, ids, self.device), self.table.table  # [u]
            if hbm is None:
                self.sync.run(self.stream, lambda: gather_raw(table, ids_t, out=out))
            elif hbm.slot_of_row is None:  # the step's slots, one per id: no dense map on the device
                step_slots = self.sync.upload(self.stream, slots, self.device)  # [u], -1 for a miss
                hbm.read(table, step_slots, ids_t, out, hit_slots, stream=self.stream, by_position=True)
            else:
                hbm.read(table, hbm.slot_of_row, ids_t, out, hit_slots, stream=self.stream)
        elif staged_only:
            pins = self._stage(ids, read_host, out, staged_name)  # straight into the result
        else:
            pins = self._stage_around_hits(ids, hit, hit_slots, read_host, out, staged_name)
        # the rows are the fetch stream's now: it has waited for every copy into them
        self.sync.run(self.stream, _hand_over, reads={staged_name: None})
        ready = self.sync.record(self.stream)
        if hbm is not None:  # filled from the rows just gathered, not over the link again
            hbm.admit(ids[~hit], hit_slots, out, ids, ready=ready)
            hbm.stats.record(u, hit_slots.size, hit_slots.size * self.row_bytes, time.perf_counter() - start)
        return Delivery(out, pins, ready, uva_rows)

    def _stage_around_hits(self, ids: np.ndarray, hit: np.ndarray, hit_slots: np.ndarray,
                           read_host: ReadHost, out: torch.Tensor, name: str) -> Pins:
        """Misses staged to rows ``[0, m)`` of a step buffer, then one ``tiered_gather`` in
        which rows ``[m, u)`` stand for the hits (a step-local slot map sends them to HBM)."""
        assert self.hbm is not None, "hits come from the HBM level"
        u, m = ids.size, ids.size - hit_slots.size
        staged = self._empty_staged(u)  # [u, row_bytes]; rows [m, u) are never read
        pins = self._stage(ids[~hit], read_host, staged[:m], name) if m else []
        try:
            source_row = np.empty(u, np.int64)  # [u] the row of `staged` each position reads
            source_row[~hit] = np.arange(m)
            source_row[hit] = np.arange(m, u)
            step_map = np.concatenate([np.full(m, -1, np.int64), hit_slots])  # [u]
            both = self.sync.upload(self.stream, np.concatenate([step_map, source_row]), self.device)  # [2u]
            self.hbm.read(staged, both[:u], both[u:], out, hit_slots, stream=self.stream, reads={name: None})
        except BaseException:
            _release(pins)
            raise
        return pins

    def _stage(self, ids: np.ndarray, read_host: ReadHost, dst: torch.Tensor, name: str) -> Pins:
        """Rows ``ids [m]`` read on the host into pinned buffers and copied into ``dst [m, row_bytes]``
        (allocated on the copy stream: ``_empty_staged``; ``name`` for ``DeviceSync``), a buffer
        at a time; the fetch stream waits for every copy."""
        assert self.ring is not None
        rb = self.row_bytes
        per_buffer = self.ring.buffer_bytes // rb
        pins: Pins = []
        try:
            for lo in range(0, ids.size, per_buffer):
                hi = min(ids.size, lo + per_buffer)

                def read_into(buffer: torch.Tensor, lo: int = lo, hi: int = hi) -> int:
                    pins.extend(read_host(ids[lo:hi], buffer[: (hi - lo) * rb].view(hi - lo, rb)))
                    return (hi - lo) * rb

                copied = self.ring.stage(read_into, dst[lo:hi].view(-1), writes={name: [lo]})
                self.sync.wait(self.stream, copied)
        except BaseException:
            _release(pins)
            raise
        return pins

    def close(self) -> None:
        """Wait for the fetch, fill and copy streams, then unregister the table the device read."""
        with self._lock:
            streams = [self.stream, FILL_STREAM] + ([self.ring.stream] if self.ring is not None else [])
            for stream in streams:
                self.sync.synchronize(self.sync.record(stream))
            if self.table is not None:
                self.sync.release_host(self.table.table)
                self.table.close()


def _hand_over() -> None:
    """No device work: marks where the fetch stream takes over the staged rows."""


def _release(pins: Pins) -> None:
    for level, slots in pins:
        level.release(slots)
