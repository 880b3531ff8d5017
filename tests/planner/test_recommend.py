"""recommend: ranking of feasible placements and the reasons given, on hand-made results."""

from __future__ import annotations

import dataclasses

import pytest

from engram_offload.planner import Workload, get_model
from engram_offload.planner.placement import PlacementResult
from engram_offload.planner.recommend import recommend

from made_up import GPU as MADE_UP_GPU
from made_up import GiB

GPU = dataclasses.replace(MADE_UP_GPU, price_per_hour=2.5)
MODEL = get_model("engram-27b")
TABLE = MODEL.engram.table_bytes
FIRST = MODEL.first_engram_layer
W = Workload(context=4096, gpus=8, min_interactivity=50.0, curve_label="test curve")


def result(name: str, tp: int, score: float, *, meets: bool = True, stall: float = 0.0, fits: bool = True,
           **fields) -> PlacementResult:
    r = PlacementResult(name=name, tp=tp, fits=fits, tokens_per_s_per_gpu=score,
                        tokens_per_dollar=fields.pop("tokens_per_dollar", score * 1e3),
                        meets_interactivity=meets, predicted_stall_us=stall, interactivity=fields.pop("inter", 60.0),
                        batch=fields.pop("batch", 8), **fields)
    if not fits:
        r.why_not.append(f"{name} at {tp} does not fit")
    return r


def picks(results, objective="tokens-per-gpu", workload=W):
    rec = recommend(MODEL, GPU, results, workload, objective)
    return (rec.choice.name, rec.choice.tp) if rec.choice else None, rec


def test_the_best_score_that_meets_the_floor_wins():
    choice, rec = picks([result("hbm", 4, 100.0), result("dram", 4, 120.0), result("remote", 8, 200.0, meets=False)])
    assert choice == ("dram", 4)
    assert [(r.name, r.tp) for r in rec.ranking] == [("dram", 4), ("hbm", 4), ("remote", 8)]


def test_within_five_percent_prefer_no_stall_then_fewer_gpus_then_the_simpler_tier():
    assert picks([result("hbm", 4, 100.0), result("dram", 2, 95.0)])[0] == ("dram", 2)  # 95% is a tie
    assert picks([result("hbm", 4, 100.0), result("dram", 2, 94.9)])[0] == ("hbm", 4)
    assert picks([result("dram", 2, 100.0, stall=5.0), result("dram", 4, 99.0)])[0] == ("dram", 4)
    _, rec = picks([result("nvme", 2, 100.0), result("remote", 2, 99.0), result("dram", 2, 98.0),
                    result("hbm", 2, 97.0), result("hbm", 1, 10.0)])
    assert [(r.name, r.tp) for r in rec.ranking] == [("hbm", 2), ("dram", 2), ("remote", 2), ("nvme", 2), ("hbm", 1)]
    _, rec = picks([result("dram", 2, 96.0), result("dram", 2, 100.0, batch=4)])
    assert [r.tokens_per_s_per_gpu for r in rec.ranking] == [100.0, 96.0]  # same rank: the higher score first


def test_before_the_tie_a_stall_and_the_tp_break_equal_scores():
    _, rec = picks([result("dram", 4, 50.0, meets=False, inter=40.0, stall=3.0),
                    result("dram", 8, 50.0, meets=False, inter=40.0), result("dram", 2, 50.0, meets=False, inter=40.0)])
    assert [r.tp for r in rec.ranking] == [2, 8, 4]


def test_the_objective_changes_the_score():
    results = [result("hbm", 4, 100.0), result("dram", 4, 200.0)]
    results[0].tokens_per_dollar = 9e9
    assert picks(results, "tokens-per-dollar")[0] == ("hbm", 4)
    assert picks(results, "tokens-per-gpu")[0] == ("dram", 4)
    _, rec = picks(results, "tokens-per-dollar")
    assert [x["score"] for x in rec.to_dict()["ranking"]] == [9e9, 200e3]
    with pytest.raises(ValueError, match="unknown objective 'speed'; choose one of: tokens-per-gpu, tokens-per-dollar"):
        recommend(MODEL, GPU, results, W, "speed")


