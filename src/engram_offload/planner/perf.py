"""Roofline estimates of one serving step: step time, prefetch windows, all-reduce cost.

A step of decode and prefill tokens on a tensor-parallel group of ``tp`` GPUs takes the
larger of its memory time (weights its tokens touch plus KV read, over HBM bandwidth) and
its compute time (2 FLOPs per active parameter per token: decode and prefill tokens have
their own active counts), plus the all-reduces TP adds. A decode step is one without
prefill tokens. Layers are taken as equal shares of a step, so the time from forward
entry to an Engram layer is that layer's share (rows are requested at forward entry, so
embedding and the layers before an Engram layer hide its rows); the prefetch window is
the time before the first Engram layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .assumptions import Assumptions
from .hardware import GpuSpec
from .models import ModelSpec

__all__ = ["StepTime", "step_time", "decode_step", "layer_offsets_us", "decode_window_us", "prefill_window_us",
           "allreduce_us"]


@dataclass(frozen=True)
class StepTime:
    """One step, in microseconds."""

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


def step_time(model: ModelSpec, gpu: GpuSpec, tp: int, decode_tokens: int, prefill_tokens: int,
              kv_tokens: float, a: Assumptions) -> StepTime:
    """Backbone time of one step of ``decode_tokens`` and ``prefill_tokens`` whose attention
    reads ``kv_tokens`` tokens of KV cache in all (Engram stall not included)."""
    tokens = decode_tokens + prefill_tokens
    kv_read = kv_tokens * model.kv_bytes_per_token
    if not model.kv_replicated_across_tp:
        kv_read /= tp
    weights = model.weight_bytes_touched(tokens) / tp
    memory = (weights + kv_read) / (gpu.hbm_bw * a.hbm_efficiency) * 1e6
    flops = 2 * (model.active_params_decode * decode_tokens + model.active_params_prefill * prefill_tokens) / tp
    compute = flops / (gpu.peak_flops(model.compute_precision) * a.flops_efficiency) * 1e6
    message = tokens * model.hidden_size * 2  # bf16 activations
    comm = model.num_layers * a.allreduces_per_layer * allreduce_us(gpu, tp, message, a)
    return StepTime(memory_us=memory, compute_us=compute, comm_us=comm)


def decode_step(model: ModelSpec, gpu: GpuSpec, tp: int, batch: int, context: int,
                a: Assumptions) -> StepTime:
    """Backbone time of one decode step of ``batch`` sequences at ``context`` tokens each."""
    return step_time(model, gpu, tp, batch, 0, batch * context, a)


def layer_offsets_us(model: ModelSpec, layer_ids: tuple[int, ...] | list[int], step_us: float) -> list[float]:
    """Time from forward entry to each of ``layer_ids`` in a step of ``step_us`` (layers
    are equal shares of the step)."""
    return [step_us * layer / model.num_layers for layer in layer_ids]


def decode_window_us(model: ModelSpec, step: StepTime) -> float:
    """Time from forward entry to the first Engram layer in a decode step."""
    return layer_offsets_us(model, [model.first_engram_layer], step.backbone_us)[0]


def prefill_window_us(model: ModelSpec, gpu: GpuSpec, tp: int, tokens: int, a: Assumptions) -> float:
    """Time of the layers before the first Engram layer for a prefill chunk of ``tokens``
    (compute-bound: 2 FLOPs per active prefill parameter per token)."""
    total = step_time(model, gpu, tp, 0, tokens, 0, a).compute_us
    return layer_offsets_us(model, [model.first_engram_layer], total)[0]
