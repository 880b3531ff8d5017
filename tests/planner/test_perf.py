"""Roofline step time, all-reduce cost and prefetch windows, term by term."""

from __future__ import annotations

import dataclasses

import pytest

from engram_offload.planner.models import WeightGroup
from engram_offload.planner.perf import StepTime, allreduce_us, decode_step, decode_window_us, prefill_window_us

from made_up import GPU, MODEL, A, approx


def test_step_time_is_the_slower_of_memory_and_compute_plus_communication():
    assert StepTime(10.0, 4.0, 1.0).backbone_us == 11.0
    assert StepTime(4.0, 10.0, 1.0).backbone_us == 11.0
    assert StepTime(10.0, 4.0, 0.0).bound == "memory"
    assert StepTime(4.0, 10.0, 0.0).bound == "compute"
    assert StepTime(5.0, 5.0, 0.0).bound == "memory"


def test_allreduce_is_a_latency_plus_a_ring_over_nvlink():
    assert allreduce_us(GPU, 1, 1e9, A) == 0.0
    assert allreduce_us(GPU, 2, 8e8, A) == approx(A.allreduce_latency_us + 2 * 1 / 2 * 8e8 / 800e9 * 1e6)
    assert allreduce_us(GPU, 8, 8e8, A) == approx(A.allreduce_latency_us + 2 * 7 / 8 * 8e8 / 800e9 * 1e6)


@pytest.mark.parametrize("replicated", [True, False])
def test_decode_step_terms(replicated):
    model = dataclasses.replace(MODEL, kv_replicated_across_tp=replicated)
    tp, batch, context = 4, 16, 2048
    step = decode_step(model, GPU, tp, batch, context, A)
    kv = batch * context * 50_000 / (1 if replicated else tp)
    assert step.memory_us == approx((40e9 / tp + kv) / (4e12 * A.hbm_efficiency) * 1e6)
    assert step.compute_us == approx(2 * 4e9 * batch / tp / (1e15 * A.flops_efficiency) * 1e6)
    message = batch * 4096 * 2
    assert step.comm_us == approx(30 * A.allreduces_per_layer * allreduce_us(GPU, tp, message, A))


def test_decode_reads_only_the_experts_the_batch_selects():
    moe = dataclasses.replace(MODEL, weights=(WeightGroup("experts", 16e9, "bf16", routed=True),
                                              WeightGroup("dense", 4e9, "bf16")),
                              num_experts=64, experts_per_token=4)
    step = decode_step(moe, GPU, 1, 1, 1, A)
    touched = 8e9 + 32e9 * 4 / 64
    assert step.memory_us == approx((touched + 50_000) / (4e12 * A.hbm_efficiency) * 1e6)


def test_compute_falls_back_to_a_wider_precision():
    fp4, fp8 = (dataclasses.replace(MODEL, compute_precision=p) for p in ("fp4", "fp8"))
    assert decode_step(fp4, GPU, 1, 8, 1, A).compute_us == decode_step(fp8, GPU, 1, 8, 1, A).compute_us
    assert decode_step(fp8, GPU, 1, 8, 1, A).compute_us == decode_step(MODEL, GPU, 1, 8, 1, A).compute_us / 2


def test_windows_are_the_share_of_layers_before_the_first_engram_layer():
    step = StepTime(300.0, 100.0, 30.0)
    first = MODEL.first_engram_layer
    assert decode_window_us(MODEL, step) == approx(330.0 * first / 30)
    flops = 2 * 3e9 * 8192 / 2  # prefill counts the prefill active parameters
    assert prefill_window_us(MODEL, GPU, 2, 8192, A) == approx(
        flops / (1e15 * A.flops_efficiency) * 1e6 * first / 30)


def test_prefill_window_uses_the_models_compute_precision():
    fp8 = dataclasses.replace(MODEL, compute_precision="fp8")
    assert prefill_window_us(fp8, GPU, 1, 4096, A) == approx(prefill_window_us(MODEL, GPU, 1, 4096, A) / 2)
