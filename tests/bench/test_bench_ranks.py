"""``bench --ranks``: rank processes over one shared table or one row server, and tensor
parallel ranks whose Engram layers get the rows of their tokens, all-gathered."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from engram_offload import open_table
from engram_offload.bench import sweep
from engram_offload.bench.ranks import RankRequests, RankRole
from engram_offload.bench.workload import RequestStream, WorkloadShape
from engram_offload.cli import main
from engram_offload.engram.hashing import NgramHasher
from engram_offload.serving.prefetch import Prefetcher
from engram_offload.serving.sharding import shard_columns
from engram_offload.table.format import read_header

from test_engine import VOCAB, RecordingEngine, RowsModel, corpus, expected_rows, table  # noqa: F401 (fixture)

RANKS_TIMEOUT_S = 120.0  # a test's ranks that have not reported by then fail the test


@pytest.fixture(scope="module")
def tiny_table(tmp_path_factory):
    path = tmp_path_factory.mktemp("ranks") / "tiny.table"
    assert main(["make-table", "--preset", "deepseek-v4.1-flash", "--scale", "0.0001", "--out", str(path),
                 "--no-progress"]) == 0
    return path


def bench_args(path, out, *extra):
    return ["bench", "--table", str(path), "--cache-states", "cold", "--concurrency", "2", "--seconds", "0.4",
            "--dram-budget", "20%", "--corpus", "stdlib", "--mixed-corpus", "zipf", "--corpus-tokens", "20000",
            "--hidden", "32", "--layers", "16", "--prompt-tokens", "48", "--answer-tokens", "8", "--tool-tokens",
            "16", "--turns", "2", "--max-step-tokens", "32", "--threads", "1", "--out", str(out), "--no-progress",
            *extra]


def test_two_ranks_serve_from_one_shared_table_and_one_row_server(tiny_table, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweep, "RANKS_TIMEOUT_S", RANKS_TIMEOUT_S)
    out = tmp_path / "out"
    assert main(bench_args(tiny_table, out, "--tiers", "memory,direct", "--ranks", "2")) == 0
    doc = json.loads((out / "results.json").read_text())
    by = {r["tier"]: r for r in doc["runs"]}
    for tier in ("memory", "direct"):
        run = by[tier]
        assert run["ranks"] == 2 and [r["rank"] for r in run["per_rank"]] == [0, 1]
        for r in run["per_rank"]:
            assert r["throughput_tok_s"] > 0 and r["rows_per_s"] > 0 and 0 <= r["stall_fraction"] < 1
            assert r["pss_bytes"] > 0
        assert run["throughput_tok_s"] == pytest.approx(sum(r["throughput_tok_s"] for r in run["per_rank"]))
        assert run["ranks_pss_bytes"] == sum(r["pss_bytes"] for r in run["per_rank"])
        assert run["dram_used_bytes"] == run["ranks_pss_bytes"] + run["server_pss_bytes"]
    assert by["memory"]["server_pss_bytes"] == 0  # no server: one shared copy in /dev/shm
    assert by["direct"]["server_pss_bytes"] > 0
    assert all(0 <= r["hit_rate"] <= 1 for r in by["direct"]["per_rank"])  # the server's one cache
    printed = capsys.readouterr().out
    assert "| rank |" in printed and "all 2" in printed and "budget" in printed


def test_ranks_refuse_tiers_they_cannot_share_and_uneven_groups(tiny_table, tmp_path, capsys):
    assert main(bench_args(tiny_table, tmp_path, "--tiers", "mmap", "--ranks", "2")) == 2
    assert "choose from memory, pinned, shared, direct" in capsys.readouterr().err
    assert main(bench_args(tiny_table, tmp_path, "--tiers", "memory", "--ranks", "3", "--tp", "2")) == 2
    assert "--ranks (3) must be a multiple of --tp (2)" in capsys.readouterr().err


def test_a_rank_serves_every_worlds_request_from_its_index():
    shape = WorkloadShape("chat", prompt=10, answer=2)
    whole = RequestStream(corpus(), shape, seed=3)
    every = [whole.next().tokens for _ in range(9)]
    for index in range(3):
        mine = RankRequests(RequestStream(corpus(), shape, seed=3), index, 3)
        got = [mine.next().tokens for _ in range(3)]
        assert all(np.array_equal(a, b) for a, b in zip(got, every[index::3]))


# ---------------------------------------------------------------------- gloo, two processes
def _tp_rank_main(rank: int, world: int, init_file: str, path: str) -> None:
    """One of two TP ranks: each step's Engram layers get the assembled rows of its tokens,
    and a rank that would stop earlier keeps stepping with the other."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        config = read_header(path).config
        hasher = NgramHasher(config, np.arange(VOCAB, dtype=np.int64) % 400)  # test_engine's
        role = RankRole(rank, world, world, path, config, group=dist.new_group([0, 1]))
        assert role.columns == shard_columns(config, rank, world)
        shape = WorkloadShape("agent", prompt=40, answer=6, turns=2, tool=20)
        with open_table(path, "mmap") as plain, open_table(path, "memory", columns=role.columns) as store, \
                Prefetcher(store, hasher) as pf:
            model = RowsModel(config.layer_ids)
            engine = RecordingEngine(role.exchange(model), pf, concurrency=3, max_step_tokens=16,
                                     lookahead_tokens=0)
            run = engine.run(role.requests(RequestStream(corpus(), shape, seed=2)), seconds=60,
                             max_steps=30 + 10 * rank, agree=role.agree)
            assert run.steps == 30  # rank 1 would go on; it stops with rank 0
            for entry, seen in zip(engine.log, model.seen):
                for li, layer in enumerate(config.layer_ids):
                    want = expected_rows(plain, hasher, entry, li)  # [T, C, d], every column
                    assert torch.equal(seen[layer].reshape(want.shape), want), (rank, layer)
    finally:
        dist.destroy_process_group()


def spawn_bounded(fn, args, nprocs: int, seconds: float) -> None:
    """``mp.spawn``, killed and failed after ``seconds``."""
    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + seconds
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {seconds:.0f} s")


def test_tp_ranks_engram_layers_get_their_tokens_rows_all_gathered(table, tmp_path):  # noqa: F811 (fixture)
    path, config, _ = table
    assert config.cols_per_layer == 4  # 2 columns a rank
    spawn_bounded(_tp_rank_main, (2, str(tmp_path / "rendezvous"), str(path)), 2, RANKS_TIMEOUT_S)


def test_two_tp_ranks_end_to_end(tiny_table, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "RANKS_TIMEOUT_S", RANKS_TIMEOUT_S)
    out = tmp_path / "out"
    assert main(bench_args(tiny_table, out, "--tiers", "direct", "--ranks", "2", "--tp", "2")) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["ranks"] == 2 and run["tp_columns"] == 2 and len(run["per_rank"]) == 2
    # one data-parallel replica: its two ranks computed the same steps' tokens, counted once
    assert run["per_rank"][0]["tokens"] == run["per_rank"][1]["tokens"] == run["tokens"] > 0
