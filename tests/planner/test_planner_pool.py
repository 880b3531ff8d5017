"""``plan --pool-rtt-us/--pool-gbps``: the remote placement's round trip and bandwidth."""

from __future__ import annotations

import json

import pytest

from engram_offload.cli import main
from engram_offload.planner.assumptions import DEFAULT_ASSUMPTIONS, POOL_ROW_BYTES, POOL_ROWS_PER_S
from engram_offload.planner.realtext import step_unique_fraction

BATCH, TP = 64, 2
# the host hashes every row id of the step's tokens (48 a token) before it asks the pool
HASH_US = DEFAULT_ASSUMPTIONS.host_hash_us_per_step + BATCH * 48 * DEFAULT_ASSUMPTIONS.host_hash_us_per_row
UNIQUE = step_unique_fraction(BATCH, 0)  # the step's distinct row ids: each fetched once


def remote(capsys, *flags: str) -> tuple[dict, int]:
    """The remote placement at TP=2 and a fixed batch, and the bytes per token per GPU."""
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "b300", "--gpus", "2", "--batch", str(BATCH),
                 "--json", *flags]) == 0
    d = json.loads(capsys.readouterr().out)
    [r] = [p for p in d["placements"] if p["name"] == "remote" and p["tp"] == TP]
    return r, d["bytes_per_token_per_gpu"][str(TP)]


def expected_stall(rtt_us: float, gbps: float, bytes_per_token: int, window_us: float) -> float:
    """The decode step's stall: hashing, one round trip, then the step's rows at the pool's
    bandwidth, Engram layer 1's half of the rows due at layer 1 (after ``window_us``), all of
    them at layer 14 (14 times as far into the step)."""
    rows_us = BATCH * bytes_per_token * UNIQUE / (gbps * 1e9 / 8) * 1e6
    fixed = HASH_US + rtt_us
    return max(0.0, fixed + rows_us / 2 - window_us, fixed + rows_us - 14 * window_us)


def test_the_defaults_are_the_loopback_measurements(capsys):
    assert DEFAULT_ASSUMPTIONS.remote_bw == POOL_ROWS_PER_S * POOL_ROW_BYTES == 808e3 * 264
    assert DEFAULT_ASSUMPTIONS.remote_latency_us == 18.0
    r, bpt = remote(capsys)
    assert r["predicted_stall_us"] == pytest.approx(expected_stall(18.0, 808e3 * 264 * 8 / 1e9, bpt, r["window_us"]))
    assert r["predicted_stall_us"] > 0  # 1.7 Gb/s does not keep up with a step of 64 tokens


@pytest.mark.parametrize("rtt, gbps", [(18.0, 1.0), (18.0, 4.0), (200.0, 4.0), (0.0, 0.5)])
def test_the_flags_set_the_stall_the_formula_gives(capsys, rtt, gbps):
    r, bpt = remote(capsys, "--pool-rtt-us", str(rtt), "--pool-gbps", str(gbps))
    assert r["transfer_us"] == pytest.approx(HASH_US + rtt + BATCH * bpt * UNIQUE / (gbps * 1e9 / 8) * 1e6)
    assert r["predicted_stall_us"] == pytest.approx(expected_stall(rtt, gbps, bpt, r["window_us"]))


def test_more_bandwidth_and_a_shorter_round_trip_shorten_the_stall_by_the_formula(capsys):
    slow, bpt = remote(capsys, "--pool-rtt-us", "100", "--pool-gbps", "1")
    faster, _ = remote(capsys, "--pool-rtt-us", "100", "--pool-gbps", "2")
    nearer, _ = remote(capsys, "--pool-rtt-us", "40", "--pool-gbps", "1")
    rows_us_at_1gbps = BATCH * bpt * UNIQUE / (1e9 / 8) * 1e6
    assert slow["predicted_stall_us"] > 0
    # layer 1 waits for its half of the rows, which take half as long at twice the bandwidth
    assert slow["predicted_stall_us"] - faster["predicted_stall_us"] == pytest.approx(rows_us_at_1gbps / 4)
    assert slow["predicted_stall_us"] - nearer["predicted_stall_us"] == pytest.approx(60.0)
    # the other placements do not depend on the pool
    assert slow["window_us"] == faster["window_us"] == nearer["window_us"]


@pytest.mark.parametrize("flags", [["--pool-gbps", "0"], ["--pool-rtt-us", "-1"], ["--pool-gbps", "fast"]])
def test_bad_pool_figures_are_usage_errors(capsys, flags):
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "b300", *flags]) == 2
    assert f"argument {flags[0]}" in capsys.readouterr().err
