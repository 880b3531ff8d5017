import dataclasses
import json
from pathlib import Path

import pytest

from engram_offload.engram.config import EngramConfig
from engram_offload.planner import (
    DEFAULT_ASSUMPTIONS,
    GPUS,
    MODELS,
    Workload,
    get_gpu,
    get_model,
    make_plan,
    smallest_feasible_tp,
)
from engram_offload.planner.models import PRECISION_BYTES
from engram_offload.planner.perf import decode_step
from engram_offload.planner.placement import evaluate_all
from engram_offload.planner.plan import curve_for
from engram_offload.planner.realtext import step_unique_fraction

from made_up import decode_stall

KiB, GiB = 1024, 2**30
RELEASED_CONFIG = Path(__file__).resolve().parents[1] / "data" / "deepseek-v4.1-flash-config.json"


def plan_for(model="deepseek-v4.1-flash", gpu="b300", **kw):
    m = get_model(model)
    curve, label = curve_for(m)
    return make_plan(m, get_gpu(gpu), Workload(curve=curve, curve_label=label, **kw))


def test_v41_flash_table_and_per_token_bytes():
    d = plan_for().to_dict()
    assert round(d["table_bytes"] / GiB, 1) == 188.8
    assert d["table_bytes"] == 202_758_032_400
    assert round(d["bytes_per_token"] / KiB, 1) == 12.4
    assert round(d["bytes_per_token_per_gpu"]["4"] / KiB, 1) == 3.1
    tp4 = [p for p in d["placements"] if p["tp"] == 4]
    assert tp4 and all(p["bytes_per_token_per_gpu"] == 3168 for p in tp4)


def test_v41_flash_follows_the_released_config():
    data = json.loads(RELEASED_CONFIG.read_text())
    text = data["text_config"]
    m = get_model("deepseek-v4.1-flash")
    assert m.num_layers == text["num_hidden_layers"] == 40
    assert m.hidden_size == text["hidden_size"] == m.engram.hidden_size
    assert m.engram == EngramConfig.from_hf_config(data)
    assert m.first_engram_layer == min(text["engram_layer_ids"])
    assert data["quantization_config"]["expert_dtype"] == "fp4"


def test_v41_flash_weights_follow_the_fp4_fp8_checkpoint():
    m = get_model("deepseek-v4.1-flash")
    assert m.total_params == pytest.approx(552e9, rel=1e-12)
    assert m.active_params_prefill == 8e9 and m.active_params_decode == 16e9
    assert (m.num_experts, m.experts_per_token) == (384, 6)
    [routed] = [g for g in m.weights if g.routed]
    assert routed.precision == "fp4"
    # every layer's 384 experts: gate, up and down projections of hidden x 2,304
    assert routed.params == m.num_layers * m.num_experts * 3 * m.hidden_size * 2304 == 543_581_798_400
    # bf16 embedding and head 2 * 129,280 * 5,120; the rest of the 552B in FP8
    embed = next(g for g in m.weights if g.name == "embedding and head")
    assert (embed.params, embed.precision) == (1_323_827_200, "bf16")
    assert PRECISION_BYTES["fp4"] == 0.53125
    rest = 552e9 - routed.params - embed.params
    assert m.weight_bytes == pytest.approx(routed.params * 0.53125 + rest * (1 + 4 / 128**2) + embed.params * 2,
                                           rel=1e-12)
    assert 298e9 < m.weight_bytes < 299e9
    # the whole system: backbone plus table parameters, "748B" in the article
    total = m.total_params + m.engram.num_rows * m.engram.head_dim
    assert round(total / 1e9) == 749 or round(total / 1e9) == 748


def test_b300_smallest_tp_is_4_in_hbm_and_2_in_dram():
    results = plan_for().placements
    assert smallest_feasible_tp(results, "hbm") == 4
    assert smallest_feasible_tp(results, "dram") == 2
    hbm2 = next(r for r in results if r.name == "hbm" and r.tp == 2)
    assert not hbm2.fits and "left for KV cache" in hbm2.why_not[0]
    dram1 = next(r for r in results if r.name == "dram" and r.tp == 1)
    assert any("exceed" in w for w in dram1.why_not)  # 298.5 GB of weights > one 288 GB GPU


@pytest.mark.parametrize("kv_fraction", [0.02, 0.05, 0.10, 0.20, 0.35])
def test_b300_result_is_robust_to_the_kv_reserve(kv_fraction):
    a = dataclasses.replace(DEFAULT_ASSUMPTIONS, min_kv_fraction=kv_fraction)
    m = get_model("deepseek-v4.1-flash")
    results = evaluate_all(m, get_gpu("b300"), Workload(curve=curve_for(m)[0]), a)
    assert smallest_feasible_tp(results, "hbm") == 4
    assert smallest_feasible_tp(results, "dram") == 2


