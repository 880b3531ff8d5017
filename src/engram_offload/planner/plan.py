"""``make_plan``: model + hardware + workload -> every placement evaluated and a recommendation."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from .costs import MemoryCost, dram_verdict, memory_cost
from .hardware import GpuSpec
from .models import ModelSpec
from .mrc import ExtrapolatedMRC, MissRatioCurve, ZipfMRC, mrc_from_trace
from .placement import PlacementResult, Workload, evaluate, evaluate_all, evaluate_layered, layer_placements, tp_degrees
from .realtext import REAL_TEXT_TOKENS, RealTextMRC
from .recommend import Recommendation, recommend
from .server import ServerFigure

__all__ = ["Plan", "make_plan", "curve_for", "cache_sizes"]

GiB = 2**30


@dataclass
class Plan:
    model: ModelSpec
    gpu: GpuSpec
    workload: Workload
    assumptions: Assumptions
    placements: list[PlacementResult]
    recommendation: Recommendation
    server: list[ServerFigure] = field(default_factory=list)
    cache_sweep: list[PlacementResult] = field(default_factory=list)  # nvme at one TP, by cache size
    costs: list[MemoryCost] = field(default_factory=list)  # of each placement in ``placements``
    verdict: str = ""
    layered: list[PlacementResult] = field(default_factory=list)  # per-layer placements at every TP

    def to_dict(self) -> dict[str, Any]:
        e = self.model.engram
        w = self.workload
        return {
            "model": self.model.summary(),
            "gpu": {"name": self.gpu.name, "hbm_bytes": self.gpu.hbm_bytes,
                    "host_link": self.gpu.host_link, "price_per_hour": self.gpu.price_per_hour,
                    "sources": list(self.gpu.sources)},
            "server": {f.key: f.to_dict() for f in self.server},
            "assumed": [f.key for f in self.server if not f.given],
            "workload": {"context": w.context, "batch": w.batch, "gpus": w.gpus,
                         "min_interactivity": w.min_interactivity, "cache_bytes": w.cache_bytes,
                         "target_hit_rate": w.target_hit_rate, "miss_ratio_curve": w.curve_label},
            "dram_verdict": self.verdict,
            "memory_costs": [c.to_dict() for c in self.costs],
            "cache_sweep": [{"tp": r.tp, "cache_bytes": r.cache_bytes_per_gpu * r.tp,
                             "hit_rate": r.cache_hit_rate, "fits": r.fits, "batch": r.batch,
                             "stall_us": r.predicted_stall_us, "tokens_per_s_per_user": r.interactivity,
                             "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu} for r in self.cache_sweep],
            "table_bytes": e.table_bytes,
            "bytes_per_token": e.bytes_per_token,
            "bytes_per_token_per_gpu": {str(tp): e.bytes_per_token_per_gpu(tp)
                                        for tp in tp_degrees(w.gpus)},
            "placements": [r.to_dict() for r in self.placements],
            "layered_placements": [r.to_dict() for r in self.layered],
            "recommendation": self.recommendation.to_dict(),
            "assumptions": self.assumptions.to_dict(),
        }


def curve_for(model: ModelSpec, trace: np.ndarray | None = None,
              zipf: float | None = None) -> tuple[MissRatioCurve, str]:
    """The miss-ratio curve of the table's rows: from a trace of row ids, else Zipf(``zipf``)
    when given, else real text's (``planner.realtext``)."""
    e = model.engram
    if trace is not None:
        if trace.size and (trace.min() < 0 or trace.max() >= e.num_rows):
            bad = int(trace.max() if trace.max() >= e.num_rows else trace.min())
            raise ValueError(
                f"trace row id {bad} is outside the table's 0..{e.num_rows - 1}: "
                f"is the trace for {model.name}? (global row ids, layers back to back)"
            )
        curve = mrc_from_trace(trace)
        label = f"trace of {curve.trace_length:,} ids, {curve.method} LRU curve"
        touched = max(1, min(curve.distinct_ids, e.num_rows))
        if touched >= e.num_rows:
            return curve, label
        return ExtrapolatedMRC(curve, touched, e.num_rows), (
            f"{label}, measured to {touched * e.row_bytes / GiB:.1f} GiB (the rows it touched) and extrapolated "
            "to 100% at the whole table")
    heads = len(e.layer_ids) * e.cols_per_layer
    if zipf is not None:
        return ZipfMRC(zipf, max(1, e.num_rows // heads), heads), f"Zipf s={zipf:g} per head (Che approximation)"
    text = RealTextMRC(heads, e.num_rows)
    return text, (f"real text (source code, a {REAL_TEXT_TOKENS:,}-token trace), LRU curve, measured to "
                  f"{text.measured_rows * e.row_bytes / GiB:.1f} GiB and extrapolated to 100% at the whole table")


def make_plan(model: ModelSpec, gpu: GpuSpec, workload: Workload,
              objective: str = "tokens-per-gpu",
              assumptions: Assumptions = DEFAULT_ASSUMPTIONS, server: list[ServerFigure] | None = None) -> Plan:
    """Evaluate every placement and TP degree, whole-table and per layer (``Plan.layered``:
    early Engram layers in DRAM, later ones on NVMe, ...), and recommend one."""
    results = evaluate_all(model, gpu, workload, assumptions)
    layered = [evaluate_layered(model, gpu, names, tp, workload, assumptions)
               for names in layer_placements(model) for tp in tp_degrees(workload.gpus)]
    rec = recommend(model, gpu, results + layered, workload, objective, assumptions)
    nvme = [r for r in results if r.name == "nvme" and r.fits]
    sweep: list[PlacementResult] = []
    if nvme:  # the cache in front of NVMe at each size, at the nvme placement's best TP
        tp = (rec.choice.tp if rec.choice is not None and rec.choice.name == "nvme"
              else max(nvme, key=lambda r: r.tokens_per_s_per_gpu).tp)
        sweep = [evaluate(model, gpu, "nvme", tp, replace(workload, cache_bytes=size), assumptions)
                 for size in cache_sizes(model.engram.table_bytes, workload.cache_bytes)]
    costs = [memory_cost(r, model, gpu, assumptions) for r in results]
    verdict = dram_verdict(model, gpu, assumptions, [r for r in results if r.name == "dram" and r.fits], nvme)
    return Plan(model, gpu, workload, assumptions, results, rec, server=list(server or []), cache_sweep=sweep,
                costs=costs, verdict=verdict, layered=layered)


def cache_sizes(table_bytes: float, given: float | None = None) -> list[float]:
    """DRAM cache sizes to show in front of NVMe: powers of two from 16 GiB below the table,
    the whole table, and ``given``."""
    sizes = {float(2**k * GiB) for k in range(4, 60) if 2**k * GiB < table_bytes}
    sizes.add(float(table_bytes))
    if given is not None:
        sizes.add(float(min(given, table_bytes)))
    return sorted(sizes)
