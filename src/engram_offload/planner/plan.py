"""``make_plan``: model + hardware + workload -> every placement evaluated and a recommendation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from .hardware import GpuSpec
from .models import ModelSpec
from .mrc import MissRatioCurve, ZipfMRC, mrc_from_trace
from .placement import PlacementResult, Workload, evaluate_all, tp_degrees
from .realtext import REAL_TEXT_TOKENS, RealTextMRC
from .recommend import Recommendation, recommend

__all__ = ["Plan", "make_plan", "curve_for"]



@dataclass
class Plan:
    model: ModelSpec
    gpu: GpuSpec
    workload: Workload
    assumptions: Assumptions
    placements: list[PlacementResult]
    recommendation: Recommendation

    def to_dict(self) -> dict[str, Any]:
        e = self.model.engram
        w = self.workload
        return {
            "model": self.model.summary(),
            "gpu": {"name": self.gpu.name, "hbm_bytes": self.gpu.hbm_bytes,
                    "host_link": self.gpu.host_link, "price_per_hour": self.gpu.price_per_hour,
                    "sources": list(self.gpu.sources)},
            "workload": {"context": w.context, "batch": w.batch, "gpus": w.gpus,
                         "min_interactivity": w.min_interactivity,
                         "target_hit_rate": w.target_hit_rate, "miss_ratio_curve": w.curve_label},
            "table_bytes": e.table_bytes,
            "bytes_per_token": e.bytes_per_token,
            "bytes_per_token_per_gpu": {str(tp): e.bytes_per_token_per_gpu(tp)
                                        for tp in tp_degrees(w.gpus)},
            "placements": [r.to_dict() for r in self.placements],
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
        return curve, f"trace of {curve.trace_length:,} ids, {curve.method} LRU curve"
    heads = len(e.layer_ids) * e.cols_per_layer
    if zipf is not None:
        return ZipfMRC(zipf, max(1, e.num_rows // heads), heads), f"Zipf s={zipf:g} per head (Che approximation)"
    return RealTextMRC(heads), f"real text (source code, a {REAL_TEXT_TOKENS:,}-token trace), LRU curve"


def make_plan(model: ModelSpec, gpu: GpuSpec, workload: Workload,
              objective: str = "tokens-per-gpu",
              assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> Plan:
    """Evaluate every placement and TP degree and recommend one."""
    results = evaluate_all(model, gpu, workload, assumptions)
    rec = recommend(model, gpu, results, workload, objective)
    return Plan(model, gpu, workload, assumptions, results, rec)