def test_when_none_meets_the_floor_the_most_interactive_feasible_one_is_chosen():
    choice, rec = picks([result("hbm", 4, 900.0, meets=False, inter=30.0), result("dram", 2, 10.0, meets=False, inter=45.0),
                         result("dram", 1, 1e6, fits=False, inter=99.0)])
    assert choice == ("dram", 2)
    assert rec.reasons[-1] == ("No feasible placement reaches 50 tokens/s per user; this is the closest. "
                               "Lower --min-interactivity or add GPUs.")
    assert "(misses the 50 floor)" in rec.reasons[-2]


def test_nothing_fits():
    results = [result(n, tp, 1.0, fits=False) for n in ("hbm", "dram") for tp in (1, 8)]
    choice, rec = picks(results)
    assert choice is None and rec.ranking == []
    assert rec.reasons == ["Nothing fits on 8 x test GPU at 4,096 tokens of context.", "dram at TP=8: dram at 8 does not fit",
                           "Try more GPUs (--gpus), a shorter --context, or a GPU with more HBM."]
    assert rec.smallest_tp == {"hbm": None, "dram": None, "nvme": None, "remote": None}
    d = rec.to_dict()
    assert (d["placement"], d["tp"], d["batch"], d["tokens_per_s_per_gpu"], d["tokens_per_dollar"],
            d["interactivity"]) == (None,) * 6
    assert d["objective"] == "tokens-per-gpu" and d["reasons"] == rec.reasons
    assert picks([result("hbm", 1, 1.0, fits=False)])[1].reasons[1].startswith("Try more GPUs")


def dram_choice(**fields) -> PlacementResult:
    base = dict(batch=16, bytes_per_token_per_gpu=2560, link="test link", link_bytes_per_step=16 * 2560,
                transfer_us=123.4, window_us=456.7, weight_bytes_per_gpu=20 * GiB, hbm_free_bytes=50 * GiB,
                max_concurrent_seqs=1234, inter=61.0, tokens_per_dollar=2.5e6)
    base.update(fields)
    score = base.pop("score", 900.0)
    return result("dram", 2, score, **base)


def test_the_reasons_for_a_dram_choice():
    results = [result("hbm", 4, 800.0), result("hbm", 2, 1.0, fits=False), dram_choice()]
    _, rec = picks(results)
    assert rec.smallest_tp == {"hbm": 4, "dram": 2, "nvme": None, "remote": None}
    assert rec.reasons == [
        f"With the {TABLE / GiB:.1f} GiB table in HBM the smallest workable TP is 4; in host DRAM it is 2: "
        f"moving the table frees {TABLE / 2 / GiB:.1f} GiB of HBM per GPU at TP=2.",
        "dram at TP=2: weights 20.0 GiB per GPU leave 50.0 GiB for KV cache, 1,234 sequences of 4,096 tokens "
        "per replica.",
        "Each decode step moves 16 x 2,560 B = 40.0 KiB per GPU over test link; its fetch takes about 123 us; the layers "
        f"before Engram layer {FIRST} take 457 us, and each Engram layer waits only for its own rows: no stall.",
        "At batch 16: 900 tokens/s per GPU, 61 tokens/s per user (meets the 50 floor), 2.5M tokens per dollar "
        "at $2.50/GPU-hour.",
        "Against the best all-HBM option (hbm at TP=4, batch 8): 1.12x on this objective.",
    ]


def test_the_reasons_for_a_stalling_dram_choice_with_a_prefill_wait():
    results = [dram_choice(stall=12.6, prefill_stall_us=2345.0, link_bytes_per_step=3 * 2**20)]
    _, rec = picks(results)
    assert rec.reasons[0] == f"The {TABLE / GiB:.1f} GiB table does not fit in HBM at any TP up to 8."
    assert rec.reasons[2].endswith("= 3.0 MiB per GPU over test link; its fetch takes about 123 us; the layers before Engram "
                                   f"layer {FIRST} take 457 us, and each Engram layer waits only for its own "
                                   "rows: a 13 us stall per step.")
    assert rec.reasons[3] == ("A prefill chunk of 8,192 tokens waits 2.3 ms for its rows: the plugin reads them at the "
                              "chunk's own step, not a chunk ahead.")


