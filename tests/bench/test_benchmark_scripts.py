"""The scripts in benchmarks/ write their results outside the committed benchmarks/results/
unless told to with --out, and say where in their help."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("bench_*.py"))


def out_default(script: Path) -> object:
    """The ``default=`` of the script's ``--out`` option (None when it has none)."""
    for node in ast.walk(ast.parse(script.read_text())):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--out"):
            for kw in node.keywords:
                if kw.arg == "default":
                    return ast.unparse(kw.value)
            return None
    raise AssertionError(f"{script.name} has no --out option")


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_no_script_overwrites_the_committed_results_by_default(script):
    default = out_default(script)
    assert default is None or ("results" not in default and "engram-bench/" in default), (script.name, default)


def test_the_help_says_where_the_results_go():
    script = BENCHMARKS / "bench_hashing.py"
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "default engram-bench/hashing.json" in " ".join(run.stdout.split())


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_script", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))  # bench_fetch imports bench_tier beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_one_caller_runs_are_compared_with_the_fio_runs_on_either_side():
    module = _script("bench_tier")
    fio = [{"iops": 100.0, "cpu_us_per_read": 2.0}, {"iops": 140.0, "cpu_us_per_read": 1.0},
           {"iops": 60.0, "cpu_us_per_read": 3.0}]
    ours = [{"reads_per_s": 108.0, "cpu_us_per_read": 1.8}, {"reads_per_s": 90.0, "cpu_us_per_read": 2.4}]
    ratios = module.bracketed_ratios(ours, fio)
    assert [round(r["reads"], 6) for r in ratios] == [0.9, 0.9]  # 108 / mean(100, 140), 90 / mean(140, 60)
    assert [round(r["cpu"], 6) for r in ratios] == [1.2, 1.2]  # 1.8 / mean(2, 1), 2.4 / mean(1, 3)


def test_the_fetch_benchmark_runs_the_fetch_loop_between_fio_runs(tmp_path):
    """bench_fetch.py: the fetch loop in every repeat between fio runs, summed up against them,
    with the decode it took and its CPU split run by run."""
    import json
    import shutil

    from engram_offload import cli
    from engram_offload.engram.rows import fp8_decode_path

    if not shutil.which("fio"):
        pytest.skip("fio is not installed (apt-get install fio)")
    table = tmp_path / "t.tbl"
    assert cli.main(["make-table", "--scale", "2e-5", "--out", str(table), "--no-progress"]) == 0
    out = tmp_path / "fetch.json"
    module = _script("bench_fetch")
    assert module.main(["--table", str(table), "--seconds", "0.3", "--repeats", "2", "--sequences", "4",
                        "--corpus-tokens", "20000", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["runs"]["fio"]) == 3 and len(result["runs"]["prefetcher"]) == 2
    assert result["machine"]["fp8_decode"] == fp8_decode_path()
    for run in result["runs"]["prefetcher"]:  # a CPU split, run by run
        assert run["kernel_cpu_us_per_miss"] + run["user_cpu_us_per_miss"] == pytest.approx(run["cpu_us_per_miss"])
    for run in result["runs"]["fio"]:
        assert run["kernel_cpu_us_per_read"] + run["user_cpu_us_per_read"] == pytest.approx(run["cpu_us_per_read"])
    med, runs = result["median"], result["runs"]["prefetcher"]
    assert min(r["cpu_us_per_hit"] for r in runs) <= med["cpu_us_per_hit"] <= max(r["cpu_us_per_hit"] for r in runs)


def test_the_hashing_benchmark_times_both_dedups_on_the_same_step_ids(monkeypatch):
    """bench_hashing.py's dedup figure: each decode step's flat ids through the native kernel
    and the NumPy path in turns, their results compared; the switch is left as it was."""
    import os

    import numpy as np

    from engram_offload._native import NO_NATIVE_ENV
    from engram_offload.engram.hashing import NgramHasher
    from engram_offload.engram.tokenizer import cached_token_map

    from tiny_tables import tiny_config

    monkeypatch.delenv(NO_NATIVE_ENV, raising=False)
    module = _script("bench_hashing")
    hasher = NgramHasher(tiny_config(), cached_token_map())
    steps = np.random.default_rng(0).integers(0, 1000, (3, 5))
    times = module.dedup_native_vs_numpy(hasher, list(range(5)), steps)
    config = hasher.config
    assert times["ids"] == 5 * len(config.layer_ids) * config.cols_per_layer
    assert len(times["native"]) == len(times["numpy"]) == 3 and min(times["native"] + times["numpy"]) > 0
    assert NO_NATIVE_ENV not in os.environ


def test_the_eviction_benchmark_compares_both_ways_at_every_eviction(tmp_path):
    """bench_evict.py: at each eviction of a real-text trace the C helper's victims and NumPy's,
    on the same state (a cache large enough for the C helper's one-pass choice), must be the
    same slots in the same order, and both are timed."""
    import json

    from engram_offload import cli

    table = tmp_path / "t.tbl"
    assert cli.main(["make-table", "--scale", "2e-4", "--out", str(table), "--no-progress"]) == 0
    out = tmp_path / "evict.json"
    assert _script("bench_evict").main(["--table", str(table), "--tokens", "30000", "--sequences", "16",
                                        "--cache-fraction", "0.2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [p["policy"] for p in result["policies"]] == ["lru", "lfu"]
    for p in result["policies"]:
        assert p["capacity_rows"] >= 4 * 4096 and p["evictions"] > 0
        assert p["native_ms_median"] > 0 and p["numpy_ms_median"] > 0 and 0 < p["hit_rate"] < 1
