"""The shared tier: one copy per machine, attach checks, crashed loaders, summed PSS."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_offload.config import EngramConfig
from engram_offload.errors import TierError
from engram_offload.table import make_random_table, random_rows, read_header
from engram_offload.tiers.memory import MemoryTier
from engram_offload.tiers.shared import READY, SharedTier, _read_head, process_pss, remove_segment, segment_name
from tiny_tables import tiny_config

SHM = Path("/dev/shm")


@pytest.fixture
def shm_dir():
    """A private folder on the machine's tmpfs (removed afterwards)."""
    directory = Path(tempfile.mkdtemp(prefix="engram-test-", dir=SHM if SHM.is_dir() else None))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    config = tiny_config("bf16", 80)
    path = make_random_table(tmp_path_factory.mktemp("shared") / "t.table", config, seed=4, block_size=16384)
    return path, np.concatenate(list(random_rows(config, 4)))


def test_rows_equal_the_memory_tiers_and_the_second_open_attaches(table, shm_dir):
    from engram_offload.store import open_table

    path, expected = table
    header = read_header(path)
    ids = np.random.default_rng(0).integers(0, header.layout.num_rows, 500)
    with SharedTier(header, shm_dir=shm_dir) as first, SharedTier(header, shm_dir=shm_dir) as second, \
            MemoryTier(header) as memory:
        assert first.loaded and not second.loaded
        want = memory.read_rows(ids, torch.empty((ids.size, header.layout.row_bytes), dtype=torch.uint8))
        for tier in (first, second):
            got = tier.read_rows(ids, torch.empty_like(want))
            assert torch.equal(got, want)
        assert np.array_equal(second.rows.numpy(), expected)
        assert second.stats()["segment"] == str(shm_dir / segment_name(header))
    with open_table(path, "shared", shm_dir=shm_dir, verify_reads=True) as store:
        assert torch.equal(store.read_raw(ids), want)
        assert store.tier.stats()["loaded_here"] is False  # the segment outlived its users
    assert remove_segment(header, shm_dir=shm_dir)
    assert not remove_segment(header, shm_dir=shm_dir)


def test_a_ready_segment_of_another_table_is_refused(table, tmp_path, shm_dir):
    path, _ = table
    other = make_random_table(tmp_path / "other.table", tiny_config("bf16", 80), seed=99, block_size=16384)
    with SharedTier(read_header(other), segment="engram-model", shm_dir=shm_dir):
        pass
    with pytest.raises(TierError, match=r"holds another table \(.*other.table.*remove the stale one"):
        SharedTier(read_header(path), segment="engram-model", shm_dir=shm_dir)
    assert _read_head(shm_dir / "engram-model")[0] == READY  # refused, not touched


def test_a_segment_left_half_written_without_its_head_is_cleaned(table, shm_dir):
    path, expected = table
    header = read_header(path)
    (shm_dir / segment_name(header)).write_bytes(b"ENGR")  # a loader died before its head
    with SharedTier(header, shm_dir=shm_dir) as tier:
        assert tier.loaded and np.array_equal(tier.rows.numpy(), expected)


STUCK_LOADER = textwrap.dedent("""
    import sys, time
    from engram_offload.table import read_header
    from engram_offload.tiers import shared

    def stuck(header, dense, verify=None, progress=None, what=""):
        dense[: len(dense) // 2] = 7  # half the rows, then the process is killed
        print("loading", flush=True)
        time.sleep(120)

    shared.load_rows_into = stuck
    shared.SharedTier(read_header(sys.argv[1]), shm_dir=sys.argv[2])
""")


def test_a_loader_killed_mid_load_leaves_a_segment_the_next_process_reloads(table, shm_dir):
    path, expected = table
    header = read_header(path)
    loader = subprocess.Popen([sys.executable, "-c", STUCK_LOADER, str(path), str(shm_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert loader.stdout.readline().strip() == "loading"
        state = _read_head(shm_dir / segment_name(header))
        assert state is not None and state[0] != READY
    finally:
        loader.send_signal(signal.SIGKILL)
        loader.wait()
    with SharedTier(header, shm_dir=shm_dir) as tier:  # the lock died with the loader
        assert tier.loaded
        assert np.array_equal(tier.rows.numpy(), expected)
    assert _read_head(shm_dir / segment_name(header))[0] == READY


# ---------------------------------------------------------------------- one copy: summed PSS
def _attacher(conn, table: str, shm_dir: str) -> None:
    """Waits for "attach", opens the shared tier and touches every row; answers PSS queries."""
    header = read_header(table)
    tier = None
    int(torch.ones(1 << 20, dtype=torch.uint8).sum())  # torch's reduction threads and kernels, before the baseline
    conn.send(process_pss())  # the baseline, before the segment
    for command in iter(conn.recv, "exit"):
        if command == "attach":
            tier = SharedTier(header, shm_dir=shm_dir)
            int(tier.rows.sum())  # fault in every page
        segment = str(tier.segment) if tier is not None else None
        conn.send((process_pss(), process_pss(mapping=segment) if segment else 0))
    if tier is not None:
        tier.close()


@pytest.mark.slow
def test_summed_pss_of_1_2_and_4_attached_processes_is_about_one_copy(tmp_path, shm_dir):
    # 8 heads x ~8k rows x 1 KiB: a 64 MiB table, large beside any per-process noise
    config = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=256, prime_starts=(8192, 8192))
    path = make_random_table(tmp_path / "big.table", config, seed=1)
    one_copy = config.num_rows * config.row_bytes
    ctx = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    for _ in range(4):
        parent, child = ctx.Pipe()
        worker = ctx.Process(target=_attacher, args=(child, str(path), str(shm_dir)), daemon=True)
        worker.start()
        pipes.append(parent)
        workers.append(worker)
    try:
        baselines = [p.recv() for p in pipes]
        attached = 0
        for n in (1, 2, 4):
            for p in pipes[attached:n]:
                p.send("attach")
                p.recv()
            attached = n
            for p in pipes[:n]:
                p.send("pss")
            answers = [p.recv() for p in pipes[:n]]
            rollup = sum(total - base for (total, _), base in zip(answers, baselines))
            segment = sum(seg for _, seg in answers)
            assert one_copy * 0.9 < segment < 1.2 * one_copy, (n, segment, one_copy)
            assert rollup < 1.2 * one_copy, (n, rollup, one_copy)
    finally:
        for p in pipes:
            p.send("exit")
        for w in workers:
            w.join(timeout=30)


def test_a_damaged_table_is_refused_while_loading_and_leaves_no_segment(table, tmp_path, shm_dir):
    from engram_offload.errors import ChecksumError

    path, _ = table
    damaged = tmp_path / "damaged.table"
    shutil.copy(path, damaged)
    header = read_header(damaged)
    with open(damaged, "r+b") as f:  # flip a byte of the second block's data
        f.seek(header.layout.block_range(1)[0] + 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError):
        SharedTier(header, shm_dir=shm_dir, verify_reads=True)
    assert _read_head(shm_dir / segment_name(header)) is None


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".hidden"])
def test_a_segment_name_must_be_a_plain_file_name(table, shm_dir, name):
    with pytest.raises(ValueError, match="plain file name"):
        SharedTier(read_header(table[0]), segment=name, shm_dir=shm_dir)
