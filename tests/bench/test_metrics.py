"""summarize_run: every figure of a run from samples whose answer is known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engram_offload.bench.engine import EngineRun
from engram_offload.bench.metrics import summarize_run
from engram_offload.bench.workload import Request

MS = 1e-3


def user(itl: list[float] = (), ttft: list[float] = (), output_tokens: int = 0) -> Request:
    return Request(number=0, tokens=np.zeros(1, np.int64), turns=[(1, 2)], itl=list(itl), ttft=list(ttft),
                   output_tokens=output_tokens)


def test_p90_interactivity_is_what_the_slowest_tenth_of_users_get():
    # eleven users decoding at 10, 20, ..., 110 tokens/s: the 10th percentile of the rates
    # is 20 (rank 1 of 0..10), the median 60; the 90th percentile (the best users) is 100
    rates = [10.0 * k for k in range(1, 12)]
    shuffled = [rates[i] for i in (5, 0, 10, 3, 8, 1, 6, 9, 2, 7, 4)]
    users = [user(itl=[1 / r, 1 / r, 1 / r]) for r in shuffled]
    users += [user(ttft=[0.5]), user(itl=[0.0, 0.0])]  # no decode yet, and a zero-latency one: not rated
    s = summarize_run(EngineRun(seconds=1.0, requests=users))
    assert s["users_measured"] == 11
    assert s["p90_interactivity_tok_s_per_user"] == pytest.approx(20.0)
    assert s["interactivity_tok_s_per_user"] == pytest.approx(60.0)


def test_p90_interactivity_interpolates_between_users():
    # two users at 10 and 30 tokens/s: 10% of the way from the slower to the faster is 12
    s = summarize_run(EngineRun(seconds=1.0, requests=[user(itl=[0.1]), user(itl=[1 / 30, 1 / 30])]))
    assert s["p90_interactivity_tok_s_per_user"] == pytest.approx(12.0)
    assert s["interactivity_tok_s_per_user"] == pytest.approx(20.0)


def test_a_users_rate_is_one_over_their_mean_latency():
    # latencies 10 ms and 30 ms average 20 ms: 50 tokens/s (not the mean of 100 and 33.3)
    s = summarize_run(EngineRun(seconds=1.0, requests=[user(itl=[0.010, 0.030])]))
    assert s["interactivity_tok_s_per_user"] == pytest.approx(50.0)
    assert s["p90_interactivity_tok_s_per_user"] == pytest.approx(50.0)


def test_latency_percentiles_in_milliseconds_over_all_samples():
    # 101 latencies 1..101 ms spread over three users: the q-th percentile is 1 + q ms
    samples = [k * MS for k in range(1, 102)]
    users = [user(itl=samples[0:40], ttft=samples[0:40]), user(itl=samples[40:41], ttft=samples[40:41]),
             user(itl=samples[41:], ttft=samples[41:])]
    steps = [k * MS for k in range(101, 0, -1)]
    stalls = [k * MS / 10 for k in range(1, 102)]
    s = summarize_run(EngineRun(seconds=2.0, requests=users, step_seconds=steps, stall_seconds=stalls))
    assert s["p50_itl_ms"] == pytest.approx(51.0)
    assert s["p90_itl_ms"] == pytest.approx(91.0)
    assert s["p99_itl_ms"] == pytest.approx(100.0)
    assert s["ttft_p50_ms"] == pytest.approx(51.0)
    assert s["ttft_p90_ms"] == pytest.approx(91.0)
    assert s["step_p50_ms"] == pytest.approx(51.0)
    assert s["step_p90_ms"] == pytest.approx(91.0)
    assert s["stall_p50_ms"] == pytest.approx(5.1)
    assert s["stall_p90_ms"] == pytest.approx(9.1)
    assert s["stall_fraction"] == pytest.approx(0.1)


def test_counts_throughput_and_rows_per_token():
    users = [user(itl=[0.1], output_tokens=30), user(output_tokens=10), user(output_tokens=0)]
    run = EngineRun(seconds=4.0, steps=9, tokens=200, prefill_tokens=150, decode_tokens=50,
                    rows_requested=1000, rows_unique=300, requests=users, finished=2)
    s = summarize_run(run)
    assert s["seconds"] == 4.0 and s["steps"] == 9
    assert (s["tokens"], s["prefill_tokens"], s["decode_tokens"]) == (200, 150, 50)
    assert s["output_tokens"] == 40
    assert s["requests_started"] == 3 and s["requests_finished"] == 2
    assert s["throughput_tok_s"] == 50.0
    assert s["output_tok_s"] == 10.0
    assert s["rows_per_token"] == 5.0
    assert s["unique_rows_per_token"] == 1.5


def test_an_empty_run_has_no_figures_rather_than_made_up_ones():
    s = summarize_run(EngineRun())
    for key in ("interactivity_tok_s_per_user", "p90_interactivity_tok_s_per_user", "p50_itl_ms",
                "p90_itl_ms", "p99_itl_ms", "ttft_p50_ms", "ttft_p90_ms", "step_p50_ms", "step_p90_ms",
                "stall_p50_ms", "stall_p90_ms"):
        assert s[key] is None, key
    assert s["users_measured"] == 0 and s["output_tokens"] == 0
    assert math.isnan(s["throughput_tok_s"]) and math.isnan(s["output_tok_s"])
    assert s["stall_fraction"] == 0.0
    assert s["rows_per_token"] == 0.0 and s["unique_rows_per_token"] == 0.0


def test_steps_without_stall_samples_have_no_stall_fraction():
    s = summarize_run(EngineRun(seconds=1.0, step_seconds=[0.5, 0.5]))
    assert s["stall_fraction"] == 0.0 and s["stall_p50_ms"] is None
    assert s["step_p50_ms"] == pytest.approx(500.0)


def test_stall_samples_without_step_samples_have_no_stall_fraction():
    s = summarize_run(EngineRun(seconds=1.0, stall_seconds=[0.5]))
    assert s["stall_fraction"] == 0.0 and s["stall_p50_ms"] == pytest.approx(500.0)
