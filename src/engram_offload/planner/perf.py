"""Roofline estimates of one serving step: decode step time, prefetch windows, all-reduce cost.

A decode step at ``batch`` sequences on a tensor-parallel group of ``tp`` GPUs takes the
larger of its memory time (weights the batch touches plus KV read, over HBM bandwidth) and
its compute time (2 FLOPs per active parameter per token), plus the all-reduces TP adds.
The prefetch window is the share of that time spent in the layers before the first Engram
layer (rows are requested at forward entry, so embedding and those layers hide them).
"""

from __future__ import annotations

from dataclasses import dataclass

from .assumptions import Assumptions
from .hardware import GpuSpec
from .models import ModelSpec

__all__ = ["StepTime", "decode_step", "decode_window_us", "prefill_window_us", "allreduce_us"]


@dataclass(frozen=True)
class StepTime:
    """One decode step, in microseconds."""

    memory_us: float
    compute_us: float
    comm_us: float

    @property
    def backbone_us(self) -> float:
        return max(self.memory_us, self.compute_us) + self.comm_us

    @property
    def bound(self) -> str:
        return "memory" if self.memory_us >= self.compute_us else "compute"


def allreduce_us(gpu: GpuSpec, tp: int, message_bytes: float, a: Assumptions) -> float:
    """One ring all-reduce: a fixed latency plus ``2(tp-1)/tp`` of the message over NVLink."""
    if tp <= 1:
        return 0.0
    return a.allreduce_latency_us + 2 * (tp - 1) / tp * message_bytes / gpu.nvlink_bw * 1e6


def decode_step(model: ModelSpec, gpu: GpuSpec, tp: int, batch: int, context: int,
                a: Assumptions) -> StepTime:
    """Backbone time of one decode step (Engram stall not included)."""
    kv_read = batch * context * model.kv_bytes_per_token
    if not model.kv_replicated_across_tp:
        kv_read /= tp
    weights = model.weight_bytes_touched(batch) / tp
    memory = (weights + kv_read) / (gpu.hbm_bw * a.hbm_efficiency) * 1e6
    flops = 2 * model.active_params_decode * batch / tp
    compute = flops / (gpu.peak_flops(model.compute_precision) * a.flops_efficiency) * 1e6
    message = batch * model.hidden_size * 2  # bf16 activations
    comm = model.num_layers * a.allreduces_per_layer * allreduce_us(gpu, tp, message, a)
    return StepTime(memory_us=memory, compute_us=compute, comm_us=comm)


def decode_window_us(model: ModelSpec, step: StepTime) -> float:
    """Time from forward entry to the first Engram layer in a decode step."""
    return step.backbone_us * model.first_engram_layer / model.num_layers


def prefill_window_us(model: ModelSpec, gpu: GpuSpec, tp: int, tokens: int, a: Assumptions) -> float:
    """Time of the layers before the first Engram layer for a prefill chunk of ``tokens``
    (compute-bound: 2 FLOPs per active prefill parameter per token)."""
    flops = 2 * model.active_params_prefill * tokens / tp
    total = flops / (gpu.peak_flops(model.compute_precision) * a.flops_efficiency) * 1e6
    return total * model.first_engram_layer / model.num_layers
