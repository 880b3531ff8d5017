"""Per-layer placements in the planner: each Engram layer whole on hbm, dram or nvme."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engram_offload.planner import Workload, get_gpu, get_model, make_plan
from engram_offload.planner.assumptions import DEFAULT_ASSUMPTIONS
from engram_offload.planner.perf import decode_step, layer_offsets_us
from engram_offload.planner.placement import (
    evaluate,
    evaluate_layered,
    fetch_time,
    layer_placements,
    mixed_step_stall_us,
    step_stall_us,
)
from engram_offload.planner.plan import curve_for
from engram_offload.planner.recommend import recommend

GiB = 2**30


def _workload(model, **kw) -> Workload:
    curve, label = curve_for(model)
    return Workload(curve=curve, curve_label=label, **kw)


@pytest.mark.parametrize("name", ["dram", "nvme"])
def test_one_placement_for_every_layer_stalls_as_the_whole_table_does(name):
    model, gpu, a = get_model("deepseek-v4.1-flash"), get_gpu("b300"), DEFAULT_ASSUMPTIONS
    step = decode_step(model, gpu, 2, 256, 32768, a)
    offsets = layer_offsets_us(model, sorted(model.engram.layer_ids), step.backbone_us)
    fetch = fetch_time(model, gpu, 2, name, 256, 0.8, a)
    names = (name,) * len(offsets)
    mixed, per_layer = mixed_step_stall_us({name: fetch}, {name: fetch}, names, offsets, step.backbone_us)
    assert mixed == pytest.approx(step_stall_us(fetch, fetch, offsets, step.backbone_us))
    assert len(per_layer) == len(offsets) and sum(per_layer) <= mixed + 1e-9


def test_the_first_layer_in_dram_and_the_rest_on_nvme_holds_less_dram_and_stalls_less_than_nvme():
    model, gpu = get_model("deepseek-v4.1-flash"), get_gpu("b300")
    w = _workload(model, cache_bytes=0.2 * model.engram.table_bytes, batch=256)
    mixed = evaluate_layered(model, gpu, ("dram", "nvme"), 2, w)
    dram, nvme = evaluate(model, gpu, "dram", 2, w), evaluate(model, gpu, "nvme", 2, w)
    assert mixed.name == "1=dram/14=nvme" and mixed.fits
    assert mixed.host_bytes_per_gpu < dram.host_bytes_per_gpu
    assert mixed.predicted_stall_us < nvme.predicted_stall_us
    # the nvme layer's cache is the whole --cache-bytes: a higher hit rate than the whole table's
    assert mixed.cache_bytes_per_gpu * 2 == pytest.approx(w.cache_bytes)
    assert mixed.cache_hit_rate > nvme.cache_hit_rate
    assert [x["layer"] for x in mixed.layers] == [1, 14]
    assert [x["placement"] for x in mixed.layers] == ["dram", "nvme"]
    assert mixed.layers[0]["dram_bytes_per_gpu"] == pytest.approx(model.engram.table_bytes / 2 / 2)
    assert sum(x["stall_us"] for x in mixed.layers) == pytest.approx(mixed.predicted_stall_us)


def test_the_mixes_weighed_and_bad_names_refused():
    model = get_model("deepseek-v4.1-flash")
    assert layer_placements(model) == [("hbm", "dram"), ("hbm", "nvme"), ("dram", "hbm"), ("dram", "nvme"),
                                       ("nvme", "hbm"), ("nvme", "dram")]
    with pytest.raises(ValueError, match="one of hbm, dram, nvme for each of the 2 Engram layers"):
        evaluate_layered(model, get_gpu("b300"), ("remote", "nvme"), 2, _workload(model))
    with pytest.raises(ValueError, match="for each of the 2 Engram layers"):
        evaluate_layered(model, get_gpu("b300"), ("hbm",), 2, _workload(model))


def test_many_layers_weigh_the_near_tiers_for_the_first_ones():
    model = get_model("deepseek-v4.1-flash")
    many = replace(model, engram=replace(model.engram, layer_ids=(1, 8, 14, 20, 26)))
    mixes = layer_placements(many)
    assert ("hbm", "dram", "dram", "dram", "dram") in mixes and ("dram", "dram", "dram", "dram", "nvme") in mixes
    assert len(mixes) == 8 and all(len(m) == 5 and len(set(m)) == 2 for m in mixes)


def test_the_first_layer_in_hbm_takes_gpu_memory_from_the_kv_cache_and_nothing_from_the_link():
    model, gpu = get_model("deepseek-v4.1-flash"), get_gpu("b300")
    w = _workload(model, batch=256)
    mixed = evaluate_layered(model, gpu, ("hbm", "dram"), 2, w)
    hbm, dram = evaluate(model, gpu, "hbm", 2, w), evaluate(model, gpu, "dram", 2, w)
    half = model.engram.table_bytes / 2 / 2  # one of two layers, per GPU at TP=2
    assert mixed.name == "1=hbm/14=dram" and mixed.fits and not hbm.fits  # the whole table leaves too little KV
    assert mixed.table_hbm_bytes_per_gpu == pytest.approx(half)
    assert mixed.hbm_free_bytes == pytest.approx(dram.hbm_free_bytes - half)
    assert mixed.host_bytes_per_gpu == pytest.approx(half) and mixed.cache_bytes_per_gpu == 0
    assert [x["hbm_bytes_per_gpu"] for x in mixed.layers] == [pytest.approx(half), 0.0]
    assert [x["dram_bytes_per_gpu"] for x in mixed.layers] == [0.0, pytest.approx(half)]
    assert mixed.link_bytes_per_step == pytest.approx(dram.link_bytes_per_step / 2)
    assert mixed.prefill_transfer_us < dram.prefill_transfer_us
    assert "GPU memory (hbm layers)" in mixed.link and "NVMe" not in mixed.link


def test_the_plan_lists_per_layer_placements_beside_whole_table_ones():
    model = get_model("deepseek-v4.1-flash")
    plan = make_plan(model, get_gpu("b300"), _workload(model, cache_bytes=40 * GiB))
    d = plan.to_dict()
    names = {r["name"] for r in d["layered_placements"]}
    assert names == {"1=hbm/14=dram", "1=hbm/14=nvme", "1=dram/14=hbm", "1=dram/14=nvme", "1=nvme/14=hbm",
                     "1=nvme/14=dram"}
    assert {r["name"] for r in d["placements"]} == {"hbm", "dram", "nvme", "remote"}
    ranked = {r["name"] for r in d["recommendation"]["ranking"]}
    assert "1=dram/14=nvme" in ranked  # weighed for the recommendation too


def test_the_reasons_for_a_mix_without_nvme_name_its_hbm_and_no_cache():
    model, gpu = get_model("deepseek-v4.1-flash"), get_gpu("b300")
    w = _workload(model, batch=256)
    mixed = evaluate_layered(model, gpu, ("hbm", "dram"), 2, w)
    assert mixed.cache_hit_rate is None  # no layer behind a cache
    text = " ".join(recommend(model, gpu, [mixed], w).reasons)
    assert "layer 1 on hbm (47.2 GiB HBM per GPU" in text and "layer 14 on dram (47.2 GiB DRAM per GPU" in text
    assert "+ table 47.2 GiB" in text  # the hbm layer's share in the memory sentence
    assert "DRAM cache" not in text and "IOPS" not in text
    with_nvme = evaluate_layered(model, gpu, ("dram", "nvme"), 2, _workload(model, cache_bytes=40 * GiB, batch=256))
    assert "DRAM cache per GPU gives a" in " ".join(recommend(model, gpu, [with_nvme], w).reasons)
