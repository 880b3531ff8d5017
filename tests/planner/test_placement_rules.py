"""Placement arithmetic, figure by figure, on a GPU and a backbone built here with round numbers.

The Engram table is a preset's (its sizes are read from the config, never written down), the
backbone and the GPU are made up so that every branch of the placement rules is reached.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engram_offload.planner import Assumptions, Workload, smallest_feasible_tp
from engram_offload.planner.mrc import mrc_from_trace
from engram_offload.planner.perf import decode_step, decode_window_us, prefill_window_us
from engram_offload.planner.placement import PLACEMENTS, PlacementResult, evaluate, evaluate_all, tp_degrees
from engram_offload.planner.realtext import step_unique_fraction

from made_up import GPU, MODEL, TABLE, WEIGHTS, A, GiB, approx, decode_stall


def run(name: str, tp: int = 1, model=MODEL, gpu=GPU, a: Assumptions = A, **workload):
    return evaluate(model, gpu, name, tp, Workload(**workload), a)


def hbm_for_kv_fraction(fraction: float, tp: int = 1) -> float:
    """HBM at which the DRAM placement leaves exactly ``fraction`` of all HBM for KV."""
    return (WEIGHTS / tp + A.runtime_overhead_bytes) / (A.gpu_memory_utilization - fraction)


def test_kv_fraction_is_measured_against_all_of_hbm_not_the_usable_budget():
    # 9.5% of HBM is left: under the 10% minimum, although it is 10.6% of the usable 90%
    gpu = dataclasses.replace(GPU, hbm_bytes=hbm_for_kv_fraction(0.095))
    r = run("dram", gpu=gpu, batch=1, context=1024)
    assert r.kv_fraction == approx(0.095)
    assert r.hbm_free_bytes == approx(0.095 * gpu.hbm_bytes)
    assert not r.fits
    assert r.why_not == [f"only {r.hbm_free_bytes / GiB:.1f} GiB (9.5% of HBM) left for KV cache per GPU, "
                         "under the 10% minimum"]
    r = run("dram", gpu=dataclasses.replace(GPU, hbm_bytes=hbm_for_kv_fraction(0.105)), batch=1, context=1024)
    assert r.kv_fraction == approx(0.105) and r.fits and r.why_not == []


def test_exactly_the_minimum_kv_fraction_fits():
    a = dataclasses.replace(A, min_kv_fraction=0.25)
    gpu = dataclasses.replace(GPU, hbm_bytes=80 * GiB)
    r = run("dram", gpu=gpu, a=a, batch=1, context=1024)
    fraction = r.hbm_free_bytes / gpu.hbm_bytes
    exact = dataclasses.replace(a, min_kv_fraction=fraction)
    assert run("dram", gpu=gpu, a=exact, batch=1, context=1024).fits
    above = dataclasses.replace(a, min_kv_fraction=fraction * 1.0001)
    assert not run("dram", gpu=gpu, a=above, batch=1, context=1024).fits


@pytest.mark.parametrize("name", PLACEMENTS)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_memory_per_gpu_follows_the_placement(name, tp):
    r = run(name, tp, context=8192, gpus=8)
    table_in_hbm = TABLE / tp if name == "hbm" else 0.0
    free = max(0.0, A.gpu_memory_utilization * GPU.hbm_bytes - WEIGHTS / tp - table_in_hbm
               - A.runtime_overhead_bytes)
    assert (r.name, r.tp) == (name, tp)
    assert r.weight_bytes_per_gpu == approx(WEIGHTS / tp)
    assert r.table_hbm_bytes_per_gpu == approx(table_in_hbm)
    assert r.hbm_free_bytes == approx(free)
    assert r.kv_fraction == approx(free / GPU.hbm_bytes)
    assert r.max_concurrent_seqs == int(free // (8192 * MODEL.kv_bytes_per_token))  # KV replicated
    assert r.bytes_per_token_per_gpu == MODEL.engram.bytes_per_token_per_gpu(tp)
    assert r.host_bytes_per_gpu == approx({"dram": TABLE / tp, "nvme": r.cache_bytes_per_gpu}.get(name, 0))


def test_kv_split_over_tp_when_not_replicated():
    split = dataclasses.replace(MODEL, kv_replicated_across_tp=False)
    r = run("dram", 4, model=split, context=8192)
    assert r.max_concurrent_seqs == int(r.hbm_free_bytes // (8192 * MODEL.kv_bytes_per_token / 4))
    replicated = run("dram", 4, context=8192)
    assert r.max_concurrent_seqs > replicated.max_concurrent_seqs


def test_weights_that_exceed_the_budget_say_so():
    gpu = dataclasses.replace(GPU, hbm_bytes=40 * GiB)
    r = run("hbm", 1, gpu=gpu)
    assert r.hbm_free_bytes == 0.0 and r.kv_fraction == 0.0 and r.max_concurrent_seqs == 0
    assert r.batch == 0 and r.step_us == 0.0 and not r.fits
    assert r.why_not[0] == (f"weights {WEIGHTS / GiB:.1f} GiB + table {TABLE / GiB:.1f} GiB + runtime 4 GiB "
                            "per GPU exceed 90% of 40 GiB HBM")
    assert run("dram", 1, gpu=gpu).why_not[0] == (f"weights {WEIGHTS / GiB:.1f} GiB + runtime 4 GiB per GPU "
                                                   "exceed 90% of 40 GiB HBM")


def test_weights_that_fill_the_budget_exactly_still_fit_the_weights_rule():
    need = WEIGHTS + A.runtime_overhead_bytes
    gpu = dataclasses.replace(GPU, hbm_bytes=need / A.gpu_memory_utilization)
    r = run("dram", 1, gpu=gpu)
    assert r.hbm_free_bytes == approx(0.0, abs=1e-3)
    assert not any("exceed" in w for w in r.why_not) and "left for KV cache" in r.why_not[0]


def test_a_context_longer_than_the_kv_cache_holds():
    r = run("dram", 1, context=10**7)
    assert r.kv_fraction >= A.min_kv_fraction and r.max_concurrent_seqs == 0
    assert r.why_not == ["the KV cache cannot hold one sequence of 10,000,000 tokens"]
    assert r.batch == 0 and r.predicted_stall_us == 0.0 and not r.fits


def test_dram_needs_room_in_host_dram():
    small = TABLE / A.dram_usable_fraction  # the whole table exactly fills the usable share at TP=1
    gpu = dataclasses.replace(GPU, host_dram_per_gpu=small)
    assert run("dram", 1, gpu=gpu, batch=1).fits
    gpu = dataclasses.replace(GPU, host_dram_per_gpu=small * 0.99)
    r = run("dram", 1, gpu=gpu, batch=1)
    assert r.why_not == [f"table share {TABLE / GiB:.1f} GiB per GPU exceeds 80% of "
                         f"{gpu.host_dram_per_gpu / GiB:.0f} GiB host DRAM per GPU"]
    assert run("dram", 2, gpu=gpu, batch=1).fits  # half the table per GPU


def test_nvme_needs_the_table_on_the_servers_drives():
    gpu = dataclasses.replace(GPU, nvme_drives=1, nvme_capacity_per_drive=TABLE)
    assert not any("NVMe" in w for w in run("nvme", 1, gpu=gpu, batch=1).why_not)
    gpu = dataclasses.replace(GPU, nvme_drives=1, nvme_capacity_per_drive=TABLE - 1)
    assert run("nvme", 1, gpu=gpu, batch=1).why_not[0] == (
        f"table {TABLE / 1e12:.2f} TB exceeds the server's NVMe {(TABLE - 1) / 1e12:.1f} TB")


def tiny_curve():
    """1,000 ids read ten times round-robin: 90% hits from 1,000 rows on, none below."""
    return mrc_from_trace(np.tile(np.arange(1000, dtype=np.int64), 10))


def test_nvme_cache_is_sized_from_the_curve_and_the_dram_share():
    row = MODEL.engram.row_bytes
    r = run("nvme", 2, curve=tiny_curve(), target_hit_rate=0.9, batch=4)
    assert r.cache_bytes_per_gpu == approx(1000 * row / 2)
    assert r.host_bytes_per_gpu == r.cache_bytes_per_gpu and r.cache_hit_rate == approx(0.9)
    # a target the trace never reaches: cache as much of the table as DRAM allows
    r = run("nvme", 2, curve=tiny_curve(), target_hit_rate=0.95, batch=4)
    cap_rows = int(A.dram_usable_fraction * GPU.host_dram_per_gpu * 2 // row)
    assert r.cache_bytes_per_gpu == approx(min(cap_rows, MODEL.engram.num_rows) * row / 2)
    # no curve: the whole table if it fits in DRAM (all hits), else the DRAM share and no estimate of hits
    assert run("nvme", 1, batch=4).cache_hit_rate == 1.0
    tight = dataclasses.replace(GPU, host_dram_per_gpu=TABLE / 4)
    r = run("nvme", 1, gpu=tight, batch=4)
    assert r.cache_bytes_per_gpu == approx(int(A.dram_usable_fraction * TABLE / 4 // row) * row)
    assert r.cache_hit_rate == 0.0
    assert r.transfer_us > run("nvme", 1, batch=4).transfer_us + GPU.nvme_latency_us  # misses are read
    # at TP=2 the group's two DRAM shares hold twice the rows, each GPU keeps half of them
    r = run("nvme", 2, gpu=tight, batch=4)
    assert r.cache_bytes_per_gpu == approx(int(A.dram_usable_fraction * TABLE / 4 * 2 // row) * row / 2)


@pytest.mark.parametrize("drive_bw, bound", [(10e9, "iops"), (0.1e9, "bandwidth")])
def test_nvme_misses_cost_latency_iops_and_bandwidth(drive_bw, bound):
    batch, tp, gpus = 16, 2, 4
    gpu = dataclasses.replace(GPU, nvme_bw_per_drive=drive_bw)
    r = run("nvme", tp, gpu=gpu, curve=tiny_curve(), target_hit_rate=0.9, batch=batch, gpus=gpus)
    step = decode_step(MODEL, GPU, tp, batch, 32768, A)
    bpt = MODEL.engram.bytes_per_token_per_gpu(tp)
    u = step_unique_fraction(batch, 0)  # the step's distinct row ids: each read and sent once
    misses = batch * (bpt // MODEL.engram.row_bytes) * u * (1 - 0.9)
    link = batch * bpt * u
    # latencies once a step; the link and the drives in proportion to the rows, where a drive's
    # IOPS and its bandwidth bound the same reads: the slower of the two counts
    fixed = A.host_link_latency_us + GPU.nvme_latency_us + A.nvme_step_overhead_us
    # the server's drives shared by its 8 GPUs, at the share of their rate the fetch path reaches
    by_iops = misses / (GPU.nvme_iops_per_server / 8 * A.nvme_path_efficiency)
    by_bw = misses * A.nvme_read_bytes / (drive_bw * GPU.nvme_drives / 8 * A.nvme_path_efficiency)
    assert (by_iops > by_bw) == (bound == "iops")
    rows = (link / (GPU.host_link_bw * A.host_link_efficiency) + max(by_iops, by_bw)) * 1e6
    window = decode_window_us(MODEL, step)
    assert r.link_bytes_per_step == link
    assert r.transfer_us == approx(fixed + rows)
    assert r.window_us == approx(window)
    assert r.predicted_stall_us == approx(decode_stall(fixed, rows, step.backbone_us))
    assert r.step_us == approx(step.backbone_us + r.predicted_stall_us)
    assert r.nvme_iops_needed == approx(misses / (r.step_us * 1e-6) * gpus)  # 4 GPUs of 8 used
    assert r.nvme_iops_available == GPU.nvme_iops_per_server
    assert r.why_not == [] and r.fits


def test_drives_short_of_iops_stall_the_step_and_are_never_asked_for_more_than_they_give():
    # 100 reads/s a drive: a step's misses take far longer than its backbone time
    starved = dataclasses.replace(GPU, nvme_iops_per_drive=1e2)
    r = run("nvme", 1, gpu=starved, curve=tiny_curve(), target_hit_rate=0.9, batch=16, gpus=8)
    fast = run("nvme", 1, curve=tiny_curve(), target_hit_rate=0.9, batch=16, gpus=8)
    misses = 16 * (MODEL.engram.bytes_per_token_per_gpu(1) // MODEL.engram.row_bytes) * (1 - 0.9)
    misses *= step_unique_fraction(16, 0)  # each distinct row id read once
    reads_us = misses / (starved.nvme_iops_per_server / 8) * 1e6
    step = decode_step(MODEL, GPU, 1, 16, 32768, A).backbone_us
    assert reads_us > 10 * step
    assert r.predicted_stall_us > reads_us - step and r.interactivity < fast.interactivity / 10
    # the step is charged the reads at the drives' rate, so it reads at most that rate:
    # the shortfall is a stall (and a low interactivity), not a placement that does not fit
    assert r.nvme_iops_needed == approx(misses / (r.step_us * 1e-6) * 8)
    assert r.nvme_iops_needed <= r.nvme_iops_available == starved.nvme_iops_per_server
    assert r.fits and r.why_not == []


@pytest.mark.parametrize("times_window, late", [(1.9, None), (5.0, "first"), (20.0, "second")])
def test_each_engram_layer_waits_only_for_its_own_rows(times_window, late):
    # the test model's Engram layers are 2 and 15 of 30: at 2/30 and 15/30 of the step
    batch = 8
    step = decode_step(MODEL, GPU, 1, batch, 4096, A).backbone_us
    first, second = step * 2 / 30, step * 15 / 30
    fixed = A.host_link_latency_us
    rows = times_window * first - fixed  # the link's share of the transfer
    link = batch * MODEL.engram.bytes_per_token_per_gpu(1) * step_unique_fraction(batch, 0)  # distinct rows
    gpu = dataclasses.replace(GPU, host_link_bw=link * 1e6 / (rows * A.host_link_efficiency))
    r = run("dram", 1, gpu=gpu, batch=batch, context=4096)
    assert r.window_us == approx(first) and r.transfer_us == approx(times_window * first)
    # half the rows (and the latency) are due at the first layer, all of them at the second
    assert r.predicted_stall_us == approx({None: 0.0, "first": fixed + rows / 2 - first,
                                           "second": fixed + rows - second}[late])
    assert r.step_us == approx(step + r.predicted_stall_us)


def test_nvme_with_less_than_one_miss_a_step_still_pays_for_it():
    hot = mrc_from_trace(np.tile(np.arange(1000, dtype=np.int64), 100))  # 99% hits from 1,000 rows
    r = run("nvme", 1, curve=hot, target_hit_rate=0.99, batch=1)
    misses = MODEL.engram.bytes_per_token_per_gpu(1) // MODEL.engram.row_bytes * (1 - 0.99)
    assert 0 < misses < 1
    link = MODEL.engram.bytes_per_token_per_gpu(1)
    assert r.transfer_us == approx(
        A.host_link_latency_us + link / (GPU.host_link_bw * A.host_link_efficiency) * 1e6 + GPU.nvme_latency_us
        + A.nvme_step_overhead_us
        + max(misses / (GPU.nvme_iops_per_server / 8 * A.nvme_path_efficiency),
              misses * A.nvme_read_bytes / (GPU.nvme_bw_per_drive * GPU.nvme_drives / 8 * A.nvme_path_efficiency))
        * 1e6)


def test_nvme_without_misses_costs_only_the_link():
    r = run("nvme", 1, batch=8)  # the whole table cached: no misses
    link = 8 * MODEL.engram.bytes_per_token_per_gpu(1) * step_unique_fraction(8, 0)  # distinct rows
    assert r.transfer_us == approx(A.host_link_latency_us
                                          + link / (GPU.host_link_bw * A.host_link_efficiency) * 1e6)
    assert r.nvme_iops_needed == 0.0


@pytest.mark.parametrize("name", ["dram", "remote", "hbm"])
def test_decode_link_transfer_and_stall(name):
    batch, tp = 32, 4
    slow = dataclasses.replace(GPU, host_link_bw=1e7)
    a = dataclasses.replace(A, remote_bw=0.5e7)
    r = run(name, tp, gpu=slow, a=a, batch=batch, context=1024)
    step = decode_step(MODEL, slow, tp, batch, 1024, a)
    link = 0.0 if name == "hbm" else batch * MODEL.engram.bytes_per_token_per_gpu(tp) * step_unique_fraction(batch, 0)
    fixed, rows = {"hbm": (0.0, 0.0),
                   "dram": (a.host_link_latency_us, link / (1e7 * a.host_link_efficiency) * 1e6),
                   "remote": (a.remote_latency_us, link / 0.5e7 * 1e6)}[name]
    stall = decode_stall(fixed, rows, step.backbone_us)
    assert r.batch == batch and r.link_bytes_per_step == link
    assert r.transfer_us == approx(fixed + rows)
    assert r.predicted_stall_us == approx(stall)
    assert (stall > 0) == (name != "hbm")
    assert r.step_us == approx(step.backbone_us + stall)
    assert r.bound == step.bound
    assert r.interactivity == approx(1e6 / r.step_us)
    assert r.tokens_per_s_per_gpu == approx(batch * r.interactivity / tp)
    assert r.tokens_per_dollar == approx(r.tokens_per_s_per_gpu * 3600 / 2.0)
    assert r.link == {"hbm": "HBM", "dram": "test link", "remote": "pooled memory (network/CXL)"}[name]
    assert r.nvme_iops_needed == 0.0 and r.nvme_iops_available == 0.0


def test_a_fast_link_hides_behind_the_window():
    r = run("dram", 1, batch=1)
    assert r.transfer_us < r.window_us and r.predicted_stall_us == 0.0
    assert r.link == "test link" and run("nvme", 1, batch=1).link == "NVMe -> DRAM cache -> test link"


@pytest.mark.parametrize("name", ["dram", "nvme", "remote"])
def test_prefill_chunk_reads_every_row_over_the_link(name):
    slow = dataclasses.replace(GPU, host_link_bw=2e9)
    a = dataclasses.replace(A, prefill_chunk_tokens=4096, remote_bw=3e9)
    r = run(name, 2, gpu=slow, a=a, batch=1)
    bw, lat = (3e9, a.remote_latency_us) if name == "remote" else (2e9 * a.host_link_efficiency,
                                                                      a.host_link_latency_us)
    transfer = lat + 4096 * MODEL.engram.bytes_per_token_per_gpu(2) / bw * 1e6
    window = prefill_window_us(MODEL, slow, 2, 4096, a)
    assert r.prefill_window_us == approx(window)
    assert r.prefill_transfer_us == approx(transfer)
    assert r.prefill_stall_us == approx(max(0.0, transfer - window)) and r.prefill_stall_us > 0


def test_prefill_of_a_table_in_hbm_waits_for_nothing():
    r = run("hbm", 2, batch=1)
    assert (r.prefill_window_us, r.prefill_transfer_us, r.prefill_stall_us) == (0.0, 0.0, 0.0)
    fast = run("dram", 2, gpu=dataclasses.replace(GPU, host_link_bw=1e15), batch=1)
    assert fast.prefill_stall_us == 0.0 and fast.prefill_transfer_us < fast.prefill_window_us


def fixed_batch(name: str, batch: int) -> tuple[float, float]:
    r = run(name, 1, batch=batch, context=4096)
    return r.interactivity, r.tokens_per_s_per_gpu


@pytest.mark.parametrize("floor", [0.0, 300.0, 1e9])
def test_batch_search_takes_the_best_throughput_above_the_floor(floor):
    r = run("dram", 1, context=4096, min_interactivity=floor)
    seqs = r.max_concurrent_seqs
    candidates = sorted({2**k for k in range(31) if 2**k <= seqs} | {seqs})
    figures = {b: fixed_batch("dram", b) for b in candidates}
    meeting = [b for b in candidates if figures[b][0] >= floor]
    if meeting:
        assert r.meets_interactivity and r.batch == max(meeting, key=lambda b: figures[b][1])
    else:  # none does: the most interactive one, flagged
        assert not r.meets_interactivity and r.batch == 1
    assert r.interactivity == approx(figures[r.batch][0])


def test_batch_search_tries_every_power_of_two():
    floor = fixed_batch("dram", 64)[0]  # exactly what batch 64 gets: no larger batch meets it
    r = run("dram", 1, context=4096, min_interactivity=floor)
    assert r.max_concurrent_seqs > 128 and r.batch == 64 and r.meets_interactivity


def test_batch_search_ends_at_the_kv_limit():
    r = run("dram", 1, context=4096, min_interactivity=0.0)
    assert r.batch == r.max_concurrent_seqs and r.max_concurrent_seqs & (r.max_concurrent_seqs - 1)
    assert run("dram", 1, context=4096, batch=10**9).batch == r.max_concurrent_seqs
    assert run("dram", 1, context=4096, batch=3).batch == 3


def test_batch_of_exactly_the_floor_meets_it():
    inter = fixed_batch("dram", 1)[0]
    r = run("dram", 1, context=4096, batch=1, min_interactivity=inter)
    assert r.meets_interactivity


def test_a_batch_of_one_when_only_one_sequence_fits():
    kv = (A.gpu_memory_utilization * GPU.hbm_bytes - WEIGHTS - A.runtime_overhead_bytes) / 1.5
    model = dataclasses.replace(MODEL, kv_bytes_per_token=kv / 1024)
    r = evaluate(model, GPU, "dram", 1, Workload(context=1024, min_interactivity=0.0),
                 dataclasses.replace(A, min_kv_fraction=0.0))
    assert r.max_concurrent_seqs == 1 and r.batch == 1 and r.fits


def test_tp_degrees_are_the_powers_of_two_up_to_the_gpus():
    assert tp_degrees(1) == [1]
    assert tp_degrees(6) == [1, 2, 4]
    assert tp_degrees(8) == [1, 2, 4, 8]
    results = evaluate_all(MODEL, GPU, Workload(gpus=4, batch=1))
    assert [(r.name, r.tp) for r in results] == [(n, t) for n in PLACEMENTS for t in (1, 2, 4)]


def test_smallest_feasible_tp():
    results = evaluate_all(MODEL, dataclasses.replace(GPU, hbm_bytes=50 * GiB), Workload(gpus=8, batch=1))
    fits = {(r.name, r.tp): r.fits for r in results}
    for name in PLACEMENTS:
        tps = [tp for tp in (1, 2, 4, 8) if fits[name, tp]]
        assert smallest_feasible_tp(results, name) == (min(tps) if tps else None)
    assert fits["dram", 2] and not fits["dram", 1]  # 50 GiB: the weights alone leave too little at TP=1
    assert smallest_feasible_tp(results, "dram") == 2 and smallest_feasible_tp([], "dram") is None
    mixed = [PlacementResult("hbm", 1, fits=True), PlacementResult("dram", 4, fits=True),
             PlacementResult("dram", 2, fits=True), PlacementResult("dram", 1, fits=False)]
    assert smallest_feasible_tp(mixed, "dram") == 2 and smallest_feasible_tp(mixed, "nvme") is None


def test_unknown_placement_and_bad_workloads_are_refused():
    with pytest.raises(ValueError, match="unknown placement 'ssd'; choose one of: hbm, dram, nvme, remote"):
        run("ssd")
    for kw, message in [({"context": 0}, "--context must be a positive token count, got 0"),
                        ({"batch": 0}, "--batch must be >= 1, got 0"),
                        ({"gpus": 0}, "--gpus must be >= 1, got 0"),
                        ({"target_hit_rate": 0.0}, r"--target-hit-rate must be in \(0, 1\], got 0.0"),
                        ({"target_hit_rate": 1.01}, "got 1.01")]:
        with pytest.raises(ValueError, match=message):
            Workload(**kw)
    w = Workload(context=1, batch=1, gpus=1, target_hit_rate=1.0)
    assert (w.context, w.batch, w.gpus, w.min_interactivity, w.curve_label) == (1, 1, 1, 50.0, "none")
    assert Workload().context == 32768 and Workload().gpus == 8 and Workload().target_hit_rate == 0.9


def test_a_result_converts_to_a_plain_dict():
    r = run("dram", 1, batch=2)
    d = r.to_dict()
    assert d["name"] == "dram" and d["batch"] == 2 and d["why_not"] == r.why_not
    assert d["predicted_stall_us"] == r.predicted_stall_us and d["fits"] is True


def test_evaluate_all_passes_the_assumptions_on():
    a = dataclasses.replace(A, min_kv_fraction=0.9)  # nothing can leave 90% of HBM for KV
    results = evaluate_all(MODEL, GPU, Workload(gpus=2, batch=1), a)
    assert [r.fits for r in results] == [False] * 8
    assert [r.to_dict() for r in results] == [evaluate(MODEL, GPU, n, t, Workload(gpus=2, batch=1), a).to_dict()
                                              for n in PLACEMENTS for t in (1, 2)]
