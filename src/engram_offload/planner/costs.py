"""What the memory a placement holds the table in costs, beside the GPU-hours it saves.

A placement buys host memory for the table: ``dram`` one copy in DRAM, ``nvme`` its DRAM row
cache plus the table on NVMe (``hbm`` holds it in the GPUs' own memory, paid with their
hours; ``remote`` in a pool priced elsewhere). At the list prices of ``Assumptions``
(named and overridable) the purchase is set beside the GPU-hours of the replica: once, as
the hours it would buy, and paid off over ``hardware_years`` as dollars an hour.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .assumptions import Assumptions
from .hardware import GpuSpec
from .models import ModelSpec
from .placement import PlacementResult

__all__ = ["MemoryCost", "memory_cost", "dram_verdict"]

GiB = 2**30
HOURS_A_YEAR = 24 * 365


@dataclass(frozen=True)
class MemoryCost:
    """The host memory one replica of a placement holds the table in, and its price."""

    placement: str
    tp: int
    dram_bytes: float
    nvme_bytes: float
    dollars: float
    gpu_hours: float  # the replica's GPU-hours the same dollars buy
    dollars_per_hour: float  # paid off over the assumed years
    gpu_dollars_per_hour: float  # the replica's GPUs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def memory_cost(r: PlacementResult, model: ModelSpec, gpu: GpuSpec, a: Assumptions) -> MemoryCost:
    """The DRAM and NVMe ``r`` holds the table in, priced (see the module)."""
    table = model.engram.table_bytes
    dram = table if r.name == "dram" else r.cache_bytes_per_gpu * r.tp if r.name == "nvme" else 0.0
    nvme = table if r.name == "nvme" else 0.0
    dollars = dram / GiB * a.dram_price_per_gib + nvme / 1e12 * a.nvme_price_per_tb
    gpu_hour = gpu.price_per_hour * r.tp
    return MemoryCost(r.name, r.tp, dram, nvme, dollars, dollars / gpu_hour,
                      dollars / (a.hardware_years * HOURS_A_YEAR), gpu_hour)


def dram_verdict(model: ModelSpec, gpu: GpuSpec, a: Assumptions,
                 dram_tps: list[PlacementResult], nvme_tps: list[PlacementResult]) -> str:
    """One plain sentence: does the table simply fit in the server's DRAM, and when does
    NVMe pay (``dram_tps``/``nvme_tps``: the feasible results of each placement)."""
    table = model.engram.table_bytes
    server = gpu.host_dram_per_gpu * gpu.gpus_per_server
    usable = a.dram_usable_fraction * server
    price = table / GiB * a.dram_price_per_gib
    if table <= usable:
        best_dram = max((r.tokens_per_s_per_gpu for r in dram_tps), default=0.0)
        best_nvme = max((r.tokens_per_s_per_gpu for r in nvme_tps), default=0.0)
        than = (f" ({best_nvme:,.0f} against {best_dram:,.0f} tok/s/GPU here)" if best_nvme and best_dram else "")
        return (f"The {table / GiB:.1f} GiB table fits in this server's {server / GiB:,.0f} GiB of DRAM "
                f"({a.dram_usable_fraction:.0%} usable: {usable / GiB:,.0f} GiB), about ${price:,.0f} of DRAM at "
                f"${a.dram_price_per_gib:g}/GiB: keep it in DRAM (one copy a machine, shared by its replicas). "
                f"NVMe pays only when DRAM is short: it serves no faster{than}.")
    return (f"The {table / GiB:.1f} GiB table does not fit in this server's {server / GiB:,.0f} GiB of DRAM "
            f"({a.dram_usable_fraction:.0%} usable: {usable / GiB:,.0f} GiB): NVMe behind a DRAM cache "
            f"(the cache sizes below), or {max(0.0, table - usable) / GiB:,.0f} GiB more DRAM "
            f"(about ${max(0.0, table - usable) / GiB * a.dram_price_per_gib:,.0f} at ${a.dram_price_per_gib:g}/GiB).")
