"""``bench-tier --cache-bytes --policy``: a row cache in front of the tier, with its stats table."""

from __future__ import annotations

import json

from engram_offload import cli

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
    # a percentage of the table, and the stats table in the plain output
    assert cli.main(["bench-tier", "--table", path, "--tier", "memory", "--seconds", "0.1", "--batch", "64",
                     "--cache-bytes", "50%"]) == 0
    out = capsys.readouterr().out
    assert "rows/s" in out and "hit rate" in out and "dram" in out and "lru cache" in out


def test_bench_tier_refuses_a_bad_size_or_policy(tmp_path, capsys):
    path = str(tmp_path / "t.tbl")
    assert cli.main(["make-table", "--scale", SCALE, "--out", path, "--no-progress"]) == 0
    assert cli.main(["bench-tier", "--table", path, "--tier", "mmap", "--seconds", "0.1",
                     "--cache-bytes", "lots"]) != 0
    assert "not understood" in capsys.readouterr().err
    assert cli.main(["bench-tier", "--table", path, "--tier", "mmap", "--seconds", "0.1",
                     "--cache-bytes", "1M", "--policy", "random"]) != 0
    assert "unknown cache policy" in capsys.readouterr().err
