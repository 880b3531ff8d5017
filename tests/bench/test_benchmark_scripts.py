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
