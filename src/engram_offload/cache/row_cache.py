"""``RowCache``: raw rows of a table held in a fixed tensor of slots, in front of a tier.

Bookkeeping (which id lives in which slot, pins, the policy, admission) happens under the
cache's lock; bytes are copied outside it. Two rules make that safe:

- A reader pins the slots it found (``acquire``) and unpins them when it has copied them
  (``release``). A pinned slot is never chosen as a victim, so no eviction can overwrite
  a row while someone reads it.
- A filler reserves slots (``reserve``): the ids enter the index at once but are marked not
  ready, so concurrent lookups treat them as misses (and read the tier themselves) while a
  second filler of the same id sees it taken. ``publish`` marks them ready.

A miss is never approximated: the cache only ever reports "here is the row" or "miss".

The hit path (look up, check ready, pin, touch the policy; and unpin) runs in one call of
the optional C helper ``cache._hitpath`` when it is built, for the built-in policies and
indexes; otherwise in NumPy. Both leave the same slots, pins and policy state (the tests
replay random interleavings through both). ``ENGRAM_OFFLOAD_NO_NATIVE=1`` forces NumPy.
One exception to "bytes outside the lock": when every id of a batch hits a CPU cache,
``acquire_into`` copies the rows within the helper's call, under the lock (a few
microseconds per thousand rows), so they need no pin for the copy.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from .._native import native_disabled
from ..buffers.rowcopy import move_rows
from .admission import FrequencySketch
from .index import DirectIndex, RowIndex, make_index
from .policy import DEFAULT_POLICY, POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy, make_policy
from .stats import LevelStats

__all__ = ["RowCache", "native_hitpath"]


# Per-slot state the hit path writes (policy stamp and count, pins), one 32-byte record per
# slot, 64-byte aligned: a hit dirties one cache line instead of one per array. With a few
# thousand random slots per step, separate arrays cost about 3x the stores of one record.
_SLOT_RECORD = np.dtype({"names": ["stamp", "count", "pins"], "formats": [np.int64, np.int64, np.int32],
                         "offsets": [0, 8, 16], "itemsize": 32})


def _slot_records(capacity: int) -> np.ndarray:
    """Zeroed ``[capacity]`` records of ``_SLOT_RECORD``, starting on a cache line."""
    raw = np.empty(capacity * _SLOT_RECORD.itemsize + 64, np.uint8)
    raw.fill(0)
    skip = -raw.ctypes.data % 64
    return raw[skip: skip + capacity * _SLOT_RECORD.itemsize].view(_SLOT_RECORD)


def native_hitpath():
    """The compiled hit-path helper, or None (not built, or switched off: ``_native.native_disabled``)."""
    if native_disabled():
        return None
    try:
        from . import _hitpath  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _hitpath


class RowCache:
    """Up to ``capacity_bytes // row_bytes`` raw rows on ``device``, evicted by ``policy``.

    ``admission=True`` adds a frequency sketch: once full, the cache takes a missed row only
    when it has been asked for at least ``admit_min`` times recently. ``evict_batch`` rows
    (default 1/64 of the capacity) are freed at a time so the O(capacity) victim search is
    paid rarely. ``num_rows`` (the table's row count) lets the id -> slot index be a plain
    array when that is no larger than a hash table (``index``: auto, direct or hash).
    """

    def __init__(
        self,
        capacity_bytes: int,
        row_bytes: int,
        policy: str | EvictionPolicy = DEFAULT_POLICY,
        *,
        device: str | torch.device = "cpu",
        admission: bool = False,
        admit_min: int = 2,
        evict_batch: int | None = None,
        name: str = "dram",
        num_rows: int | None = None,
        index: str = "auto",
    ) -> None:
        capacity = int(capacity_bytes) // int(row_bytes)
        if capacity < 1:
            raise ValueError(
                f"a cache of {capacity_bytes} bytes holds no {row_bytes}-byte row: give cache_bytes "
                f">= {row_bytes}, or 0 for no cache"
            )
        self.name = name
        self.capacity = capacity
        self.row_bytes = int(row_bytes)
        self.device = torch.device(device)
        self.data = torch.empty((capacity, row_bytes), dtype=torch.uint8, device=self.device)  # [slots, row_bytes]
        cls = POLICIES.get(policy) if isinstance(policy, str) else None
        if cls is LRUPolicy or cls is LFUPolicy:
            records = _slot_records(capacity)
            arrays = {"stamp": records["stamp"]}
            if cls is LFUPolicy:
                arrays["count"] = records["count"]
            self.policy: EvictionPolicy = make_policy(policy, capacity, **arrays)  # type: ignore[arg-type]
            self.pins = records["pins"]  # [slots] readers and fillers holding the slot
        else:
            self.policy = make_policy(policy, capacity) if isinstance(policy, str) else policy  # type: ignore[arg-type]
            self.pins = np.zeros(capacity, np.int32)  # [slots] readers and fillers holding the slot
        self.sketch = FrequencySketch(max(256, 4 * capacity), min_count=admit_min) if admission else None
        self.evict_batch = int(evict_batch or max(1, capacity // 64))
        self.index = make_index(capacity, num_rows, index)
        self.slot_id = np.full(capacity, -1, np.int64)  # [slots] row id held, -1 when free
        # [slots + 1] bytes written and visible; the extra last entry stays False, so
        # ready[-1] (slot -1: absent) reads as not ready without masking first
        self._ready = np.zeros(capacity + 1, bool)
        self.ready = self._ready[:capacity]
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # stack of free slots
        self._nfree = capacity
        self.lock = threading.Lock()
        self.stats = LevelStats(name)
        self.evictions = 0
        self.rejected = 0
        # the C hit path over this cache's arrays (None: NumPy); rows of a CPU cache as a
        # NumPy array for its row copies
        module = native_hitpath()
        self._native = self._bind_native(module)
        self._lfu = isinstance(self.policy, LFUPolicy)
        self._rows_np = self.data.numpy() if self.device.type == "cpu" and module is not None else None

    def _bind_native(self, module: Any) -> Any:
        """A ``HitPath`` over the index, pins, ready flags and policy arrays, or None when the
        helper is missing or the policy or index is not one it mirrors exactly."""
        if module is None:
            return None
        policy, index = self.policy, self.index
        if type(policy) is LRUPolicy:
            count = None
        elif type(policy) is LFUPolicy:
            count = policy.count
        else:
            return None
        if type(index) is DirectIndex:
            kind, keys, values, bits = 0, None, index.values, 0
        elif type(index) is RowIndex:
            kind, keys, values, bits = 1, index.keys, index.values, index._bits
        else:
            return None
        max_count = getattr(policy, "max_count", 0)
        return module.HitPath(kind, keys, values, bits, self._ready, self.pins, policy.stamp, count, max_count)

    @property
    def native(self) -> bool:
        """Whether the hit path runs in the C helper."""
        return self._native is not None

    # ------------------------------------------------------------------ lookups
    def acquire(self, ids: np.ndarray) -> np.ndarray:
        """Distinct ids ``[n]`` -> slots ``[n]`` (-1 for a miss); hit slots come back pinned."""
        return self.acquire_counted(ids)[0]

    def acquire_counted(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """``acquire``, plus the number of hits."""
        if self._native is None:
            slots = self._acquire_numpy(ids)
            return slots, int(np.count_nonzero(slots >= 0))
        return self._native_acquire(ids)

    @property
    def host_rows(self) -> np.ndarray:
        """The cache's rows as a NumPy array, uint8 ``[capacity, row_bytes]`` (a CPU cache)."""
        if self._rows_np is not None:
            return self._rows_np
        return self.data.numpy()

    def _native_acquire(self, ids: np.ndarray, *copy: Any) -> tuple[np.ndarray, int]:
        """The C helper's lookup + pin + touch of ``ids`` under the lock (``copy``: the rows
        array, ``out`` and ``pin`` for a lookup that also copies an all-hit batch)."""
        if ids.dtype != np.int64 or not ids.flags.c_contiguous:
            ids = np.ascontiguousarray(ids, np.int64)
        slots = np.empty(ids.shape, np.int64)
        with self.lock:
            policy = self.policy
            hits = self._native.acquire(ids.reshape(-1), slots.reshape(-1), policy.clock + 1, *copy)
            if hits:  # the policies advance the clock and age once per batch of hits
                policy.clock += 1
                if self._lfu:
                    policy._age(hits)  # type: ignore[attr-defined]
            if self.sketch is not None:
                self.sketch.record(ids)
        return slots, hits

    def acquire_into(self, ids: np.ndarray, out: np.ndarray, pin: bool = True) -> tuple[np.ndarray, int]:
        """``acquire_counted`` of 1-d ids for a CPU cache, copying the rows into ``out`` (uint8
        ``[n, row_bytes]``) when every id hits; those slots stay pinned only if ``pin``.

        When some id misses, ``out`` is left alone and the hits are pinned as ``acquire``
        pins them. With the C helper the copy happens under the cache's lock, so the rows
        need no pin while they are copied.
        """
        native = self._native
        if native is None or self._rows_np is None:
            slots, hits = self.acquire_counted(ids)
            if hits == ids.size:
                if hits:
                    self.read(slots, torch.from_numpy(out))
                if not pin:
                    self.release(slots)
            return slots, hits
        return self._native_acquire(ids, self._rows_np, out, pin)

    def _acquire_numpy(self, ids: np.ndarray) -> np.ndarray:
        with self.lock:
            slots = self.index.lookup(ids)
            hit = self._ready[slots]  # False for -1 (absent) and for slots still being filled
            if hit.all():
                found = slots
            else:
                slots[~hit] = -1
                found = slots[hit]
            if found.size:
                self.pins[found] += 1  # slots of distinct ids are distinct: no np.add.at needed
                self.policy.touch(found)
            if self.sketch is not None:
                self.sketch.record(ids)
        return slots

    def read(self, slots: np.ndarray, out: torch.Tensor) -> None:
        """Copy pinned slots ``[k]`` into ``out [k, row_bytes]`` (any device)."""
        move_rows(self.data, slots, out, None)

    def release(self, slots: np.ndarray) -> None:
        """Unpin distinct slots from ``acquire`` or ``reserve`` (-1 entries ignored)."""
        native = self._native
        if native is not None:
            if slots.dtype != np.int64 or not slots.flags.c_contiguous:
                slots = np.ascontiguousarray(slots, np.int64)
            with self.lock:
                done = native.release(slots.reshape(-1))
            if done < 0:
                raise RuntimeError(f"{self.name} cache: a slot was released more often than pinned")
            return
        slots = slots[slots >= 0]
        if slots.size == 0:
            return
        with self.lock:
            left = self.pins[slots] - 1  # the slots of one acquire or reserve are distinct
            if (left < 0).any():
                raise RuntimeError(f"{self.name} cache: a slot was released more often than pinned")
            self.pins[slots] = left

    # ------------------------------------------------------------------ fills
    def reserve(self, ids: np.ndarray) -> np.ndarray:
        """Claim slots for distinct missed ids ``[n]`` -> slots ``[n]`` (-1: not cached).

        An id is skipped when it is already cached or being filled, when admission turns it
        away, or when every slot is pinned. Claimed slots are pinned; write their bytes with
        ``write`` and then ``publish`` them.
        """
        out = np.full(ids.size, -1, np.int64)
        if ids.size == 0:
            return out
        with self.lock:
            want = np.flatnonzero(self.index.lookup(ids) < 0)
            frequency = None
            if self.sketch is not None and want.size:
                frequency = self.sketch.estimate(ids[want])
                if want.size > self._nfree:
                    ok = frequency >= self.sketch.min_count
                    # rows frequent enough, plus as many others as there are free slots
                    spare = np.flatnonzero(~ok)[: self._nfree]
                    ok[spare] = True
                    self.rejected += int(np.count_nonzero(~ok))
                    want, frequency = want[ok], frequency[ok]
            if want.size > self._nfree:
                self._evict(max(want.size - self._nfree, self.evict_batch))
            take = min(want.size, self._nfree)
            if take < want.size:
                self.rejected += want.size - take
            want = want[:take]
            if frequency is not None:
                frequency = frequency[:take]
            slots = self._free[self._nfree - take: self._nfree][::-1].copy()
            self._nfree -= take
            chosen = ids[want]
            self.slot_id[slots] = chosen
            self.pins[slots] += 1
            self.ready[slots] = False
            self.index.insert(chosen, slots)
            self.policy.insert(slots, frequency)
            out[want] = slots
        return out

    def write(self, slots: np.ndarray, rows: torch.Tensor | np.ndarray, positions: np.ndarray | None = None) -> None:
        """Bytes for reserved slots ``[k]``: rows ``uint8 [k, row_bytes]`` (a tensor, or host
        rows as a NumPy array), or with ``positions`` (``[k]``) the rows ``rows[positions]``."""
        if slots.size:
            if isinstance(rows, np.ndarray):
                if self.device.type != "cpu":
                    rows = torch.from_numpy(rows).to(self.device)
            elif rows.device != self.device:
                rows = rows.to(self.device)
            move_rows(rows, positions, self.data, slots)

    def publish(self, slots: np.ndarray, keep_pinned: bool = False) -> None:
        """Make written slots visible to lookups; unpin unless ``keep_pinned``."""
        slots = slots[slots >= 0]
        if slots.size == 0:
            return
        with self.lock:
            self.ready[slots] = True
            if not keep_pinned:
                self.pins[slots] -= 1

    def abandon(self, slots: np.ndarray) -> None:
        """Give back reserved slots whose bytes never arrived (a failed tier read)."""
        slots = slots[slots >= 0]
        if slots.size == 0:
            return
        with self.lock:
            self.pins[slots] -= 1
            self._drop(slots)

    def fill(self, ids: np.ndarray, rows: torch.Tensor) -> int:
        """Reserve, write and publish in one call; returns how many rows were cached."""
        slots = self.reserve(ids)
        kept = slots >= 0
        self.write(slots[kept], rows[torch.from_numpy(np.flatnonzero(kept))])
        self.publish(slots[kept])
        return int(np.count_nonzero(kept))

    # ------------------------------------------------------------------ eviction
    def _evict(self, count: int) -> None:
        victims = self._victims(count)
        self._drop(victims)
        self.evictions += victims.size

    def _victims(self, count: int, native: bool | None = None) -> np.ndarray:
        """The policy's ``count`` victims (int64 slots), chosen by the C helper (``native``, the
        default where it is built: NumPy's masks and partition take several times longer) or by
        the policy's NumPy path; the same slots in the same order either way."""
        if native is None:
            native = self._native is not None
        if native:
            victims = np.empty(count, np.int64)
            return victims[: self._native.victims(count, self.slot_id, victims, self.policy.score_bound())]
        return self.policy.victims(count, (self.slot_id >= 0) & (self.pins == 0))

    def _drop(self, slots: np.ndarray) -> None:
        if slots.size == 0:
            return
        self.index.remove(self.slot_id[slots])
        self.policy.remove(slots)
        self.slot_id[slots] = -1
        self.ready[slots] = False
        self._free[self._nfree: self._nfree + slots.size] = slots
        self._nfree += slots.size

    # ------------------------------------------------------------------ inspection
    def __len__(self) -> int:
        return self.capacity - self._nfree

    def __contains__(self, row_id: int) -> bool:
        num_keys = getattr(self.index, "num_keys", None)
        if row_id < 0 or (num_keys is not None and row_id >= num_keys):
            return False
        with self.lock:
            slot = int(self.index.lookup(np.array([row_id], np.int64))[0])
            return slot >= 0 and bool(self.ready[slot])

    def pinned(self) -> int:
        """Slots currently pinned by readers or fillers."""
        with self.lock:
            return int(np.count_nonzero(self.pins))

    def check(self) -> None:
        """Assert the bookkeeping is consistent (for tests)."""
        with self.lock:
            keys, slots = self.index.items()
            assert len(keys) == self.capacity - self._nfree, "index size != occupied slots"
            assert (self.slot_id[slots] == keys).all(), "index and slot table disagree"
            assert (self.pins >= 0).all(), "negative pin count"
            free = self._free[: self._nfree]
            assert (self.slot_id[free] == -1).all(), "a free slot holds a row"
            assert np.unique(free).size == free.size, "a slot is free twice"

    def describe(self) -> dict[str, Any]:
        return {
            "level": self.name,
            "device": str(self.device),
            "capacity_rows": self.capacity,
            "capacity_bytes": self.capacity * self.row_bytes,
            "resident_rows": len(self),
            "evictions": self.evictions,
            "rejected": self.rejected,
            "admission": self.sketch is not None,
            "index": type(self.index).__name__,
            **self.policy.describe(),
        }
