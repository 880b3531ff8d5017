"""Moved: the tier benchmark is ``engram_offload.bench.tier_bench`` (a tier imports neither the
store nor the benchmark). This name remains only until ``commands/table.py`` imports from there."""

from __future__ import annotations

from ..bench.cold import DROP_CACHES
from ..bench.tier_bench import run_tier_bench

__all__ = ["DROP_CACHES", "run_tier_bench"]
