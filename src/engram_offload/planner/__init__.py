"""Placement planner: where an Engram table should live, at which tensor-parallel degree.

    models.py       ModelSpec: Engram layout + backbone facts (presets with sources)
    hardware.py     GpuSpec: HBM, host link, host DRAM, NVMe, price (presets with sources)
    server.py       the server around the GPUs: presets, a JSON file, single figures, given vs assumed
    assumptions.py  the judgement calls, in one dataclass
    mrc.py          LRU miss-ratio curves: exact stack distances, SHARDS, Zipf (reusable)
    realtext.py     real text's measured LRU hit-ratio curve (the default without a trace)
    perf.py         roofline step time and prefetch windows
    placement.py    fit, KV room, link bytes and host CPU vs window, stall, NVMe IOPS per placement
    recommend.py    ranking by objective and the reasons
    costs.py        the DRAM and NVMe a placement holds the table in, priced beside GPU-hours
    trace.py        row-id traces of real text, a corpus folder or a token log (``trace`` command)
    plan.py         make_plan: all of the above
"""

from __future__ import annotations

from .assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from .hardware import GPUS, GpuSpec, get_gpu
from .models import MODELS, ModelSpec, custom_model, get_model
from .placement import PLACEMENTS, PlacementResult, Workload, smallest_feasible_tp
from .plan import Plan, curve_for, make_plan
from .recommend import OBJECTIVES, Recommendation

__all__ = [
    "Assumptions", "DEFAULT_ASSUMPTIONS", "GPUS", "GpuSpec", "get_gpu", "MODELS", "ModelSpec",
    "custom_model", "get_model", "PLACEMENTS", "PlacementResult", "Workload",
    "smallest_feasible_tp", "Plan", "curve_for", "make_plan", "OBJECTIVES", "Recommendation",
]
