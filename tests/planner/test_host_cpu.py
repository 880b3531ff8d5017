"""The host CPU term of the fetch (hashing, then the fetch worker's per-row work over its
cores) and real text's hit-ratio curve: the two corrections the modeled benchmark asked for
(docs/planner.md, "Checked against measurement")."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engram_offload.bench.modeled import ModeledBackbone, local_nvme, planner_prediction
from engram_offload.cli import main
from engram_offload.planner import DEFAULT_ASSUMPTIONS, Workload, get_gpu, get_model
from engram_offload.planner.mrc import ZipfMRC
from engram_offload.planner.placement import evaluate, fetch_time
from engram_offload.planner.plan import curve_for
from engram_offload.planner.realtext import (
    DECODE_UNIQUE,
    PREFILL_TOKENS,
    PREFILL_UNIQUE,
    REAL_TEXT_CACHE_TOKENS,
    REAL_TEXT_FIRST_TOUCH,
    REAL_TEXT_HIT,
    STEP_TOKENS,
    RealTextMRC,
    step_unique_fraction,
)

V41 = get_model("deepseek-v4.1-flash")
B300 = get_gpu("b300")
A = DEFAULT_ASSUMPTIONS
ROWS_PER_TOKEN = 48  # V4.1-Flash: 2 Engram layers x 24 columns
NO_HOST = replace(A, host_hash_us_per_step=0.0, host_hash_us_per_row=0.0, host_us_per_hit=0.0, host_us_per_miss=0.0)
HOST_DRAM = replace(A, dram_rows_by_gpu=False)  # the host serves a DRAM table's rows (no GPU here)


def hashing_us(tokens: int) -> float:
    return A.host_hash_us_per_step + tokens * ROWS_PER_TOKEN * A.host_hash_us_per_row


def test_the_defaults_are_this_machines_measurements():
    # begin_step at decode batches 8..512 (two runs: 0.11, 0.16-0.17, 0.24-0.35, 0.86-0.88 ms a
    # step: 110 us + 1.5 us a token of 48 row ids); bench_fetch.py's three runs of bench-tier
    # --prefetcher --cold on the 2.15 GiB V4.1-Flash table (docs/planner.md): the workers
    # 0.24-0.27 us a hit and 6.0-6.5 us a miss
    assert (A.host_hash_us_per_step, A.host_hash_us_per_row) == (110.0, 0.031)
    assert (A.host_us_per_hit, A.host_us_per_miss, A.host_fetch_cores, A.dram_rows_by_gpu) == (0.26, 6.2, 1.0, True)
    for batch, measured_ms in ((8, 0.1125), (32, 0.1635), (128, 0.294), (512, 0.869)):
        assert hashing_us(batch) == pytest.approx(measured_ms * 1e3, rel=0.1)


def test_hashing_comes_first_and_the_worker_serves_the_rows_beside_the_drives():
    tokens, hit = 64, 0.5
    rows = tokens * 24 * 1.0  # per GPU at TP 2
    misses = rows * (1 - hit)
    slow_drive = local_nvme(B300, 2, iops=1_000)  # the drive paces the rows
    f = fetch_time(V41, slow_drive, 2, "nvme", tokens, hit, A)
    bare = fetch_time(V41, slow_drive, 2, "nvme", tokens, hit, NO_HOST)
    assert f.hash_us == pytest.approx(hashing_us(tokens))
    assert f.host_cpu_us == pytest.approx((rows - misses) * A.host_us_per_hit + misses * A.host_us_per_miss)
    assert f.fixed_us == pytest.approx(bare.fixed_us + f.hash_us)
    assert f.rows_us == pytest.approx(bare.rows_us)  # the worker keeps up with a slow drive
    fast_drive = local_nvme(B300, 2, iops=1e9)  # now the worker paces them
    f = fetch_time(V41, fast_drive, 2, "nvme", tokens, hit, A)
    bare = fetch_time(V41, fast_drive, 2, "nvme", tokens, hit, NO_HOST)
    assert f.rows_us == pytest.approx(bare.rows_us - misses / (1e9 / 2 * A.nvme_path_efficiency) * 1e6 + f.host_cpu_us)


def test_more_cores_divide_the_workers_cpu_not_the_hashing():
    one = fetch_time(V41, B300, 2, "dram", 256, None, HOST_DRAM)
    four = fetch_time(V41, B300, 2, "dram", 256, None, replace(HOST_DRAM, host_fetch_cores=4.0))
    assert four.host_cpu_us == pytest.approx(one.host_cpu_us / 4)
    assert four.hash_us == one.hash_us > 0


@pytest.mark.parametrize("name", ["hbm", "remote", "dram"])
def test_placements_whose_rows_the_host_does_not_serve_pay_for_hashing_only(name):
    f = fetch_time(V41, B300, 2, name, 256, None, A)  # dram: the GPU reads pinned memory itself
    assert f.host_cpu_us == 0.0
    assert f.hash_us == pytest.approx(hashing_us(256))
    assert f.fixed_us == pytest.approx(fetch_time(V41, B300, 2, name, 256, None, NO_HOST).fixed_us + f.hash_us)


def test_a_step_without_tokens_costs_no_host_cpu():
    f = fetch_time(V41, B300, 2, "nvme", 0, 0.5, A)
    assert f.hash_us == f.host_cpu_us == 0.0


def stall(per_hit_us: float, batch: int = 256, tp: int = 2, **changes) -> float:
    a = replace(HOST_DRAM, host_us_per_hit=per_hit_us, **changes)
    return evaluate(V41, B300, "dram", tp, Workload(batch=batch, gpus=tp), a).predicted_stall_us


def test_the_stall_grows_with_the_host_cpu_per_row():
    stalls = [stall(us) for us in (0.5, 1.0, 2.0, 4.0)]
    assert 0 < stalls[0] < stalls[1] < stalls[2] < stalls[3]
    # once the first Engram layer waits, each extra us per row adds layer 1's rows' share
    # (half the step's 256 x 24 rows per GPU, the distinct ones) to it
    assert stalls[2] - stalls[1] == pytest.approx(256 * 24 * step_unique_fraction(256, 0) / 2 * 1.0)


def test_no_stall_while_the_window_before_the_first_engram_layer_covers_the_host():
    quick = replace(HOST_DRAM, host_hash_us_per_step=0.0)  # one token's rows alone fit the window
    r = evaluate(V41, B300, "dram", 2, Workload(batch=1, gpus=2), quick)
    assert 0 < r.host_us < r.window_us
    assert r.predicted_stall_us == 0.0
    # the fixed cost of beginning a step (110 us here) is longer than that window (44 us at batch 1)
    r = evaluate(V41, B300, "dram", 2, Workload(batch=1, gpus=2), HOST_DRAM)
    assert r.window_us < A.host_hash_us_per_step < r.host_us
    assert r.predicted_stall_us > 0


def test_the_benchmarks_one_fetch_path_serves_the_whole_tp_group():
    backbone = ModeledBackbone(V41, B300, 2, tuple(V41.engram.layer_ids))
    gpu = local_nvme(B300, 2, iops=1e9)  # the drive never paces: the worker does
    steps = [(64, 0, 64 * 4096)]
    shared = planner_prediction(backbone, "direct", steps, 0.5, gpu)
    per_gpu = fetch_time(V41, gpu, 2, "nvme", 64, 0.5, replace(HOST_DRAM, host_fetch_cores=0.5),
                         step_unique_fraction(64, 0))
    assert shared["host_cpu_us"] == pytest.approx(per_gpu.hash_us + per_gpu.host_cpu_us)
    assert shared["stall_us"] > planner_prediction(backbone, "direct", steps, 0.5, gpu, NO_HOST)["stall_us"]


def test_real_text_hits_less_than_zipf():
    rows = 0.2 * V41.engram.num_rows
    zipf = ZipfMRC(1.0, V41.engram.num_rows // ROWS_PER_TOKEN, ROWS_PER_TOKEN).hit_ratio(rows)
    text = RealTextMRC(ROWS_PER_TOKEN).hit_ratio(rows)
    assert text == 1 - REAL_TEXT_FIRST_TOUCH < zipf  # 20% of 768M rows is past the rows the trace touched


def test_real_text_curve_goes_through_its_measurements_is_monotone_and_inverts():
    curve = RealTextMRC(ROWS_PER_TOKEN)
    for tokens, hit in zip(REAL_TEXT_CACHE_TOKENS, REAL_TEXT_HIT):
        assert curve.hit_ratio(tokens * ROWS_PER_TOKEN) == pytest.approx(hit)
    hits = [curve.hit_ratio(2**k) for k in range(0, 30)]
    assert hits == sorted(hits) and hits[0] >= 0.0
    for h in (0.1, 0.3, 0.5):
        rows = curve.rows_for_hit_rate(h)
        assert curve.hit_ratio(rows) >= h > curve.hit_ratio(rows * 0.99)
    assert curve.rows_for_hit_rate(0.9) is None  # above the curve's ceiling
    # the same text on a table reading half the rows a token needs half the cache
    assert RealTextMRC(ROWS_PER_TOKEN // 2).hit_ratio(1e6) == pytest.approx(curve.hit_ratio(2e6))


def test_without_a_trace_or_zipf_the_planner_uses_real_text():
    curve, label = curve_for(V41)
    assert isinstance(curve, RealTextMRC) and "real text" in label
    assert isinstance(curve_for(V41, zipf=1.0)[0], ZipfMRC)


def plan_nvme(capsys, *flags: str) -> dict:
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "b300", "--gpus", "2", "--batch", "64",
                 "--json", *flags]) == 0
    d = json.loads(capsys.readouterr().out)
    return next(p for p in d["placements"] if p["name"] == "nvme" and p["tp"] == 2) | {"assumptions": d["assumptions"]}


def test_the_host_flags_reach_the_stall(capsys):
    base = plan_nvme(capsys)
    slow = plan_nvme(capsys, "--host-us-per-hit", "5", "--host-us-per-miss", "50")
    none = plan_nvme(capsys, "--host-hash-us-per-step", "0", "--host-hash-us-per-row", "0", "--host-us-per-hit", "0",
                     "--host-us-per-miss", "0")
    more = plan_nvme(capsys, "--host-fetch-cores", "8")
    assert slow["assumptions"]["host_us_per_miss"] == 50.0 and more["assumptions"]["host_fetch_cores"] == 8.0
    assert none["host_us"] == 0.0 < more["host_us"] < base["host_us"] < slow["host_us"]
    assert slow["predicted_stall_us"] > base["predicted_stall_us"]
    assert none["predicted_stall_us"] <= base["predicted_stall_us"]


def test_a_step_reads_each_distinct_row_once():
    """Real text repeats n-grams within a step (a prefill chunk of one file far more than
    decode tokens of separate sequences); the fetch reads and sends each distinct row once,
    and hashing still costs every row id."""
    assert step_unique_fraction(1, 0) == step_unique_fraction(0, 1) == step_unique_fraction(0, 0) == 1.0
    for size, fraction in zip(STEP_TOKENS, DECODE_UNIQUE):
        assert step_unique_fraction(size, 0) == pytest.approx(fraction)
    for size, fraction in zip(PREFILL_TOKENS, PREFILL_UNIQUE):
        assert step_unique_fraction(0, size) == pytest.approx(fraction)
    assert step_unique_fraction(0, 100_000) == pytest.approx(PREFILL_UNIQUE[-1])  # flat past the largest
    mixed = step_unique_fraction(32, 256)  # the tokens' shares of distinct rows, weighted by tokens
    assert mixed == pytest.approx((32 * DECODE_UNIQUE[2] + 256 * PREFILL_UNIQUE[3]) / 288)
    gpu = local_nvme(B300, 2, iops=50_000)
    whole, half = (fetch_time(V41, gpu, 2, "nvme", 512, 0.5, A, u) for u in (1.0, 0.5))
    assert half.nvme_reads == pytest.approx(whole.nvme_reads / 2) and half.link_bytes == pytest.approx(whole.link_bytes / 2)
    assert half.hash_us == whole.hash_us and half.host_cpu_us == pytest.approx(whole.host_cpu_us / 2)
    with pytest.raises(ValueError, match=r"^unique must be within \(0, 1\], got 0.0$"):
        fetch_time(V41, gpu, 2, "nvme", 512, 0.5, A, 0.0)
