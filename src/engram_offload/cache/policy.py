"""Eviction policies: which cached rows to drop, kept apart from where the bytes live.

A policy sees only slot numbers. The cache tells it about hits (``touch``), new rows
(``insert``) and dropped rows (``remove``), and asks it for ``victims`` among the slots it
may evict (occupied and not pinned). Every call takes a batch of slots, so a policy works
with vector operations rather than a Python loop per row.

Policies are registered by name in ``POLICIES``; ``make_policy(name, capacity)`` builds one.
A policy's per-slot arrays may be handed in (``stamp=``, ``count=``): a row cache passes
fields of its own per-slot records, so that a hit touches one cache line, not one per array.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np

__all__ = ["DEFAULT_POLICY", "EvictionPolicy", "POLICIES", "make_policy"]


def _slot_array(given: np.ndarray | None, capacity: int, name: str) -> np.ndarray:
    """int64 ``[capacity]`` of zeros: ``given`` (zeroed in place; it may be strided) or a new one."""
    if given is None:
        return np.zeros(capacity, np.int64)
    if given.dtype != np.int64 or given.shape != (capacity,):
        raise ValueError(f"policy {name} array must be int64 [{capacity}], got {given.dtype} {given.shape}")
    given[:] = 0
    return given


class EvictionPolicy(ABC):
    """Keeps a score per slot; the lowest-scoring evictable slots are the victims."""

    name: ClassVar[str] = "policy"

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.clock = 0  # advances once per batch of accesses

    @abstractmethod
    def touch(self, slots: np.ndarray) -> None:
        """Slots that were hit (distinct)."""

    @abstractmethod
    def insert(self, slots: np.ndarray, frequency: np.ndarray | None = None) -> None:
        """Slots that received new rows; ``frequency`` is an estimate of past accesses."""

    def remove(self, slots: np.ndarray) -> None:
        """Slots whose rows were dropped (default: nothing to forget)."""

    @abstractmethod
    def scores(self) -> np.ndarray:
        """int64 ``[capacity]``: lower is evicted first."""

    def score_bound(self) -> int:
        """An upper bound on every slot's score, which the caches' C helper buckets scores by
        instead of first scanning the slots for their range; -1 where none is known."""
        return -1

    def victims(self, count: int, evictable: np.ndarray) -> np.ndarray:
        """Up to ``count`` evictable slots with the lowest scores (bool ``evictable [capacity]``):
        with ``v`` the count-th lowest score, the slots scoring below ``v``, then those scoring
        ``v`` up to ``count``, each in slot order (ties go to the lowest slots, so the choice
        is the same wherever it is made: the caches' C helper picks the same slots)."""
        candidates = np.flatnonzero(evictable)
        if count <= 0 or candidates.size == 0:
            return np.empty(0, np.int64)
        if count >= candidates.size:
            return candidates
        scores = self.scores()[candidates]
        v = np.partition(scores, count - 1)[count - 1]
        below = candidates[scores < v]
        return np.concatenate([below, candidates[scores == v][: count - below.size]])

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name}


class LRUPolicy(EvictionPolicy):
    """Least recently used: the score is the time of the last access."""

    name = "lru"

    def __init__(self, capacity: int, *, stamp: np.ndarray | None = None) -> None:
        super().__init__(capacity)
        self.stamp = _slot_array(stamp, capacity, "stamp")  # [capacity] clock at last access

    def touch(self, slots: np.ndarray) -> None:
        self.clock += 1
        self.stamp[slots] = self.clock

    def insert(self, slots: np.ndarray, frequency: np.ndarray | None = None) -> None:
        self.clock += 1
        self.stamp[slots] = self.clock

    def scores(self) -> np.ndarray:
        return self.stamp

    def score_bound(self) -> int:
        return self.clock  # stamps never pass the clock


class LFUPolicy(EvictionPolicy):
    """Least frequently used with aging; ties go to the least recently used.

    Each hit adds one to a slot's count; every ``aging_period`` hits all counts halve, so
    rows that were popular long ago make room for rows popular now. A new row starts at
    its estimated past frequency (from the admission sketch) rather than at one, so it is
    not the first to go merely for being new.
    """

    name = "lfu"
    _STAMP_BITS = 40

    def __init__(self, capacity: int, aging_period: int | None = None, max_count: int = 1 << 15, *,
                 stamp: np.ndarray | None = None, count: np.ndarray | None = None) -> None:
        super().__init__(capacity)
        self.count = _slot_array(count, capacity, "count")  # [capacity]
        self.stamp = _slot_array(stamp, capacity, "stamp")  # [capacity]
        self.aging_period = int(aging_period or max(64, 4 * capacity))
        self.max_count = max_count
        self._since_aging = 0

    def _age(self, accesses: int) -> None:
        self._since_aging += accesses
        if self._since_aging >= self.aging_period:
            self.count >>= 1
            self._since_aging = 0

    def touch(self, slots: np.ndarray) -> None:
        self.clock += 1
        self.count[slots] = np.minimum(self.count[slots] + 1, self.max_count)
        self.stamp[slots] = self.clock
        self._age(slots.size)

    def insert(self, slots: np.ndarray, frequency: np.ndarray | None = None) -> None:
        self.clock += 1
        start = np.ones(slots.size, np.int64) if frequency is None else np.clip(frequency, 1, self.max_count)
        self.count[slots] = start
        self.stamp[slots] = self.clock
        self._age(slots.size)

    def scores(self) -> np.ndarray:
        return (self.count << self._STAMP_BITS) | (self.stamp & ((1 << self._STAMP_BITS) - 1))

    def score_bound(self) -> int:
        bound = (self.max_count << self._STAMP_BITS) | ((1 << self._STAMP_BITS) - 1)  # counts never pass max_count
        return bound if bound < 1 << 63 else -1  # past int64 (a max_count of 2**23 or more): none

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name, "aging_period": self.aging_period}


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}
DEFAULT_POLICY = "lfu"  # every cache's default: a serving cache keeps the rows read often (README, bench)


def make_policy(name: str, capacity: int, **options: Any) -> EvictionPolicy:
    """A policy by name (a key of ``POLICIES``) for a cache of ``capacity`` rows."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; choose one of: {', '.join(POLICIES)}") from None
    return cls(capacity, **options)
