"""The shared tier: one copy per machine, attach checks, crashed loaders, summed PSS."""

from __future__ import annotations

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

from engram_offload.bench.pss import summed_pss
from engram_offload.engram.config import EngramConfig
from engram_offload.errors import TierError
from engram_offload.table import make_random_table, random_rows, read_header
from engram_offload.tiers.memory import MemoryTier
from engram_offload.tiers.segments import READY, read_head, uid_folder
from engram_offload.tiers.shared import SharedTier, remove_segment, segment_name

from tiny_tables import tiny_config

SHM = Path("/dev/shm")


@pytest.fixture
def shm_dir():
    """A private folder on the machine's tmpfs (removed afterwards)."""
    directory = Path(tempfile.mkdtemp(prefix="engram-test-", dir=SHM if SHM.is_dir() else None))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def head(shm_dir, name):
    """The head of segment ``name`` in this uid's folder of ``shm_dir``, None when absent."""
    try:
        fd = os.open(uid_folder(shm_dir) / name, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        return read_head(fd)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    config = tiny_config("bf16", 80)
    path = make_random_table(tmp_path_factory.mktemp("shared") / "t.table", config, seed=4, block_size=16384)
    return path, np.concatenate(list(random_rows(config, 4)))


def test_rows_equal_the_memory_tiers_and_the_second_open_attaches(table, shm_dir):
    from engram_offload.serving.store import open_table

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
        assert second.stats()["segment"] == str(uid_folder(shm_dir) / segment_name(header))
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
    assert head(shm_dir, "engram-model").state == READY  # refused, not touched


def test_a_segment_left_half_written_without_its_head_is_cleaned(table, shm_dir):
    path, expected = table
    header = read_header(path)
    uid_folder(shm_dir).mkdir(mode=0o700)
    fd = os.open(uid_folder(shm_dir) / segment_name(header), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"ENGR")  # a loader died before its head
    os.close(fd)
    with SharedTier(header, shm_dir=shm_dir) as tier:
        assert tier.loaded and np.array_equal(tier.rows.numpy(), expected)


STUCK_LOADER = textwrap.dedent("""
    import sys, time
    from engram_offload.table import read_header
    from engram_offload.tiers import shared

    def stuck(header, dense, *args, **kwargs):
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
        state = head(shm_dir, segment_name(header))
        assert state is not None and state.state != READY
    finally:
        loader.send_signal(signal.SIGKILL)
        loader.wait()
    with SharedTier(header, shm_dir=shm_dir) as tier:  # the lock died with the loader
        assert tier.loaded
        assert np.array_equal(tier.rows.numpy(), expected)
    assert head(shm_dir, segment_name(header)).state == READY


SLOW_LOADER = textwrap.dedent("""
    import sys, time
    from engram_offload.table import read_header
    from engram_offload.tiers import shared

    steps, every = int(sys.argv[3]), float(sys.argv[4])

    def slow(header, dense, *args, on_chunk, **kwargs):  # progress `steps` times, then none
        print("loading", flush=True)
        for step in range(1, steps + 1):
            time.sleep(every)
            on_chunk(step * 4096)
        print("stalled", flush=True)
        time.sleep(120)

    shared.load_rows_into = slow
    shared.SharedTier(read_header(sys.argv[1]), shm_dir=sys.argv[2])
""")


@pytest.mark.parametrize("steps, every, timeout", [(0, 0, 0.5), (6, 0.5, 2.0)])
def test_a_waiter_gives_up_once_the_loader_makes_no_progress_for_lock_timeout(table, shm_dir, steps, every, timeout):
    # (0 steps) a loader stopped at once; (6 steps) one that progresses for longer than the
    # timeout, then stops: the waiter waits through the progress and names where it stopped
    path, _ = table
    header = read_header(path)
    name = segment_name(header)
    loader = subprocess.Popen([sys.executable, "-c", SLOW_LOADER, str(path), str(shm_dir), str(steps), str(every)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert loader.stdout.readline().strip() == "loading"
        with pytest.raises(TierError) as caught:
            SharedTier(header, shm_dir=shm_dir, lock_timeout=timeout)  # the election is exclusive: it waits
        message = str(caught.value)
        assert "\n" not in message and f"the lock {uid_folder(shm_dir) / name}.lock" in message
        assert f"pid {loader.pid}" in message and "lock_timeout=" in message
        total = 4096 + header.layout.num_rows * header.layout.row_bytes  # allocated, then each step loaded
        assert f"progress stopped at {total + steps * 4096:,} bytes" in message
        assert head(shm_dir, name).state != READY  # the waiter did not take the segment over
    finally:
        loader.send_signal(signal.SIGKILL)
        loader.wait()


# ---------------------------------------------------------------------- one copy: summed PSS
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
    assert head(shm_dir, segment_name(header)) is None


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".hidden"])
def test_a_segment_name_must_be_a_plain_file_name(table, shm_dir, name):
    with pytest.raises(ValueError, match="plain file name"):
        SharedTier(read_header(table[0]), segment=name, shm_dir=shm_dir)
