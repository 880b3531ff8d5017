"""A GPU and a backbone with round numbers for the planner tests (the Engram table is a preset's)."""

from __future__ import annotations

import dataclasses

import pytest

from engram_offload.planner import Assumptions, GpuSpec, get_model
from engram_offload.planner.models import WeightGroup

GiB = 2**30
# the link, drive and layer arithmetic alone: the host CPU term is pinned in test_host_cpu.py
A = Assumptions(host_hash_us_per_step=0.0, host_hash_us_per_row=0.0, host_us_per_hit=0.0, host_us_per_miss=0.0)

GPU = GpuSpec(
    name="test GPU", hbm_bytes=100 * GiB, hbm_bw=4e12, flops={"bf16": 1e15, "fp8": 2e15}, nvlink_bw=800e9,
    host_link="test link", host_link_bw=64e9, host_dram_per_gpu=256 * GiB, gpus_per_server=8,
    nvme_drives=4, nvme_iops_per_drive=1e6, nvme_bw_per_drive=10e9, nvme_capacity_per_drive=4e12,
    price_per_hour=2.0,
)
MODEL = dataclasses.replace(
    get_model("engram-27b"), name="test model", weights=(WeightGroup("dense", 20e9, "bf16"),),
    active_params_prefill=3e9, active_params_decode=4e9, num_layers=30, kv_bytes_per_token=50_000,
    hidden_size=4096, num_experts=0, experts_per_token=0, compute_precision="bf16",
)
TABLE = MODEL.engram.table_bytes
WEIGHTS = 40e9  # 20e9 bf16 parameters


def approx(expected, **tolerance):
    """Equal up to rounding (the default 1e-6 would let a unit off by one in a million pass)."""
    return pytest.approx(expected, **({"rel": 1e-9} | tolerance))


def decode_stall(fixed_us: float, rows_us: float, step_us: float, model=MODEL) -> float:
    """A decode step's Engram stall from first principles. The rows are fetched from forward
    entry one Engram layer after another, an equal share each, the fixed cost before the
    first: layer k's rows are in at ``fixed + (k + 1) / L * rows``. The GPU reaches Engram
    layer ``l`` at ``l / num_layers`` of the step plus what it has stalled so far, so the
    step stalls by the largest lateness of any layer's rows (or not at all)."""
    layers = sorted(model.engram.layer_ids)
    late = [fixed_us + rows_us * (k + 1) / len(layers) - step_us * layer / model.num_layers
            for k, layer in enumerate(layers)]
    return max(0.0, *late)
