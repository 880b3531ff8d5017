"""Figures of a serving run: throughput, interactivity, latencies, stall, rows and bytes.

Definitions (as in public throughput-interactivity evaluations):

- ``throughput_tok_s``: tokens processed per second, input (prefill) and output (decode)
  together; ``output_tok_s`` counts output tokens only.
- interactivity: a user's output tokens per second, 1 / their mean inter-token latency.
  ``interactivity_tok_s_per_user`` is the median over users; ``p90_interactivity_tok_s_per_user``
  is what the slowest 10% of users get or worse (the 10th percentile of the rates).
- ``p90_itl_ms``: the 90th percentile of every inter-token latency of the run.
- ``ttft_p50_ms`` / ``ttft_p90_ms``: time to the first token of each turn (queueing included).
- ``stall_fraction``: time the Engram layers waited for rows / time of all steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .engine import EngineRun

__all__ = ["summarize_run"]


def _pct(values: list[float] | np.ndarray, q: float, scale: float = 1.0) -> float | None:
    arr = np.asarray(values, dtype=np.float64)
    return float(np.percentile(arr, q) * scale) if arr.size else None


def summarize_run(run: EngineRun) -> dict[str, Any]:
    """Plain numbers of one run (None where a figure had no samples)."""
    itl = [x for r in run.requests for x in r.itl]
    ttft = [x for r in run.requests for x in r.ttft]
    rates = [1.0 / float(np.mean(r.itl)) for r in run.requests if r.itl and np.mean(r.itl) > 0]
    step_total = float(np.sum(run.step_seconds)) if run.step_seconds else 0.0
    stall_total = float(np.sum(run.stall_seconds)) if run.stall_seconds else 0.0
    seconds = run.seconds or float("nan")
    output = sum(r.output_tokens for r in run.requests)
    return {
        "seconds": run.seconds,
        "steps": run.steps,
        "tokens": run.tokens,
        "prefill_tokens": run.prefill_tokens,
        # prefill tokens whose rows were fetched: those computed and the windows fetched ahead
        # of steps the run ended before (the tier's counters include their reads)
        "prefill_tokens_fetched": sum(run.step_fetched_prefill),
        "decode_tokens": run.decode_tokens,
        "output_tokens": output,
        "requests_started": len(run.requests),
        "requests_finished": run.finished,
        "throughput_tok_s": run.tokens / seconds,
        "output_tok_s": output / seconds,
        "interactivity_tok_s_per_user": float(np.median(rates)) if rates else None,
        "p90_interactivity_tok_s_per_user": _pct(rates, 10),
        "users_measured": len(rates),
        "p50_itl_ms": _pct(itl, 50, 1e3),
        "p90_itl_ms": _pct(itl, 90, 1e3),
        "p99_itl_ms": _pct(itl, 99, 1e3),
        "ttft_p50_ms": _pct(ttft, 50, 1e3),
        "ttft_p90_ms": _pct(ttft, 90, 1e3),
        "step_mean_ms": step_total / run.steps * 1e3 if run.steps else None,
        "step_p50_ms": _pct(run.step_seconds, 50, 1e3),
        "step_p90_ms": _pct(run.step_seconds, 90, 1e3),
        "stall_p50_ms": _pct(run.stall_seconds, 50, 1e3),
        "stall_p90_ms": _pct(run.stall_seconds, 90, 1e3),
        "stall_fraction": stall_total / step_total if step_total else 0.0,
        "rows_per_token": run.rows_requested / run.tokens if run.tokens else 0.0,
        "unique_rows_per_token": run.rows_unique / run.tokens if run.tokens else 0.0,
    }
