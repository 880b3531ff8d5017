"""Replay a scan's reads (row ids and the gates they were served under) through a row cache's
eviction policy, step by step, and measure the hit rate and the share of gate mass served
from the cache.

The cache is a slot map driven exactly as ``cache.row_cache`` drives a policy: each step's
distinct rows are looked up, hits ``touch`` their slots, misses take free slots or the
policy's ``victims`` (never a slot hit in the same step) and are ``insert``-ed. A policy with
a ``credit`` method (``GateLFUPolicy``) is then told, per slot, the mean gate of its reads in
the step: one hit worth its gate, where LFU counts one per hit.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..cache.policy import EvictionPolicy

__all__ = ["simulate", "compare_policies"]


def simulate(trace_ids: np.ndarray, trace_gates: np.ndarray, num_rows: int, policy: EvictionPolicy,
             step_reads: int) -> dict[str, float]:
    """Replay ``trace_ids`` (int64 ``[reads]``) ``step_reads`` reads per step; returns
    ``{"hit_rate", "gate_share"}`` (reads served from the cache; their share of the gates)."""
    capacity = policy.capacity
    slot_of = np.full(num_rows, -1, np.int64)
    row_in = np.full(capacity, -1, np.int64)
    free = list(range(capacity - 1, -1, -1))
    credit = getattr(policy, "credit", None)
    hit_reads = 0
    hit_gate = 0.0
    for start in range(0, trace_ids.size, step_reads):
        ids, gates = trace_ids[start: start + step_reads], trace_gates[start: start + step_reads]
        unique, inverse = np.unique(ids, return_inverse=True)
        reads = np.bincount(inverse, minlength=unique.size)
        mass = np.bincount(inverse, weights=gates, minlength=unique.size) / reads  # [u] mean gate this step
        slots = slot_of[unique]
        hit = slots >= 0
        read_hit = hit[inverse]
        hit_reads += int(read_hit.sum())
        hit_gate += float(gates[read_hit].sum())
        if hit.any():
            policy.touch(slots[hit])
        missed = unique[~hit]
        if missed.size:
            want = min(missed.size, capacity)
            missed, mass_missed = missed[:want], mass[~hit][:want]
            if len(free) < want:
                evictable = row_in >= 0
                evictable[slots[hit]] = False
                victims = policy.victims(want - len(free), evictable)
                policy.remove(victims)
                slot_of[row_in[victims]] = -1
                row_in[victims] = -1
                free.extend(int(v) for v in victims)
            take = min(want, len(free))
            new_slots = np.array([free.pop() for _ in range(take)], np.int64)
            missed, mass_missed = missed[:take], mass_missed[:take]
            slot_of[missed] = new_slots
            row_in[new_slots] = missed
            policy.insert(new_slots)
            if credit is not None:
                credit(new_slots, mass_missed)
        if credit is not None and hit.any():
            credit(slots[hit], mass[hit])
    total_gate = float(trace_gates.sum())
    return {"hit_rate": hit_reads / max(1, trace_ids.size), "gate_share": hit_gate / total_gate if total_gate else 0.0}


def compare_policies(trace_ids: np.ndarray, trace_gates: np.ndarray, num_rows: int, step_reads: int,
                     policies: dict[str, Callable[[int], EvictionPolicy]],
                     fractions: tuple[float, ...] = (0.01, 0.05, 0.10, 0.20)) -> list[dict[str, float | str]]:
    """One row per (cache size as a fraction of the table, policy)."""
    out: list[dict[str, float | str]] = []
    for fraction in fractions:
        capacity = max(1, int(round(num_rows * fraction)))
        for name, make in policies.items():
            result = simulate(trace_ids, trace_gates, num_rows, make(capacity), step_reads)
            out.append({"fraction": fraction, "capacity_rows": capacity, "policy": name, **result})
    return out