def test_the_reasons_for_an_hbm_choice():
    hbm = result("hbm", 2, 1000.0, weight_bytes_per_gpu=20 * GiB, table_hbm_bytes_per_gpu=5 * GiB,
                 hbm_free_bytes=600 * 2**20, max_concurrent_seqs=3, batch=3, inter=70.0)
    hbm.tokens_per_dollar = 1.44e6
    _, rec = picks([hbm, result("dram", 1, 500.0, fits=False), result("dram", 2, 900.0, batch=4)])
    assert rec.reasons == [
        "Smallest workable TP: 2 with the table in HBM, 2 in DRAM.",
        "hbm at TP=2: weights 20.0 GiB + table 5.0 GiB per GPU leave 600.0 MiB for KV cache, "
        "3 sequences of 4,096 tokens per replica.",
        "At batch 3: 1,000 tokens/s per GPU, 70 tokens/s per user (meets the 50 floor), 1.4M tokens per dollar "
        "at $2.50/GPU-hour.",
        "Against the best offloaded option (dram at TP=2, batch 4): 1.11x on this objective.",
    ]


def test_the_reasons_for_an_nvme_choice_and_the_fewest_gpus():
    nvme = result("nvme", 4, 500.0, cache_bytes_per_gpu=3 * GiB, cache_hit_rate=0.873, nvme_iops_needed=1_234_567,
                  nvme_iops_available=8e6, bytes_per_token_per_gpu=100, link_bytes_per_step=800, transfer_us=10.0,
                  window_us=20.0)
    small = result("remote", 1, 10.0, stall=7.0, inter=55.0)
    smaller_stall = result("dram", 1, 9.0, stall=1.0, inter=52.0)
    _, rec = picks([nvme, small, smaller_stall], workload=dataclasses.replace(W, gpus=4))
    assert rec.choice is nvme
    assert ("A 3.0 GiB DRAM cache per GPU gives a 87% hit rate (test curve); misses need 1,235k IOPS per server "
            "of 8.0M.") in rec.reasons
    assert rec.reasons[0] == f"The {TABLE / GiB:.1f} GiB table does not fit in HBM at any TP up to 4."
    assert rec.reasons[-1] == (
        "Fewest GPUs per replica: dram at TP=1 (9 tokens/s per GPU at 52 tokens/s per user); the roofline does "
        "not charge TP's kernel and synchronisation overheads beyond all-reduce latency, so measured gains from "
        "a lower TP can exceed this estimate.")
    assert not any(r.startswith("Against") for r in rec.reasons)  # no all-HBM option meets the floor


def test_no_comparison_with_an_option_of_no_score():
    _, rec = picks([dram_choice(), result("hbm", 8, 0.0)])
    assert not any(r.startswith("Against") for r in rec.reasons)
    _, rec = picks([dram_choice(), result("hbm", 8, 1.0, meets=False)])
    assert not any(r.startswith("Against") for r in rec.reasons)


def test_byte_sizes_in_reasons():
    for free, text in [(GiB, "1.0 GiB"), (GiB - 1, "1024.0 MiB"), (2**20, "1.0 MiB"), (2**20 - 1, "1024.0 KiB"),
                       (512, "0.5 KiB")]:
        _, rec = picks([dram_choice(hbm_free_bytes=free)])
        assert f"leave {text} for KV cache" in rec.reasons[1], (free, rec.reasons[1])


