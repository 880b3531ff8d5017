"""The modeled backbone sleeps the planner's roofline time of each step, without the CPU."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from engram_offload.bench.engine import StepShape
from engram_offload.bench.modeled import ModeledBackbone, modeled_backbone, planner_prediction
from engram_offload.engram.config import EngramConfig
from engram_offload.planner import DEFAULT_ASSUMPTIONS, get_gpu, get_model
from engram_offload.planner.perf import decode_step, step_time
from engram_offload.planner.placement import fetch_time, step_stall_us
from engram_offload.planner.realtext import step_unique_fraction

V41 = get_model("deepseek-v4.1-flash")


def backbone(tp=2, gpu="b300"):
    return ModeledBackbone(V41, get_gpu(gpu), tp, V41.engram.layer_ids)


@pytest.mark.parametrize("decode,prefill,kv", [(8, 0, 8 * 900), (128, 0, 128 * 700), (3, 200, 2500), (0, 256, 256)])
def test_a_step_lasts_the_planners_roofline_split_at_the_engram_layers(decode, prefill, kv):
    model = backbone()
    shape = StepShape((), decode, prefill, kv)
    want = step_time(V41, get_gpu("b300"), 2, decode, prefill, kv, DEFAULT_ASSUMPTIONS).backbone_us
    segments = model.segments_us(shape)
    assert model.step_time(shape).backbone_us == want
    assert sum(segments) == pytest.approx(want, rel=1e-12)
    first, second = V41.engram.layer_ids  # 1 and 14 of its 40 layers
    assert segments[0] == pytest.approx(want * first / V41.num_layers, rel=1e-12)
    assert segments[1] == pytest.approx(want * (second - first) / V41.num_layers, rel=1e-12)


def test_a_decode_step_is_the_planners_decode_step():
    shape = StepShape((), 32, 0, 32 * 4096)
    assert backbone().step_time(shape) == decode_step(V41, get_gpu("b300"), 2, 32, 4096, DEFAULT_ASSUMPTIONS)


def test_a_step_sleeps_its_time_and_takes_every_layers_rows_in_order():
    model = backbone(tp=1)
    shape = StepShape((), 0, 4096, 4096)
    asked = []
    t0 = time.perf_counter()
    c0 = time.process_time()
    model.run_step(shape, lambda layer: asked.append((layer, time.perf_counter() - t0)) or torch.zeros(1))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    segments = model.segments_us(shape)
    assert [layer for layer, _ in asked] == [1, 14]
    assert asked[0][1] >= segments[0] * 1e-6 and asked[1][1] >= (segments[0] + segments[1]) * 1e-6
    assert wall >= sum(segments) * 1e-6 > 0.02
    assert cpu < 0.2 * wall  # it sleeps: the cores stay with the fetch path


def test_a_wait_for_rows_delays_the_rest_of_the_step():
    model = backbone(tp=1)
    shape = StepShape((), 8, 0, 8000)
    t0 = time.perf_counter()
    model.run_step(shape, lambda layer: time.sleep(0.03) if layer == 1 else None)
    assert time.perf_counter() - t0 >= 0.03 + sum(model.segments_us(shape)) * 1e-6


def test_a_scaled_table_gets_its_presets_backbone():
    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(0.01)
    model = modeled_backbone(config, "B300", 2)
    assert model.model.num_layers == V41.num_layers == 40 and model.model.engram == config and model.tp == 2
    with pytest.raises(ValueError, match="unknown GPU"):
        modeled_backbone(config, "h9000", 2)
    with pytest.raises(ValueError, match="beyond"):
        ModeledBackbone(V41, get_gpu("b300"), 2, (1, 50))


def test_the_prediction_is_the_planners_stall_for_each_step():
    model = backbone()
    gpu = replace(get_gpu("b300"), nvme_drives=1, nvme_iops_per_drive=10_000, gpus_per_server=2)
    steps = [(8, 0, 8000), (4, 100, 5000)]
    for unique in (None, 0.7):  # real text's repeats within each step, or a measured share
        got = planner_prediction(model, "direct", steps, 0.5, gpu, unique=unique)
        stalls, totals, reads = [], [], 0.0
        for d, p, kv in steps:
            roof = step_time(V41, gpu, 2, d, p, kv, DEFAULT_ASSUMPTIONS).backbone_us
            due = fetch_time(V41, gpu, 2, "nvme", d, 0.5, DEFAULT_ASSUMPTIONS, unique or step_unique_fraction(d, 0))
            total = fetch_time(V41, gpu, 2, "nvme", d + p, 0.5, DEFAULT_ASSUMPTIONS,
                               unique or step_unique_fraction(d, p))
            stalls.append(step_stall_us(due, total, [roof * 1 / V41.num_layers, roof * 14 / V41.num_layers], roof))
            totals.append(roof + stalls[-1])
            reads += total.nvme_reads * 2
        assert got["stall_us"] == pytest.approx(sum(stalls) / 2)
        assert got["stall_fraction"] == pytest.approx(sum(stalls) / sum(totals))
        assert got["nvme_iops"] == pytest.approx(reads / sum(totals) * 1e6)
        assert got["stall_us"] > 0  # 10k IOPS cannot keep up with a B300
    assert planner_prediction(model, "memory", steps, None)["placement"] == "dram"


def test_an_mmap_table_reads_by_page_faults_one_per_faulting_thread():
    """The mmap tier's misses are page faults: a 4 KiB read at queue depth 1 per faulting
    thread, however many reads the drive could take at once, each followed by the thread's
    own handling of the fault (60 us), and 30 us of CPU each."""
    from engram_offload.bench.modeled import PLACEMENT_OF_TIER, local_nvme

    a = DEFAULT_ASSUMPTIONS
    assert PLACEMENT_OF_TIER["mmap"] == "mmap"
    assert (a.mmap_fault_threads, a.mmap_fault_us, a.mmap_us_per_miss) == (2, 60.0, 30.0)
    gpu = local_nvme(get_gpu("b300"), 2, iops=80_000, latency_us=67.0)
    assert gpu.nvme_latency_us == 67.0 and local_nvme(get_gpu("b300"), 2, iops=80_000).nvme_latency_us == 80.0
    no_host = replace(a, host_hash_us_per_step=0.0, host_hash_us_per_row=0.0, host_us_per_hit=0.0,
                      host_us_per_miss=0.0, mmap_us_per_miss=0.0)
    mmap = fetch_time(V41, gpu, 2, "mmap", 100, 0.5, no_host)
    queued = fetch_time(V41, gpu, 2, "nvme", 100, 0.5, no_host)
    misses = 100 * 24 * 0.5  # per GPU at TP 2
    assert mmap.nvme_reads == queued.nvme_reads == misses
    faults_per_s = 2 / (67e-6 + 60e-6) / 2  # two faulting threads' reads and faults, shared by the 2 GPUs
    assert mmap.rows_us - queued.rows_us == pytest.approx(misses / faults_per_s * 1e6 - misses / (80_000 / 2 * 0.8) * 1e6)
    with_host = fetch_time(V41, gpu, 2, "mmap", 100, 0.5, a)
    assert with_host.host_cpu_us == pytest.approx((2400 - misses) * a.host_us_per_hit + misses * 30.0)
    got = planner_prediction(backbone(), "mmap", [(32, 0, 32 * 4096)], 0.5, gpu)
    assert got["placement"] == "mmap"
    assert got["stall_us"] > planner_prediction(backbone(), "direct", [(32, 0, 32 * 4096)], 0.5, gpu)["stall_us"]
