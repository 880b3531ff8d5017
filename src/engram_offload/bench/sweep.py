"""The benchmark sweep: every (tier, cache state, concurrency) run side by side, repeated.

Each point is one run of ``runner`` (in this process, or in a memory-capped child for the
``mmap`` baseline under a DRAM budget) or, with ``ranks`` > 1, of ``ranks`` (several rank
processes, each running ``runner.execute_run``). The repeats of a point are combined into one
entry of medians.
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import numpy as np

from .ranks import execute_ranked_run
from .runner import BenchSettings, Corpora, execute_capped_run, execute_run

__all__ = ["KEPT_PER_REPEAT", "combine_repeats", "run_sweep"]

RANKS_TIMEOUT_S = 600.0  # a run of several ranks: loading the table, then the run's own seconds


def run_sweep(settings: BenchSettings, tiers: list[str], states: list[str], concurrency: list[int],
              corpora: Corpora, token_map: np.ndarray, repeats: int = 1,
              progress: Callable[[str, int, int], Any] | None = None,
              on_step: Callable[[str, float], Any] | None = None, ranks: int = 1,
              tp: int = 1) -> list[dict[str, Any]]:
    """Every (tier, state, concurrency) ``repeats`` times, tiers side by side at each point
    (repeats outermost, so slow drift of the machine hits every tier alike); returns one
    entry per point with the median of each figure (``combine_repeats``). ``ranks`` > 1:
    each run is served by that many processes, ``tp`` to a column-split group (``bench.ranks``)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    plan = [(r, c, s, t) for r in range(repeats) for c in concurrency for s in states for t in tiers]
    raw: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for i, (r, c, s, t) in enumerate(plan):
        if progress is not None:
            progress(f"{t} {s} x{c}" + (f" (repeat {r + 1}/{repeats})" if repeats > 1 else ""), i, len(plan))
        if ranks > 1:
            timeout = RANKS_TIMEOUT_S + 4 * (settings.seconds + settings.warmup_seconds)
            result = execute_ranked_run(t, s, c, settings, corpora, token_map, ranks, tp, timeout)
        elif t == "mmap" and settings.dram_budget is not None:
            timeout = 120 + 4 * (settings.seconds + settings.warmup_seconds)
            result = execute_capped_run(t, s, c, settings, corpora, token_map, timeout)
        else:
            result = execute_run(t, s, c, settings, corpora, token_map, on_step=on_step)
        raw.setdefault((t, s, c), []).append(result)
        gc.collect()  # the last run's table copy (memory tier) goes before the next one loads
    if progress is not None:
        progress("done", len(plan), len(plan))
    return [combine_repeats(raw[(t, s, c)]) for c in concurrency for s in states for t in tiers]


KEPT_PER_REPEAT = ("throughput_tok_s", "output_tok_s", "interactivity_tok_s_per_user", "p90_itl_ms",
                   "stall_fraction", "hit_rate")


def combine_repeats(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one point -> one entry: the median of every number (None when a repeat had
    none), the first repeat's other fields, and the per-repeat values of the key figures."""
    if len(results) == 1:
        return {**results[0], "repeats": 1}
    out: dict[str, Any] = dict(results[0])
    for key, value in results[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in results if r.get(key) is not None]
            if len(values) < len(results):
                out[key] = None
            elif any(v != value for v in values):
                out[key] = float(np.median(values))  # else: the same in every repeat, kept as is
    out["repeats"] = len(results)
    out["per_repeat"] = {key: [r.get(key) for r in results] for key in KEPT_PER_REPEAT}
    return out