def test_the_per_dollar_objective_ranks_chooses_and_compares_by_dollars():
    cheap = result("hbm", 8, 1.0, tokens_per_dollar=9e9)  # few tokens per GPU, many per dollar
    fast = result("dram", 4, 200.0, tokens_per_dollar=2e5)
    assert picks([cheap, fast], "tokens-per-dollar")[0] == ("hbm", 8)
    # within 5% in dollars (not in tokens per GPU): the smaller TP
    close = result("dram", 4, 1.0, tokens_per_dollar=8.6e9)
    assert picks([cheap, close], "tokens-per-dollar")[0] == ("dram", 4)
    # no comparison with an option worth no tokens per dollar, however many tokens per GPU it makes
    _, rec = picks([result("dram", 2, 1.0, tokens_per_dollar=1e6), result("hbm", 2, 1e3, tokens_per_dollar=0.0)],
                   "tokens-per-dollar")
    assert not any(r.startswith("Against") for r in rec.reasons)
    # equal in everything but the score: the higher score in dollars first
    a, b = result("dram", 2, 1.0, tokens_per_dollar=100.0), result("dram", 2, 50.0, tokens_per_dollar=96.0)
    assert picks([b, a], "tokens-per-dollar")[1].ranking == [a, b]
    _, rec = picks([result("hbm", 2, 100.0, tokens_per_dollar=1e6), result("dram", 2, 10.0, tokens_per_dollar=2e6)],
                   "tokens-per-dollar")
    assert rec.reasons[-1] == "Against the best all-HBM option (hbm at TP=2, batch 8): 2.00x on this objective."


def test_any_stall_counts_as_a_stall():
    assert picks([result("dram", 2, 100.0, stall=0.5), result("dram", 4, 99.0)])[0] == ("dram", 4)
    _, rec = picks([result("dram", 2, 1.0, meets=False, inter=40.0, stall=0.5),
                    result("dram", 8, 1.0, meets=False, inter=40.0)])
    assert [r.tp for r in rec.ranking] == [8, 2]
    _, rec = picks([dram_choice(prefill_stall_us=0.5)])
    assert "A prefill chunk of 8,192 tokens waits 0.0 ms" in rec.reasons[3]


def test_a_comparison_with_a_small_but_positive_score():
    _, rec = picks([dram_choice(), result("hbm", 8, 0.5)])
    assert rec.reasons[-1] == "Against the best all-HBM option (hbm at TP=8, batch 8): 1800.00x on this objective."


def test_figures_in_reasons_are_rounded_from_the_right_units():
    nvme = result("nvme", 2, 500.0, cache_bytes_per_gpu=GiB, cache_hit_rate=None, nvme_iops_needed=1e5,
                  nvme_iops_available=8.75e6, tokens_per_dollar=1.75e6)
    _, rec = picks([nvme])
    assert "the in-graph schedule" in rec.reasons[3]  # a host-read choice: the plugin's wait named
    assert "gives a 0% hit rate (test curve); misses need 100k IOPS per server of 8.8M." in rec.reasons[4]
    assert rec.reasons[5].endswith("1.8M tokens per dollar at $2.50/GPU-hour.")
    _, rec = picks([dram_choice(prefill_stall_us=1750.0)])
    assert rec.reasons[3].startswith("A prefill chunk of 8,192 tokens waits 1.8 ms for its rows")


def test_a_recommendation_as_a_plain_dict():
    chosen = dram_choice()
    rec = recommend(MODEL, GPU, [chosen, result("hbm", 4, 10.0)], W)  # the default objective: tokens per GPU
    assert rec.objective == "tokens-per-gpu"
    d = rec.to_dict()
    assert d == {"objective": "tokens-per-gpu", "placement": "dram", "tp": 2, "batch": 16,
                 "tokens_per_s_per_gpu": 900.0, "tokens_per_dollar": 2.5e6, "interactivity": 61.0,
                 "ranking": [{"name": "dram", "tp": 2, "score": 900.0}, {"name": "hbm", "tp": 4, "score": 10.0}],
                 "smallest_tp": {"hbm": 4, "dram": 2, "nvme": None, "remote": None}, "reasons": rec.reasons}
