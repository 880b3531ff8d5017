"""benchmarks/pss.py summed_pss: copies of a table held by several processes, every wait bounded."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # spawned workers import pss too
from engram_offload.engram.config import EngramConfig
from engram_offload.table import make_random_table

import pss  # noqa: E402
from pss import summed_pss  # noqa: E402


@pytest.fixture(scope="module")
def big_table(tmp_path_factory):
    # 4 heads x ~4k rows x 1 KiB: a 16 MiB table, large beside a process's own PSS noise
    config = EngramConfig(layer_ids=(1,), max_ngram_size=3, n_heads=2, head_dim=256, prime_starts=(4096, 4096))
    path = make_random_table(tmp_path_factory.mktemp("pss") / "t.table", config, seed=3)
    return path, config.num_rows * config.row_bytes


def test_private_copies_sum_to_one_table_a_process(big_table, tmp_path):
    path, one_copy = big_table
    rows = summed_pss(path, "memory", tmp_path, counts=(1, 2))
    assert [r["processes"] for r in rows] == [1, 2]
    for row in rows:
        copies = row["summed_pss_growth_bytes"] / one_copy
        assert row["processes"] - 0.2 < copies < row["processes"] + 0.5, row
        assert row["summed_segment_pss_bytes"] == 0  # no segment: nothing shared


@pytest.mark.parametrize("tier, counts, message", [
    ("direct", (1,), "opens the tiers shared, memory"),
    ("memory", (2, 1), "increasing"),
    ("memory", (0, 1), ">= 1"),
    ("memory", (), "increasing"),
])
def test_bad_arguments_are_refused_before_any_process_starts(tmp_path, tier, counts, message):
    with pytest.raises(ValueError, match=message):
        summed_pss(tmp_path / "none.table", tier, tmp_path, counts=counts)


def test_a_process_that_dies_is_an_error_not_a_hang(tmp_path):
    missing = tmp_path / "missing.table"  # every process fails to read the header and exits
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 1"):
        summed_pss(missing, "memory", tmp_path, counts=(1,), timeout=600)
    assert time.monotonic() - started < 300  # seen as soon as it died, not at the timeout


def test_an_answer_is_awaited_within_the_timeout_only():
    import multiprocessing

    parent, _child = multiprocessing.Pipe()

    class Alive:
        exitcode = None

        def is_alive(self):
            return True

    with pytest.raises(TimeoutError, match="still running"):
        pss._answer(parent, Alive(), 0.05)


@pytest.mark.slow
def test_summed_pss_of_1_2_and_4_attached_processes_is_about_one_copy(tmp_path, shm_dir):
    # 8 heads x ~8k rows x 1 KiB: a 64 MiB table, large beside any per-process noise
    config = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=256, prime_starts=(8192, 8192))
    path = make_random_table(tmp_path / "big.table", config, seed=1)
    one_copy = config.num_rows * config.row_bytes
    for row in summed_pss(path, "shared", shm_dir):
        n, segment, rollup = row["processes"], row["summed_segment_pss_bytes"], row["summed_pss_growth_bytes"]
        assert one_copy * 0.9 < segment < 1.2 * one_copy, (n, segment, one_copy)
        assert rollup < 1.2 * one_copy, (n, rollup, one_copy)
