"""A gate-aware eviction policy: LFU with aging where a hit counts what it was worth.

An Engram row's value to the model is its gate when read: a row read often under a gate near
zero changes little, a rarer row under a strong gate changes a lot. ``GateLFUPolicy`` keeps
``LFUPolicy``'s aged counts and tie-breaking by recency, but a slot's count grows by the gate
its reads were served under (``credit``, in units of ``1/GATE_UNITS``), not by one per hit.
Gates are known only after the read (the gate needs the row), so the serving loop credits
them afterwards; without credits the counts stay at zero and the policy evicts by recency.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .policy import LFUPolicy

__all__ = ["GateLFUPolicy", "GATE_UNITS"]

GATE_UNITS = 256  # a gate of 1.0 adds 256 to the count


class GateLFUPolicy(LFUPolicy):
    """Evicts the slots with the least aged gate mass (ties: least recently used)."""

    name = "gate-lfu"

    def __init__(self, capacity: int, aging_period: int | None = None, *, stamp: np.ndarray | None = None,
                 count: np.ndarray | None = None) -> None:
        super().__init__(capacity, aging_period, max_count=1 << 22, stamp=stamp, count=count)

    def touch(self, slots: np.ndarray) -> None:
        self.clock += 1
        self.stamp[slots] = self.clock
        self._age(slots.size)

    def insert(self, slots: np.ndarray, frequency: np.ndarray | None = None) -> None:
        self.clock += 1
        self.count[slots] = 0
        self.stamp[slots] = self.clock
        self._age(slots.size)

    def credit(self, slots: np.ndarray, gate_mass: np.ndarray) -> None:
        """Add the gate mass ``slots`` (distinct) served since the last credit: float ``[n]``."""
        units = np.rint(np.asarray(gate_mass, np.float64) * GATE_UNITS).astype(np.int64)
        self.count[slots] = np.minimum(self.count[slots] + units, self.max_count)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "gate_units": GATE_UNITS}
