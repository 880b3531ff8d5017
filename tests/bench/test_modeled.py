"""The modeled backbone sleeps the planner's roofline time of each step, without the CPU."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from engram_offload.bench.engine import StepShape
from engram_offload.bench.modeled import ModeledBackbone, local_nvme, modeled_backbone, planner_prediction
from engram_offload.engram.config import EngramConfig
from engram_offload.planner import DEFAULT_ASSUMPTIONS, get_gpu, get_model
from engram_offload.planner.perf import decode_step, layer_offsets_us, step_time
from engram_offload.planner.placement import fetch_time, mixed_step_stall_us, step_stall_us
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


def _predicted(model, names, steps, hit_rate, gpu, unique=None):
    """``planner_prediction``'s figures for layers on ``names`` (one per Engram layer), step by step."""
    a = replace(DEFAULT_ASSUMPTIONS, host_fetch_cores=DEFAULT_ASSUMPTIONS.host_fetch_cores / model.tp,
                dram_rows_by_gpu=False)
    stall = first = total_us = reads = host = 0.0
    for d, p, kv in steps:
        roof = step_time(V41, gpu, model.tp, d, p, kv, DEFAULT_ASSUMPTIONS).backbone_us
        offsets = [roof * 1 / V41.num_layers, roof * 14 / V41.num_layers]
        due = {n: fetch_time(V41, gpu, model.tp, n, d, hit_rate, a, unique or step_unique_fraction(d, 0)) for n in names}
        total = {n: fetch_time(V41, gpu, model.tp, n, d + p, hit_rate, a, unique or step_unique_fraction(d, p))
                 for n in names}
        share = {n: names.count(n) / len(names) for n in total}
        if len(total) == 1:
            s = max(0.0, step_stall_us(due[names[0]], total[names[0]], offsets, roof))
        else:
            s = max(0.0, mixed_step_stall_us(due, total, names, offsets, roof)[0])
        stall += s
        total_us += roof + s
        first += max(0.0, max(f.fixed_us + f.rows_us * share[n] for n, f in total.items()) - offsets[0])
        reads += sum(f.nvme_reads * share[n] for n, f in total.items()) * model.tp
        host += total[names[0]].hash_us + sum(f.host_cpu_us * share[n] for n, f in total.items())
    k = len(steps)
    return {"stall_us": stall / k, "stall_us_all_at_first_layer": first / k, "step_us": total_us / k,
            "stall_fraction": stall / total_us, "nvme_iops": reads / total_us * 1e6, "host_cpu_us": host / k}


def test_a_per_layer_placement_waits_for_each_layers_rows_along_its_own_medium():
    model = backbone()
    gpu = replace(get_gpu("b300"), nvme_drives=1, nvme_iops_per_drive=10_000, gpus_per_server=2)
    steps = [(8, 0, 8000), (4, 100, 5000), (64, 0, 64 * 900)]
    for tier, names in (("1=memory/14=direct", ("dram", "nvme")), ("1=direct/14=mmap", ("nvme", "mmap")),
                        ("direct", ("nvme", "nvme")), ("1=direct/14=direct", ("nvme", "nvme"))):
        got = planner_prediction(model, tier, steps, 0.5, gpu)
        want = _predicted(model, names, steps, 0.5, gpu)
        assert set(got) == {"placement", "hit_rate", *want}
        assert got["placement"] == (names[0] if names[0] == names[1] else "/".join(names)) and got["hit_rate"] == 0.5
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-12), (tier, key)
        assert got["stall_us_all_at_first_layer"] > 0 and got["host_cpu_us"] > 0 and got["nvme_iops"] > 0
    mixed = planner_prediction(model, "1=memory/14=direct", steps, 0.5, gpu)
    single = planner_prediction(model, "direct", steps, 0.5, gpu)
    assert mixed["nvme_iops"] < single["nvme_iops"] and mixed["stall_us"] != single["stall_us"]


def test_a_prediction_of_no_stall_and_of_no_steps_is_zero():
    model = ModeledBackbone(V41, get_gpu("h100"), 1, V41.engram.layer_ids)  # a long step: the rows are early
    got = planner_prediction(model, "memory", [(1, 0, 10**7)], None)
    assert got["stall_us"] == 0.0 and got["stall_fraction"] == 0.0 and got["nvme_iops"] == 0.0
    assert got["stall_us_all_at_first_layer"] == 0.0  # they come before the first Engram layer
    assert got["step_us"] == pytest.approx(model.step_time(StepShape((), 1, 0, 10**7)).backbone_us, rel=1e-12)
    assert planner_prediction(model, "1=memory/14=direct", [(1, 0, 10**7)], 0.99)["stall_us"] == 0.0
    one_layer = ModeledBackbone(V41, get_gpu("h100"), 1, (1,))
    assert planner_prediction(one_layer, "direct", [(1, 0, 10**7)], 0.5)["placement"] == "nvme"
    model = backbone()
    assert planner_prediction(model, "direct", [], 0.5) == {
        "placement": "nvme", "hit_rate": 0.5, "stall_us": 0.0, "stall_us_all_at_first_layer": 0.0, "step_us": 0.0,
        "stall_fraction": 0.0, "nvme_iops": 0.0, "host_cpu_us": 0.0}


