"""``engram-offload bench`` end to end on a tiny table: every tier and cache state, JSON, plot."""

from __future__ import annotations

import json
import socket

import pytest

from engram_offload.cli import main
from engram_offload.planner import get_model
from engram_offload.planner.plan import curve_for
from engram_offload.pool.layout import fingerprint
from engram_offload.pool.publish import pool_status
from engram_offload.table import read_header
from engram_offload.tiers.mmap import guarded_copy_available

from redis_servers import redis_single, skip_without_redis  # noqa: F401 (fixture)

KEYS = {"tier", "cache_state", "concurrency", "throughput_tok_s", "interactivity_tok_s_per_user", "p90_itl_ms",
        "stall_fraction", "hit_rate", "budget_enforced"}


@pytest.fixture(scope="module")
def tiny_table(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.table"
    assert main(["make-table", "--preset", "deepseek-v4.1-flash", "--scale", "0.0001", "--out", str(path),
                 "--no-progress"]) == 0
    return path


def test_a_tiny_benchmark_end_to_end(tiny_table, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "--table", str(tiny_table), "--tiers", "memory,direct,mmap",
                 "--cache-states", "cold,warm,mixed", "--concurrency", "2", "--seconds", "0.4",
                 "--warmup-seconds", "0.3", "--dram-budget", "20%", "--corpus", "stdlib",
                 "--mixed-corpus", "zipf", "--corpus-tokens", "20000", "--hidden", "32", "--layers", "16",
                 "--prompt-tokens", "48", "--answer-tokens", "8", "--tool-tokens", "16", "--turns", "2",
                 "--max-step-tokens", "32", "--repeats", "1", "--out", str(out), "--no-progress",
                 "--min-steps", "1", "--min-users", "1"])  # tiny runs: compare whatever they measured
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    runs = doc["runs"]
    assert {(r["tier"], r["cache_state"]) for r in runs} == {(t, s) for t in ("memory", "direct", "mmap")
                                                              for s in ("cold", "warm", "mixed")}
    for r in runs:
        assert KEYS <= set(r)
        assert r["throughput_tok_s"] > 0 and r["tokens"] > 0 and 0 <= r["stall_fraction"] < 1
    by = {(r["tier"], r["cache_state"]): r for r in runs}
    assert by[("direct", "warm")]["budget_enforced"] is True
    assert by[("memory", "cold")]["budget_enforced"] is False
    assert by[("direct", "warm")]["warmup"]["tokens"] > 0 and by[("memory", "warm")]["warmup"] is None
    assert 0 <= by[("direct", "mixed")]["hit_rate"] <= 1 and by[("mmap", "cold")]["hit_rate"] is None
    assert by[("direct", "cold")]["cold_method"]
    assert doc["table"]["bytes"] > 0 and doc["machine"] and doc["comparisons"]
    assert doc["command"].startswith("engram-offload bench --table")
    png = (out / "frontier.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| tier |" in printed and "throughput ratio" in printed


def test_a_modeled_gpu_benchmark_end_to_end(tiny_table, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "--table", str(tiny_table), "--backbone", "modeled", "--gpu", "b300", "--tp", "2",
                 "--nvme-iops", "50000", "--nvme-latency-us", "70", "--tiers", "memory,direct,mmap", "--cache-states", "cold,warm",
                 "--concurrency", "2,4", "--seconds", "0.4", "--warmup-seconds", "0.3", "--dram-budget", "20%",
                 "--corpus", "stdlib", "--corpus-tokens", "20000", "--prompt-tokens", "48", "--answer-tokens", "8",
                 "--tool-tokens", "16", "--turns", "2", "--max-step-tokens", "32", "--out", str(out),
                 "--no-progress"])
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["settings"]["backbone"] == "modeled" and doc["settings"]["tp"] == 2
    assert doc["settings"]["nvme_latency_us"] == 70.0
    for r in doc["runs"]:
        assert KEYS <= set(r) and r["tokens"] > 0
        assert r["modeled"]["gpu"] == "B300 (HGX)" and r["modeled"]["model"] == "deepseek-v4.1-flash"
        assert r["predicted_stall_us"] >= 0 and r["measured_stall_us"] >= 0 and r["predicted_step_us"] > 0
        assert r["host_us_per_step"] == pytest.approx(r["step_mean_ms"] * 1e3 - r["measured_stall_us"]
                                                      - (r["predicted_step_us"] - r["predicted_stall_us"]))
        assert r["predicted_placement"] == {"memory": "dram", "direct": "nvme", "mmap": "mmap"}[r["tier"]]
        # the steps last at least the roofline: the planner's step time without its stall
        assert r["step_p50_ms"] * 1e3 >= 0.5 * (r["predicted_step_us"] - r["predicted_stall_us"])
    direct = [r for r in doc["runs"] if r["tier"] == "direct"]
    assert all("predicted_stall_us_at_measured_hit" in r for r in direct)
    # a memory map's drive reads are its page faults, its hit rate the page cache's (the
    # pread fallback takes no faults: every row asked is a read, and no hit rate)
    for r in (r for r in doc["runs"] if r["tier"] == "mmap"):
        touched = r["tier_pages_touched"]
        if not guarded_copy_available():
            assert touched == 0 and r["page_cache_hit_rate"] is None
            assert "predicted_stall_us_at_measured_hit" not in r
            continue
        assert 0 < touched and 0 <= r["device_reads"] <= touched
        assert r["page_cache_hit_rate"] == pytest.approx(1 - r["device_reads"] / touched)
        assert "predicted_stall_us_at_measured_hit" in r
    # the mmap tier's page cache holds 4 KiB pages, the direct tier's row cache 264-byte rows
    curve = curve_for(get_model("deepseek-v4.1-flash"))[0]
    for r in doc["runs"]:
        if r["tier"] == "mmap":
            assert r["predicted_hit_rate"] == pytest.approx(curve.hit_ratio(doc["settings"]["dram_budget"] // 4096))
        if r["tier"] == "direct":
            assert r["predicted_hit_rate"] == pytest.approx(curve.hit_ratio(r["cache_bytes"] // 264))
    limits = {(x["tier"], x["cache_state"]): x for x in doc["stall_limits"]}
    assert set(limits) == {(t, s) for t in ("memory", "direct", "mmap") for s in ("cold", "warm")}
    assert all(x["max_concurrency"] in (None, 2, 4) for x in limits.values())
    printed = capsys.readouterr().out
    assert "planner stall" in printed and "largest concurrency, stall < 5%" in printed


@pytest.mark.parametrize("flags,message", [
    (["--backbone", "modeled", "--gpu", "h9000"], "unknown GPU"),
    (["--backbone", "modeled", "--backbone-preset", "gpt-9"], "unknown model"),
    (["--tiers", "memory,tape"], "unknown tape"),
    (["--cache-states", "lukewarm"], "unknown lukewarm"),
    (["--concurrency", "0"], ">= 1"),
    (["--dram-budget", "1M", "--cache-bytes", "2M"], "exceed --dram-budget"),
    (["--dram-budget", "lots"], "not understood"),
])
def test_bad_options_are_explained(tiny_table, tmp_path, capsys, flags, message):
    budget = flags[0] == "--dram-budget" and len(flags) == 4  # caches over the budget: found with the table
    assert main(["bench", "--table", str(tiny_table), "--out", str(tmp_path), "--no-progress", *flags]) == \
        (1 if budget else 2)  # an unknown name or a bad value: a usage error
    assert message in capsys.readouterr().err


def test_a_missing_table_is_explained(tmp_path, capsys):
    assert main(["bench", "--table", str(tmp_path / "none.table"), "--no-progress"]) == 1
    assert "make-table" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--seconds", "nan"], "argument --seconds: 'nan' is not a finite number > 0"),
    (["--seconds", "0"], "argument --seconds: '0' is not a finite number > 0"),
    (["--seconds", "-5"], "argument --seconds: '-5' is not a finite number > 0"),
    (["--seconds", "soon"], "argument --seconds: 'soon' is not a finite number > 0"),
    (["--warmup-seconds", "inf"], "argument --warmup-seconds: 'inf' is not a finite number >= 0"),
    (["--repeats", "0"], "argument --repeats: '0' is not an integer >= 1"),
    (["--lookahead-tokens", "-1"], "argument --lookahead-tokens: '-1' is not an integer >= 0"),
    (["--scale", "2"], "argument --scale: '2' is not a number in (0, 1]"),
    (["--tp", "0"], "argument --tp: '0' is not an integer >= 1"),
    (["--nvme-iops", "0"], "argument --nvme-iops: '0' is not a finite number > 0"),
])
def test_bad_numbers_are_usage_errors(tmp_path, capsys, flags, message):
    assert main(["bench", "--table", str(tmp_path / "t.table"), "--no-progress", *flags]) == 2  # a usage error: exit status 2, no traceback
    err = capsys.readouterr().err
    assert err.splitlines() == [f"engram-offload bench: error: {message} (see engram-offload bench --help)"]


def _remote_bench(table, out, *extra):
    return main(["bench", "--table", str(table), "--tiers", "memory,direct,remote", "--cache-states", "cold,warm",
                 "--concurrency", "2", "--seconds", "0.4", "--warmup-seconds", "0.3", "--dram-budget", "20%",
                 "--corpus", "stdlib", "--corpus-tokens", "20000", "--hidden", "32", "--layers", "16",
                 "--prompt-tokens", "48", "--answer-tokens", "8", "--tool-tokens", "16", "--turns", "2",
                 "--max-step-tokens", "32", "--out", str(out), "--no-progress", "--min-steps", "1", "--min-users", "1", *extra])


def test_the_remote_tier_runs_like_direct_on_a_pool_of_its_own(tiny_table, tmp_path, capsys):
    skip_without_redis()
    out = tmp_path / "out"
    assert _remote_bench(tiny_table, out) == 0
    doc = json.loads((out / "results.json").read_text())
    by = {(r["tier"], r["cache_state"]): r for r in doc["runs"]}
    assert set(by) == {(t, s) for t in ("memory", "direct", "remote") for s in ("cold", "warm")}
    for state in ("cold", "warm"):
        remote = by[("remote", state)]
        assert KEYS <= set(remote) and remote["tokens"] > 0 and remote["throughput_tok_s"] > 0
        assert remote["budget_enforced"] is True and "in the pool" in remote["budget_method"]
        assert remote["cache_bytes"] == by[("direct", state)]["cache_bytes"] > 0
        assert 0 <= remote["hit_rate"] <= 1 and remote["tier_rows_per_token"] > 0
    assert by[("remote", "cold")]["cold_method"].startswith("pool table dropped and published again")
    assert by[("remote", "warm")]["warmup"]["tokens"] > 0
    assert by[("remote", "warm")]["hit_rate"] > by[("remote", "cold")]["hit_rate"]
    assert any(c["tier"] == "remote" and c["vs"] == "memory" for c in doc["comparisons"])
    # the loopback pool the benchmark started is gone
    port = int(doc["settings"]["pool"].rsplit(":", 1)[1])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    err = capsys.readouterr().err
    assert "publishing the table to a loopback pool of 1 server(s)" in err


def test_the_remote_tier_reads_a_given_pool_and_leaves_the_table_there(tiny_table, tmp_path, redis_single):
    out = tmp_path / "out"
    assert _remote_bench(tiny_table, out, "--pool", redis_single.url, "--tiers", "remote") == 0
    doc = json.loads((out / "results.json").read_text())
    assert {r["tier"] for r in doc["runs"]} == {"remote"} and doc["settings"]["pool"] == redis_single.url
    [table] = pool_status(redis_single.url)["tables"]
    assert table["complete"] and table["fingerprint"] == fingerprint(read_header(tiny_table))


def test_a_per_layer_placement_runs_like_a_tier_and_every_run_says_its_dram(tiny_table, tmp_path):
    out = tmp_path / "out"
    layered = "1=memory/14=direct"
    code = main(["bench", "--table", str(tiny_table), "--backbone", "modeled", "--gpu", "b300", "--tp", "2",
                 "--tiers", f"memory,direct,{layered}", "--cache-states", "cold,warm", "--concurrency", "2",
                 "--seconds", "0.3", "--warmup-seconds", "0.2", "--dram-budget", "20%", "--corpus", "stdlib",
                 "--corpus-tokens", "20000", "--prompt-tokens", "48", "--answer-tokens", "8", "--tool-tokens", "16",
                 "--turns", "2", "--max-step-tokens", "32", "--out", str(out), "--no-progress"])
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    by = {(r["tier"], r["cache_state"]): r for r in doc["runs"]}
    memory, direct, mixed = by[("memory", "warm")], by[("direct", "warm")], by[(layered, "warm")]
    assert memory["dram_bytes"] == doc["table"]["bytes"]
    assert direct["dram_bytes"] <= doc["settings"]["cache_bytes"]
    # the memory layer's slice (about half the table) and the direct layer's cache: less than memory's
    assert direct["dram_bytes"] < mixed["dram_bytes"] < memory["dram_bytes"]
    assert mixed["warmup"]["tokens"] > 0 and 0 <= mixed["hit_rate"] <= 1
    assert mixed["predicted_placement"] == "dram/nvme" and mixed["predicted_stall_us"] >= 0
    assert "predicted_stall_us_at_measured_hit" in mixed


def test_drafts_are_counted_per_run_and_each_layers_stall_is_reported(tiny_table, tmp_path):
    out = tmp_path / "out"
    code = main(["bench", "--table", str(tiny_table), "--backbone", "modeled", "--gpu", "b300", "--tp", "2",
                 "--tiers", "direct", "--cache-states", "warm", "--concurrency", "4", "--drafts", "ngram:2",
                 "--seconds", "0.4", "--warmup-seconds", "0.2", "--dram-budget", "20%", "--corpus", "stdlib",
                 "--corpus-tokens", "20000", "--prompt-tokens", "48", "--answer-tokens", "16", "--tool-tokens", "16",
                 "--turns", "2", "--max-step-tokens", "32", "--out", str(out), "--no-progress"])
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    (run,) = doc["runs"]
    assert doc["settings"]["drafts"] == "ngram:2"
    assert set(run["layer_stall_us"]) == {"1", "14"} and 0 <= run["first_layer_stall_fraction"] <= 1
    counts = run["draft_counts"]
    assert counts["draft_steps"] > 0 and counts["next_rows"] > 0
    assert run["draft_share_fetched"] == pytest.approx(counts["next_rows_fetched"] / counts["next_rows"])
    assert main(["bench", "--table", str(tiny_table), "--drafts", "mtp", "--out", str(tmp_path), "--no-progress"]) == 1


def test_model_drafts_come_from_the_trained_model(tiny_table, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "--table", str(tiny_table), "--backbone", "modeled", "--gpu", "b300", "--tp", "2",
                 "--tiers", "direct", "--cache-states", "cold", "--concurrency", "4", "--drafts", "model:2",
                 "--seconds", "0.4", "--dram-budget", "20%", "--corpus", "stdlib",
                 "--corpus-tokens", "20000", "--prompt-tokens", "48", "--answer-tokens", "16", "--tool-tokens", "16",
                 "--turns", "2", "--max-step-tokens", "32", "--out", str(out), "--no-progress"])
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    (run,) = doc["runs"]
    assert doc["settings"]["drafts"] == "model:2" and "draft_predictor" not in doc["settings"]
    counts = run["draft_counts"]
    assert counts["draft_steps"] > 0 and counts["next_rows_fetched"] > 0  # some drafts were right
    capsys.readouterr()
    assert main(["bench", "--table", str(tiny_table), "--drafts", "model", "--draft-model", str(tmp_path / "none"),
                 "--out", str(tmp_path), "--no-progress"]) == 2
    assert "--draft-model" in capsys.readouterr().err
    assert main(["bench", "--table", str(tiny_table), "--drafts", "ngram", "--draft-model", str(tmp_path),
                 "--out", str(tmp_path), "--no-progress"]) == 2
    assert "is for --drafts model" in capsys.readouterr().err


def test_a_cached_benchmark_table_this_version_cannot_read_is_made_again(tmp_path, monkeypatch, capsys):
    """The default table is a derived file: one of an older format (or damaged) is remade, not an error."""
    from engram_offload.commands.bench import default_table
    from engram_offload.table import read_header

    monkeypatch.setenv("ENGRAM_OFFLOAD_CACHE", str(tmp_path))
    path = default_table("deepseek-demo", 1e-3, 7, progress=False)
    fingerprint = read_header(path).fingerprint()
    with open(path, "r+b") as f:
        f.seek(8)
        f.write((2).to_bytes(4, "little"))  # an older format version
    assert default_table("deepseek-demo", 1e-3, 7, progress=False) == path
    assert read_header(path).fingerprint() == fingerprint  # the same seed: the same table
    assert "making the benchmark table" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--schedule", "in-graph"], "needs --backbone modeled"),
    (["--backbone", "modeled", "--schedule", "in-graph", "--drafts", "ngram"], "drop --drafts"),
    (["--backbone", "modeled", "--schedule", "cpu-wait", "--lookahead-tokens", "64"], "nothing is fetched ahead"),
    (["--backbone", "modeled", "--eager-us", "100"], "--schedule cpu-wait only"),
])
def test_the_plugins_schedules_refuse_what_they_cannot_run(tiny_table, tmp_path, capsys, flags, message):
    assert main(["bench", "--table", str(tiny_table), "--out", str(tmp_path), "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err
