"""``bench-tier --prefetcher``: real-text decode steps through the Prefetcher, the figures of the
cold and warm phases, the row check, and flags that do not go together."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from engram_offload import cli
from engram_offload.bench.corpus import Corpus
from engram_offload.bench.prefetch_bench import DecodeSteps, PrefetchPhase, _check_rows, _replayed
from engram_offload.bench.tier_bench import run_tier_bench

SCALE = "2e-5"  # deepseek-v4.1-flash at 2e-5: about 23 k rows of 264 bytes
TEXT = ["--corpus-tokens", "6000", "--seconds", "0.5"]
KEYS = ("rows_per_s", "misses_per_s", "cpu_us_per_miss", "cpu_us_per_hit", "hit_rate", "steps", "tokens",
        "step_ms_p50", "step_ms_p99", "reads_per_s", "hash_dedup_cpu_us_per_token", "method", "cache", "warm")


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("prefetcher") / "t.tbl")
    assert cli.main(["make-table", "--scale", SCALE, "--out", path, "--no-progress"]) == 0
    return path


def bench_tier(capsys, *argv: str) -> dict:
    capsys.readouterr()
    assert cli.main(["bench-tier", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cold_direct_with_a_cache_reports_consistent_figures(table, capsys):
    r = bench_tier(capsys, "--table", table, "--tier", "direct", "--cache-bytes", "50%", "--prefetcher", "--cold",
                   "--sequences", "8", "--check", *TEXT)
    for key in KEYS:
        assert key in r, key
    assert r["mode"] == "prefetcher" and r["cold"] and r["cold_method"] == ["posix_fadvise(DONTNEED)"]
    assert r["sequences"] == 8 and r["run_ahead"] == 2 and r["caller_threads"] == 1
    assert r["tokens"] == 8 * r["steps"] > 0
    assert 0 < r["misses"] <= r["rows"] <= r["rows_requested"] == r["tokens"] * 48  # 2 layers x 24 columns
    assert r["hits"] == r["rows"] - r["misses"]
    assert r["hit_rate"] == pytest.approx(1 - r["misses"] / r["rows"], abs=1e-9)
    assert r["rows_per_s"] == pytest.approx(r["rows"] / r["seconds"])
    assert r["misses_per_s"] == pytest.approx(r["misses"] / r["seconds"])
    assert r["reads"] > 0 and r["reads_per_s"] > 0  # a cold table: the misses went to the device
    assert r["cache"]["store"]["rows_unique"] == r["rows"] and r["cache"]["levels"][-1]["rows"] == r["misses"]
    warm = r["warm"]
    assert warm["hit_rate"] == 1.0 and warm["misses"] == 0 and warm["rows"] > 0 and warm["replayed_steps"] >= 1
    assert r["cpu_us_per_hit"] == pytest.approx(warm["cpu_seconds"] / warm["rows"] * 1e6)
    cold_cpu = r["cpu_us_per_hit"] * r["hits"] + r["cpu_us_per_miss"] * r["misses"]
    assert cold_cpu == pytest.approx(r["cpu_seconds"] * 1e6)  # the method, as stated
    assert r["cpu_us_per_hit"] > 0 and r["hash_dedup_cpu_us_per_token"] > 0
    # the fetch loop's share: the workers' CPU, split the same way, never more than the process's
    assert r["fetch_cpu_us_per_hit"] == pytest.approx(warm["fetch_cpu_seconds"] / warm["rows"] * 1e6)
    fetch_cpu = r["fetch_cpu_us_per_hit"] * r["hits"] + r["fetch_cpu_us_per_miss"] * r["misses"]
    assert fetch_cpu == pytest.approx(r["fetch_cpu_seconds"] * 1e6)
    assert 0 < r["fetch_cpu_seconds"] <= r["cpu_seconds"] and warm["fetch_cpu_seconds"] <= warm["cpu_seconds"]
    # a missed row's CPU split into the kernel's (system time) and the process's, the same way
    assert r["kernel_cpu_us_per_miss"] + r["user_cpu_us_per_miss"] == pytest.approx(r["cpu_us_per_miss"])
    kernel_per_hit = warm["kernel_cpu_seconds"] / warm["rows"] * 1e6
    kernel_cpu = kernel_per_hit * r["hits"] + r["kernel_cpu_us_per_miss"] * r["misses"]
    assert kernel_cpu == pytest.approx(r["kernel_cpu_seconds"] * 1e6)
    assert 0 < r["kernel_cpu_seconds"] <= r["cpu_seconds"] and warm["kernel_cpu_seconds"] <= warm["cpu_seconds"]
    assert r["fp8_decode"] in ("avx512", "avx2", "table", "numpy")
    assert r["step_ms_p99"] >= r["step_ms_p50"] > 0
    assert r["check"]["equal"] and r["check"]["rows"] > 0 and r["check"]["reference"] == "mmap"
    assert "cpu_us_per_miss" in r["method"]


def test_without_a_cache_every_row_is_a_miss(table, capsys):
    r = bench_tier(capsys, "--table", table, "--tier", "mmap", "--prefetcher", "--run-ahead", "3", *TEXT)
    assert not r["cold"] and r["cold_method"] == [] and r["run_ahead"] == 3 and r["sequences"] == 256
    assert r["hit_rate"] == 0.0 and r["misses"] == r["rows"] > 0 and r["hits"] == 0
    assert r["warm"] is None and r["cpu_us_per_hit"] is None and r["cache"] is None
    assert r["cpu_us_per_miss"] == pytest.approx(r["cpu_us_per_row"])


def test_the_plain_output(table, capsys):
    capsys.readouterr()
    assert cli.main(["bench-tier", "--table", table, "--tier", "memory", "--cache-bytes", "10%", "--prefetcher",
                     *TEXT]) == 0
    out = capsys.readouterr().out
    assert "Prefetcher: 256 sequences per decode step, 2 steps in flight" in out
    assert "missed rows/s" in out and "per hit row" in out and "lfu cache" in out
    assert re.search(r"CPU per missed row \d+\.\d\d us \(kernel -?\d+\.\d\d us, process \d+\.\d\d us\)", out)


@pytest.mark.parametrize("flags,message", [
    (["--prefetcher", "--callers", "2"],
     "--callers is for random gathers; with --prefetcher give --run-ahead (steps in flight from the one caller)"),
    (["--prefetcher", "--batch", "64"],
     "--batch is for random gathers; with --prefetcher give --sequences (sequences per decode step)"),
    (["--sequences", "4"], "--sequences only applies to decode steps: add --prefetcher"),
    (["--run-ahead", "2", "--check"], "--run-ahead, --check only apply to decode steps: add --prefetcher"),
])
def test_flags_of_the_other_mode_are_usage_errors(table, capsys, flags, message):
    assert cli.main(["bench-tier", "--table", table, "--tier", "mmap", "--seconds", "0.1", *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [f"engram-offload bench-tier: error: {message}"]


@pytest.mark.parametrize("flag", ["--sequences", "--run-ahead", "--corpus-tokens"])
def test_bad_counts_are_usage_errors(table, capsys, flag):
    assert cli.main(["bench-tier", "--table", table, "--tier", "mmap", "--prefetcher", flag, "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"engram-offload bench-tier: error: argument {flag}: '0' is not an integer >= 1 "
        "(see engram-offload bench-tier --help)"]


def test_the_benchmark_refuses_callers_and_bad_counts(table):
    with pytest.raises(ValueError, match="one caller"):
        run_tier_bench(table, "mmap", prefetcher=True, callers=2)
    with pytest.raises(ValueError, match="run_ahead must be >= 1"):
        run_tier_bench(table, "mmap", prefetcher=True, run_ahead=0)


def _corpus() -> Corpus:
    return Corpus("numbers", (np.arange(10, 2010, dtype=np.int64), np.arange(5000, 7000, dtype=np.int64)), "test")


def test_decode_steps_feed_each_sequence_its_next_token():
    steps = iter(DecodeSteps(_corpus(), sequences=3))
    fed: dict[int, list[int]] = {}
    finished = []
    for _ in range(1030):  # past the first sequences' 1024 tokens
        seq_ids, tokens, done = next(steps)
        assert len(seq_ids) == len(set(seq_ids)) == 3 and tokens.shape == (3,)  # one token each
        for s, t in zip(seq_ids, tokens):
            fed.setdefault(s, []).append(int(t))
        finished += done
    assert finished == [1, 2, 3]  # each replaced after its last token, under a new id
    assert fed[1] == list(range(10, 1034))  # consecutive corpus tokens, across documents
    assert fed[2] == list(range(1034, 2010)) + list(range(5000, 5048))
    assert fed[3] == list(range(5048, 6072))
    assert sorted(fed) == [1, 2, 3, 4, 5, 6] and fed[4][:2] == [6072, 6073]


def test_replays_use_fresh_sequence_ids_and_finish_them():
    recorded = [([1, 2], [np.array([5]), np.array([6])], []), ([1, 2], [np.array([7]), np.array([8])], [])]
    replay = _replayed(recorded)
    first = [next(replay) for _ in range(2)]
    second = [next(replay) for _ in range(2)]
    assert [s for s, _, _ in first] == [[1, 2], [1, 2]] and first[1][2] == [1, 2]
    new_ids = second[0][0]
    assert not set(new_ids) & {1, 2} and second[1][0] == new_ids  # fresh histories, the same in every step
    assert second[0][2] == [] and second[1][2] == new_ids  # finished after the pass
    assert [int(p[0]) for p in second[1][1]] == [7, 8]


def test_the_check_catches_a_wrong_row(table):
    from engram_offload.serving.store import open_table

    ids = torch.tensor([[[0, 5], [100, 7]]])  # [T=1, L=2, C=2]
    with open_table(table, "mmap") as store:
        rows = store.gather(ids)  # [1, 2, 2, head_dim]
    good = PrefetchPhase(samples=[(ids, rows.clone())])
    assert _check_rows(table, [good])["rows"] == 4
    rows[0, 1, 0, 3] += 1.0
    with pytest.raises(RuntimeError, match="1 rows the Prefetcher returned differ"):
        _check_rows(table, [PrefetchPhase(samples=[(ids, rows)])])