def test_a_table_without_a_name_needs_a_model_and_the_assumptions_are_kept():
    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(0.01)
    nameless = replace(config, name="")
    with pytest.raises(ValueError, match=r"^the table's layout has no name: pass --model \(one of the planner's "
                                         r"models\)$"):
        modeled_backbone(nameless, "b300", 2)
    assert modeled_backbone(nameless, "b300", 2, model="deepseek-v4.1-flash").model.num_layers == 40
    slow = replace(DEFAULT_ASSUMPTIONS, host_us_per_miss=DEFAULT_ASSUMPTIONS.host_us_per_miss * 2)
    assert modeled_backbone(config, "b300", 2, assumptions=slow).assumptions == slow
    assert modeled_backbone(config, "b300", 2).assumptions == DEFAULT_ASSUMPTIONS


def test_local_nvme_is_one_drive_of_the_given_rate_for_one_tp_group():
    gpu = local_nvme(get_gpu("b300"), 4, iops=50_000)
    assert (gpu.nvme_drives, gpu.nvme_iops_per_drive, gpu.gpus_per_server) == (1, 50_000, 4)
    assert gpu.nvme_bw_per_drive == 50_000 * 4096
    assert local_nvme(get_gpu("b300"), 4, iops=50_000, bytes_per_s=1e9).nvme_bw_per_drive == 1e9


def test_a_backbone_needs_one_gpu_and_layers_within_the_model():
    with pytest.raises(ValueError, match=r"^--tp must be >= 1, got 0$"):
        ModeledBackbone(V41, get_gpu("b300"), 0, (1, 14))
    with pytest.raises(ValueError, match=r"^Engram layers \[40\] are beyond deepseek-v4.1-flash's 40 layers$"):
        ModeledBackbone(V41, get_gpu("b300"), 1, (1, 40))
    assert ModeledBackbone(V41, get_gpu("b300"), 1, (1, 39)).layer_ids == (1, 39)


def _events(monkeypatch, model, shape):
    """What ``run_step`` does, in order: its sleeps' deadlines (us after the start) and rows taken."""
    import engram_offload.bench.modeled as modeled

    now = [0.0]
    events = []
    monkeypatch.setattr(modeled.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(modeled, "_sleep_until", lambda deadline: events.append(("sleep", round(deadline * 1e6, 3))))
    model.run_step(shape, lambda layer: events.append(("rows", layer)))
    return events


@pytest.mark.parametrize("schedule", ["prefetch", "in-graph"])
def test_each_layer_waits_at_its_place_under_prefetch_and_in_graph(monkeypatch, schedule):
    model = replace(backbone(), schedule=schedule)
    shape = StepShape((), 32, 0, 32 * 4096)
    a, b, c = model.segments_us(shape)
    assert _events(monkeypatch, model, shape) == [("sleep", round(a, 3)), ("rows", 1), ("sleep", round(a + b, 3)),
                                                   ("rows", 14), ("sleep", round(a + b + c, 3))]


def test_cpu_wait_takes_every_layers_rows_before_the_first_and_costs_eager_time(monkeypatch):
    model = replace(backbone(), schedule="cpu-wait", eager_us=400.0)
    shape = StepShape((), 32, 0, 32 * 4096)
    a, b, c = model.segments_us(shape)
    assert _events(monkeypatch, model, shape) == [("sleep", round(a, 3)), ("rows", 1), ("rows", 14),
                                                   ("sleep", round(a + b + c + 400.0, 3))]
    with pytest.raises(ValueError, match="unknown schedule"):
        replace(model, schedule="ahead")


def test_the_plugins_schedules_predict_every_row_due_from_forward_entry():
    steps = [(3, 200, 2500), (32, 0, 32 * 4096)]
    hit = 0.3
    prefetch = planner_prediction(backbone(), "direct", steps, hit)
    in_graph = planner_prediction(replace(backbone(), schedule="in-graph"), "direct", steps, hit)
    cpu_wait = planner_prediction(replace(backbone(), schedule="cpu-wait", eager_us=400.0), "direct", steps, hit)
    a = replace(DEFAULT_ASSUMPTIONS, host_fetch_cores=0.5, dram_rows_by_gpu=False)
    want = []
    for decode, prefill, kv in steps:
        roofline = step_time(V41, get_gpu("b300"), 2, decode, prefill, kv, DEFAULT_ASSUMPTIONS).backbone_us
        offsets = layer_offsets_us(V41, [1, 14], roofline)
        f = fetch_time(V41, get_gpu("b300"), 2, "nvme", decode + prefill, hit, a, step_unique_fraction(decode, prefill))
        want.append((max(0.0, step_stall_us(f, f, offsets, roofline)),
                     max(0.0, step_stall_us(f, f, [offsets[0]] * 2, roofline)), roofline))
    assert in_graph["stall_us"] == pytest.approx(sum(w[0] for w in want) / 2)
    assert cpu_wait["stall_us"] == pytest.approx(sum(w[1] for w in want) / 2)
    assert cpu_wait["step_us"] == pytest.approx(sum(w[1] + w[2] + 400.0 for w in want) / 2)
    assert prefetch["stall_us"] <= in_graph["stall_us"] <= cpu_wait["stall_us"]