def test_all_fp8_weights_would_not_fit_b300_at_tp2():
    m = get_model("deepseek-v4.1-flash")
    fp8 = dataclasses.replace(m, weights=tuple(dataclasses.replace(g, precision="fp8") for g in m.weights))
    results = evaluate_all(fp8, get_gpu("b300"), Workload(curve=curve_for(m)[0]))
    assert smallest_feasible_tp(results, "dram") == 4


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_preset_model_and_gpu_gets_an_answer(model, gpu):
    plan = plan_for(model, gpu)
    d = plan.to_dict()
    m, g, a = plan.model, plan.gpu, plan.assumptions
    assert [(p["name"], p["tp"]) for p in d["placements"]] == [
        (name, tp) for name in ("hbm", "dram", "nvme", "remote") for tp in (1, 2, 4, 8)]
    for p in d["placements"]:
        tp = p["tp"]
        table_in_hbm = m.engram.table_bytes / tp if p["name"] == "hbm" else 0.0
        free = max(0.0, a.gpu_memory_utilization * g.hbm_bytes - m.weight_bytes / tp - table_in_hbm
                   - a.runtime_overhead_bytes)
        assert p["hbm_free_bytes"] == pytest.approx(free)
        assert p["kv_fraction"] == pytest.approx(free / g.hbm_bytes)  # of all HBM, not of the usable share
        kv_per_seq = 32768 * m.kv_bytes_per_token / (1 if m.kv_replicated_across_tp else tp)
        assert p["max_concurrent_seqs"] == int(free // kv_per_seq)
        assert p["fits"] == (not p["why_not"])
        # each Engram layer waits for its own rows: never longer than if all of them were due at
        # the first Engram layer, never shorter than all of them being due at the last
        first, last = min(m.engram.layer_ids), max(m.engram.layer_ids)
        assert p["predicted_stall_us"] <= max(0.0, p["transfer_us"] - p["window_us"]) + 1e-9
        assert p["predicted_stall_us"] >= max(0.0, p["transfer_us"] - p["window_us"] * last / first) - 1e-9
        assert p["nvme_iops_needed"] <= p["nvme_iops_available"] or p["name"] != "nvme"
        if p["batch"]:
            assert p["step_us"] == pytest.approx(1e6 / p["interactivity"])
    rec = d["recommendation"]
    assert rec["reasons"]
    if rec["placement"] is not None:
        chosen = next(p for p in d["placements"] if p["name"] == rec["placement"] and p["tp"] == rec["tp"])
        assert chosen["fits"]


def test_dram_stall_appears_when_the_link_is_slow():
    m = get_model("deepseek-v4.1-flash")
    slow = dataclasses.replace(get_gpu("b300"), host_link_bw=0.05e9)
    results = evaluate_all(m, slow, Workload(curve=curve_for(m)[0], batch=256))
    dram = next(r for r in results if r.name == "dram" and r.tp == 4)
    unique = step_unique_fraction(256, 0)  # the step's distinct row ids cross the link once
    assert dram.link_bytes_per_step == pytest.approx(256 * 3168 * unique)
    a = DEFAULT_ASSUMPTIONS
    # the link, and the host's CPU hashing the step's row ids before the fetch (the GPU reads
    # the rows from pinned DRAM itself)
    rows_us = 256 * 3168 * unique / (0.05e9 * a.host_link_efficiency) * 1e6
    fixed_us = a.host_link_latency_us + a.host_hash_us_per_step + 256 * 48 * a.host_hash_us_per_row
    step = decode_step(m, slow, 4, 256, 32768, a).backbone_us
    assert dram.transfer_us == pytest.approx(fixed_us + rows_us, rel=1e-9)
    assert dram.predicted_stall_us > 0
    assert dram.predicted_stall_us == pytest.approx(decode_stall(fixed_us, rows_us, step, m), rel=1e-9)


def test_nvme_cache_follows_the_target_hit_rate():
    lo = plan_for(target_hit_rate=0.5).placements
    hi = plan_for(target_hit_rate=0.95).placements
    pick = lambda rs: next(r for r in rs if r.name == "nvme" and r.tp == 4)  # noqa: E731
    assert pick(lo).cache_bytes_per_gpu < pick(hi).cache_bytes_per_gpu
    assert pick(lo).nvme_iops_needed > pick(hi).nvme_iops_needed


def test_low_interactivity_floor_favours_the_dram_tp2_replica():
    plan = plan_for(min_interactivity=20)
    rec = plan.recommendation
    assert (rec.choice.name, rec.choice.tp) == ("dram", 2)
    assert any("smallest workable TP is 4" in r for r in rec.reasons)


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="b300"):
        get_gpu("a100")
    with pytest.raises(ValueError, match="deepseek-v4.1-flash"):
        get_model("nope")
    assert get_gpu("B300") is get_gpu("b300")
