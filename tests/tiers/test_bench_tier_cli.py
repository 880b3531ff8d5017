"""``bench-tier``: a row cache in front of the tier with its stats table, cold starts, bad numbers."""

from __future__ import annotations

import json
import os
import re

import pytest

from engram_offload import cli
from engram_offload.bench import cold
from engram_offload.bench.tier_bench import run_tier_bench

SCALE = "2e-5"  # deepseek-v4.1-flash at 2e-5: about 17 k rows of 264 bytes


def test_bench_tier_with_a_cache(tmp_path, capsys):
    path = str(tmp_path / "t.tbl")
    assert cli.main(["make-table", "--scale", SCALE, "--out", path, "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["bench-tier", "--table", path, "--tier", "mmap", "--seconds", "0.2", "--batch", "256",
                     "--queue-depth", "1", "--cache-bytes", "1M", "--policy", "lfu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cache_bytes"] == 1 << 20 and result["policy"] == "lfu"
    dram = result["cache"]["levels"][0]
    assert dram["policy"] == "lfu" and dram["capacity_bytes"] <= 1 << 20 and dram["requests"] > 0
    assert result["rows"] >= result["tier_rows"] > 0
    # a read's CPU, split into the kernel's part (system time) and the process's
    assert result["kernel_cpu_us_per_read"] >= 0 and result["user_cpu_us_per_read"] > 0
    assert result["kernel_cpu_us_per_read"] + result["user_cpu_us_per_read"] == pytest.approx(
        result["cpu_us_per_read"])
    # a percentage of the table, and the stats table in the plain output
    assert cli.main(["bench-tier", "--table", path, "--tier", "memory", "--seconds", "0.1", "--batch", "64",
                     "--cache-bytes", "50%"]) == 0
    out = capsys.readouterr().out
    assert "rows/s" in out and "hit rate" in out and "dram" in out and "lfu cache" in out  # lfu: the default
    assert re.search(r"us CPU per read \(kernel \d+\.\d\d, process \d+\.\d\d\)", out)


def test_bench_tier_refuses_a_bad_size_or_policy(tmp_path, capsys):
    path = str(tmp_path / "t.tbl")
    assert cli.main(["make-table", "--scale", SCALE, "--out", path, "--no-progress"]) == 0
    assert cli.main(["bench-tier", "--table", path, "--tier", "mmap", "--seconds", "0.1",
                     "--cache-bytes", "lots"]) != 0
    assert "not understood" in capsys.readouterr().err
    assert cli.main(["bench-tier", "--table", path, "--tier", "mmap", "--seconds", "0.1",
                     "--cache-bytes", "1M", "--policy", "random"]) != 0
    assert "invalid choice: 'random'" in capsys.readouterr().err


def bench_tier(argv: list[str]) -> int:
    """``engram-offload bench-tier ARGV`` through the command line's ``main``."""
    return cli.main(["bench-tier", *argv])


def test_a_cold_run_evicts_the_table_only_unless_asked(tmp_path, capsys, monkeypatch):
    drop = tmp_path / "drop_caches"
    monkeypatch.setattr(cold, "DROP_CACHES", str(drop))  # leave the host's caches alone
    path = str(tmp_path / "t.tbl")
    assert cli.main(["make-table", "--scale", SCALE, "--out", path, "--no-progress"]) == 0
    for tier in ("memory", "mmap", "direct"):
        capsys.readouterr()
        assert bench_tier(["--table", path, "--tier", tier, "--seconds", "0.1", "--batch", "256",
                           "--queue-depth", "4", "--cold", "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["tier"] == tier and result["rows"] > 0 and result["rows_per_s"] > 0
        assert result["cold_method"] == ["posix_fadvise(DONTNEED)"]
        assert not drop.exists()  # the machine's page cache is left alone
        table_bytes = result["table_bytes"]
        if tier == "memory":  # the load at open, measured by the tier
            assert 0 < result["load_bytes_per_s"] and table_bytes <= os.path.getsize(path)
        else:
            assert result["load_bytes_per_s"] is None
    assert bench_tier(["--table", path, "--tier", "memory", "--seconds", "0.1", "--cold", "--drop-all-caches",
                       "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cold_method"] == ["posix_fadvise(DONTNEED)", f"{drop}=1"] and drop.read_text() == "1\n"


@pytest.mark.parametrize("flags,message", [
    (["--seconds", "0"], "argument --seconds: '0' is not a finite number > 0"),
    (["--seconds", "-5"], "argument --seconds: '-5' is not a finite number > 0"),
    (["--seconds", "nan"], "argument --seconds: 'nan' is not a finite number > 0"),
    (["--callers", "0"], "argument --callers: '0' is not an integer >= 1"),
    (["--batch", "0"], "argument --batch: '0' is not an integer >= 1"),
    (["--queue-depth", "x"], "argument --queue-depth: 'x' is not an integer >= 1"),
])
def test_bad_numbers_are_usage_errors(tmp_path, capsys, flags, message):
    assert bench_tier(["--table", str(tmp_path / "t.tbl"), "--tier", "mmap", *flags]) == 2  # a usage error: exit status 2, no traceback
    err = capsys.readouterr().err
    assert err.splitlines() == [f"engram-offload bench-tier: error: {message} (see engram-offload bench-tier --help)"]


def test_the_benchmark_refuses_bad_numbers_too(tmp_path):
    for kwargs, message in (({"seconds": float("nan")}, "seconds"), ({"seconds": 0.0}, "seconds"),
                            ({"callers": 0}, "callers")):
        with pytest.raises(ValueError, match=message):
            run_tier_bench(tmp_path / "t.tbl", "mmap", **kwargs)


def test_bench_tier_reads_a_placement_and_refuses_a_pool_or_unknown_tier_in_it(tmp_path, capsys):
    path = str(tmp_path / "t.tbl")
    assert cli.main(["make-table", "--scale", SCALE, "--out", path, "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["bench-tier", "--table", path, "--tier", "1=memory/14=direct", "--seconds", "0.1",
                     "--batch", "64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tier"] == "1=memory/14=direct" and result["rows"] > 0
    for tier, message in [("1=memory/14=remote", "the remote tier reads a Redis pool, not the table file"),
                          ("1=memory/14=nvme", "placement '1=memory/14=nvme': unknown tier 'nvme' for layer 14"),
                          ("nvme", "unknown tier 'nvme'; choose one of: memory, pinned, mmap, direct, shared, or a "
                                   "placement such as 1=memory/14=direct"),
                          ("1=memory", "misses layer(s) 14")]:
        code = cli.main(["bench-tier", "--table", path, "--tier", tier, "--seconds", "0.1"])
        err = capsys.readouterr().err
        assert code in (1, 2) and message in err and err.count("\n") == 1, err
