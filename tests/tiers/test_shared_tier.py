"""The shared tier: one copy per machine, attach checks, crashed loaders, summed PSS."""

from __future__ import annotations

import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from engram_offload.errors import ChecksumError, TierError
from engram_offload.table import make_random_table, random_rows, read_header
from engram_offload.tiers import memory, shared
from engram_offload.tiers.memory import MemoryTier
from engram_offload.tiers.segments import READY, read_head, uid_folder
from engram_offload.tiers.shared import SharedTier, process_pss, remove_segment, segment_name

from tier_cases import read
from tiny_tables import tiny_config


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
    path = make_random_table(tmp_path_factory.mktemp("shared") / "t.table", config, seed=4)
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
    other = make_random_table(tmp_path / "other.table", tiny_config("bf16", 80), seed=99)
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


def test_a_damaged_table_is_refused_while_loading_and_leaves_no_segment(table, tmp_path, shm_dir):
    path, _ = table
    damaged = tmp_path / "damaged.table"
    shutil.copy(path, damaged)
    header = read_header(damaged)
    with open(damaged, "r+b") as f:  # flip a byte of data page 4
        f.seek(header.layout.data_offset + 4 * header.layout.page_bytes + 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match="data page 4 "):
        SharedTier(header, shm_dir=shm_dir, verify_reads=True)
    assert head(shm_dir, segment_name(header)) is None


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".hidden"])
def test_a_segment_name_must_be_a_plain_file_name(table, shm_dir, name):
    with pytest.raises(ValueError, match="plain file name"):
        SharedTier(read_header(table[0]), segment=name, shm_dir=shm_dir)


# --------------------------------------------------------------------------- process_pss
MAPPER = textwrap.dedent("""
    import mmap, os, sys
    anon = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,  # then the segment twice, below it
                     prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)  # "rwxp": no dash in its permissions
    anon.write(b"x" * (1 << 20))
    fd = os.open(sys.argv[1], os.O_RDONLY)
    maps = [mmap.mmap(fd, 0, prot=mmap.PROT_READ) for _ in range(2)]
    print(sum(m[i] for m in maps for i in range(0, len(m), mmap.PAGESIZE)), flush=True)  # every page faulted in
    sys.stdin.readline()
""")


def rollup_pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))


def test_process_pss_sums_a_processs_mappings_of_one_file_and_its_whole_rollup(table, shm_dir):
    header = read_header(table[0])
    with SharedTier(header, shm_dir=shm_dir) as tier:
        segment = tier.segment
    pages = -(-os.stat(segment).st_size // os.sysconf("SC_PAGE_SIZE"))
    size = pages * os.sysconf("SC_PAGE_SIZE")
    children = []
    try:
        for _ in range(2):
            children.append(subprocess.Popen([sys.executable, "-c", MAPPER, str(segment)], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, text=True))
            assert children[-1].stdout.readline().strip().isdigit()
            # each page is mapped twice in each child: PSS divides it by the mappings, the child's two sum
            each = [process_pss(child.pid, segment) for child in children]
            assert each == [size // len(children)] * len(children), (each, size)
            assert process_pss(children[-1].pid, str(segment)) == each[-1]  # the path as a str
        assert process_pss(children[0].pid, shm_dir / "other") == 0  # a file it does not map
        assert process_pss(mapping=segment) == 0  # this process: none of its mappings
        fd = os.open(segment, os.O_RDONLY)
        try:  # this process maps it too: the default pid is this one
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mine:
                assert sum(mine[i] for i in range(0, len(mine), mmap.PAGESIZE)) >= 0
                assert process_pss(children[0].pid, segment) < each[0]  # a fifth of each page now
                assert 0 < process_pss(mapping=segment) == process_pss(os.getpid(), segment)
        finally:
            os.close(fd)
        for child in children:  # the whole process, as smaps_rollup has it (stable once it waits)
            for _ in range(100):
                before = rollup_pss_kib(child.pid)
                got = process_pss(child.pid)
                if rollup_pss_kib(child.pid) == before:
                    break
            assert got == before * 1024 and got > size // 2 + (1 << 20)
        assert process_pss() > 0 and process_pss(None) > 0
    finally:
        for child in children:
            child.stdin.close()
            child.wait()


# ------------------------------------------------------------------- reads, checks, stats
@pytest.fixture(scope="module")
def big_table(tmp_path_factory):
    """1.6 MiB of rows, whole pages (8 rows of 512 bytes a page): larger than one scratch buffer."""
    config = tiny_config("bf16", 256)
    path = make_random_table(tmp_path_factory.mktemp("shared-big") / "big.table", config, seed=5)
    return path, np.concatenate(list(random_rows(config, 5)))


def test_stats_name_the_segment_its_size_and_how_reads_are_checked(table, shm_dir):
    header = read_header(table[0])
    total = 4096 + header.layout.num_rows * header.layout.row_bytes
    with SharedTier(header, shm_dir=shm_dir, sample_pages=2) as tier:
        stats = tier.stats()
        assert {key: stats[key] for key in ("segment", "loaded_here", "segment_bytes", "replaced", "sample_pages",
                                             "verify_reads", "attach_check_seconds")} == {
            "segment": str(uid_folder(shm_dir) / segment_name(header)), "loaded_here": True, "segment_bytes": total,
            "replaced": None, "sample_pages": 2, "verify_reads": False, "attach_check_seconds": 0.0}
    started = time.perf_counter()
    with SharedTier(header, shm_dir=shm_dir, verify_reads=True) as tier:
        opened = time.perf_counter() - started
        stats = tier.stats()
        assert stats["verify_reads"] is True and stats["loaded_here"] is False and stats["huge_pages"] is False
        assert stats["verified_on_load"] is True and 0 < stats["attach_check_seconds"] <= stats["load_seconds"] <= opened
        assert np.array_equal(read(tier, [7]), table[1][[7]])
        assert tier.stats()["bytes_read"] == header.layout.row_bytes
    with SharedTier(header, shm_dir=shm_dir, sample_pages=0) as tier:
        assert np.array_equal(read(tier, [7]), table[1][[7]])  # a first read of one row: its spans made for it


def test_sampled_reads_check_the_distinct_pages_of_a_few_rows_and_count_the_bytes(table, shm_dir):
    path, expected = table
    header = read_header(path)
    rpp, rb = header.layout.rows_per_page, header.layout.row_bytes
    random.seed(0)
    with SharedTier(header, shm_dir=shm_dir, sample_pages=3) as tier:
        first_page = np.arange(rpp)  # every row on page 0: three samples, one page
        assert np.array_equal(read(tier, first_page), expected[first_page])
        assert tier.stats()["pages_checked"] == 1 and tier.stats()["bytes_read"] == rpp * rb
        spread = np.arange(0, 40 * rpp, 4 * rpp)  # ten rows, ten pages: at most three checked
        assert np.array_equal(read(tier, spread), expected[spread])
        assert 2 <= tier.stats()["pages_checked"] <= 4 and tier.stats()["bytes_read"] == (rpp + 10) * rb
    with SharedTier(header, shm_dir=shm_dir, sample_pages=2) as two:
        assert np.array_equal(read(two, first_page), expected[first_page])
        assert two.stats()["pages_checked"] == 1  # two samples, one page
    with SharedTier(header, shm_dir=shm_dir, sample_pages=1) as one, \
            SharedTier(header, shm_dir=shm_dir, sample_pages=0) as none:
        for _ in range(2):
            assert np.array_equal(read(one, spread), expected[spread])
            assert np.array_equal(read(none, spread), expected[spread])
        assert one.stats()["pages_checked"] == 2 and none.stats()["pages_checked"] == 0


def test_a_read_into_a_strided_out_fills_only_its_columns(table, shm_dir):
    path, expected = table
    header = read_header(path)
    rb = header.layout.row_bytes
    ids = np.array([5, 3000, 17, 17], np.int64)
    with SharedTier(header, shm_dir=shm_dir, sample_pages=0) as tier:
        wide = torch.zeros((len(ids), 2 * rb), dtype=torch.uint8)
        out = wide[:, rb:]  # not contiguous: every row of it is half of a wider row
        assert tier.read_rows(ids, out) is out
        assert np.array_equal(wide[:, rb:].numpy(), expected[ids]) and not wide[:, :rb].any()
        assert tier.stats()["bytes_read"] == len(ids) * rb


def test_verified_reads_of_a_last_page_holding_fewer_rows_pass(table, shm_dir):
    path, expected = table
    header = read_header(path)
    last = header.layout.num_rows - 1
    assert header.layout.num_rows % header.layout.rows_per_page  # the last page is part empty
    with SharedTier(header, shm_dir=shm_dir, verify_reads=True) as tier:
        for ids in ([0, 1], [last], [last - 1, last], [3, last]):  # a full page first: its rows stay in the buffer
            assert np.array_equal(read(tier, ids), expected[ids])


@pytest.mark.parametrize("native", [True, False])
def test_attach_checks_and_verified_reads_of_more_than_a_scratch_buffer(big_table, shm_dir, monkeypatch, native):
    monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "" if native else "1")  # else every copy is a pread of the file
    path, expected = big_table
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir):
        pass
    with SharedTier(header, shm_dir=shm_dir, verify_reads=True) as checked, \
            SharedTier(header, shm_dir=shm_dir, sample_pages=2) as sampled:
        assert not checked.loaded and checked.attach_check_seconds > 0
        every = np.arange(header.layout.num_rows)
        assert np.array_equal(read(checked, every), expected)
        assert checked.stats()["pages_checked"] == header.layout.num_pages
        assert np.array_equal(read(sampled, every[::-7]), expected[::-7])


def test_the_attach_check_runs_on_a_few_named_threads_chunk_by_chunk(table, shm_dir, monkeypatch):
    header = read_header(table[0])
    with SharedTier(header, shm_dir=shm_dir):
        pass
    seen = []
    checked = shared.bad_pages

    def recording(*args):
        seen.append(threading.current_thread().name)
        return checked(*args)

    monkeypatch.setattr(shared, "CHECK_CHUNK_BYTES", header.layout.page_bytes)  # one page a chunk
    monkeypatch.setattr(shared, "bad_pages", recording)
    with SharedTier(header, shm_dir=shm_dir, verify_attach="full") as tier:
        assert not tier.loaded and tier.replaced is None
        assert np.array_equal(tier.rows.numpy(), table[1])
    assert len(seen) == header.layout.num_pages
    assert all(name.startswith("engram-shm-check_") for name in seen), set(seen)
    assert len(set(seen)) <= shared.CHECK_THREADS


def test_a_load_says_its_progress_in_the_segment_and_on_stderr(table, shm_dir, capfd):
    path, expected = table
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir, progress=True) as tier:
        assert np.array_equal(tier.rows.numpy(), expected)
    err = capfd.readouterr().err
    assert f"sharing {path.name}: " in err and "(100%)" in err, err
    total = 4096 + header.layout.num_rows * header.layout.row_bytes
    assert head(shm_dir, segment_name(header)).progress == total + header.layout.data_bytes  # allocated, then loaded
    with SharedTier(header, shm_dir=shm_dir, progress=False):
        pass
    assert capfd.readouterr().err == ""


def test_a_segment_allocated_in_several_steps_is_the_tables_size(table, shm_dir, monkeypatch):
    path, expected = table
    header = read_header(path)
    monkeypatch.setattr(shared, "ALLOCATE_STEP", 65536)
    with SharedTier(header, shm_dir=shm_dir) as tier:
        assert tier.loaded and np.array_equal(tier.rows.numpy(), expected)
        assert os.stat(tier.segment).st_size == 4096 + header.layout.num_rows * header.layout.row_bytes


def test_check_memory_false_loads_what_memavailable_would_refuse(table, shm_dir, monkeypatch):
    path, expected = table
    header = read_header(path)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 4096)
    with pytest.raises(TierError) as caught:
        SharedTier(header, shm_dir=shm_dir)
    assert "the shared tier loads the whole table into RAM" in str(caught.value)
    assert head(shm_dir, segment_name(header)) is None
    with SharedTier(header, shm_dir=shm_dir, check_memory=False) as tier:
        assert tier.loaded and np.array_equal(tier.rows.numpy(), expected)


# ----------------------------------------------------------------------------- remove_segment
HOLDER = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.readline()
""")


def test_remove_segment_checks_its_options_and_waits_for_the_lock_no_longer_than_lock_timeout(table, shm_dir):
    header = read_header(table[0])
    assert remove_segment(header, shm_dir=shm_dir) is False  # no folder of this uid's there
    assert not uid_folder(shm_dir).exists()
    with pytest.raises(ValueError, match="plain file name"):
        remove_segment(header, segment="a/b", shm_dir=shm_dir)
    with SharedTier(header, shm_dir=shm_dir):
        pass
    lock = uid_folder(shm_dir) / (segment_name(header) + ".lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TierError, match=f"the lock {lock}"):
            remove_segment(header, shm_dir=shm_dir, lock_timeout=0.2)
    finally:
        holder.stdin.close()
        holder.wait()
    assert head(shm_dir, segment_name(header)).state == READY  # not removed while the lock was held
    assert remove_segment(header, shm_dir=shm_dir) is True and head(shm_dir, segment_name(header)) is None
    assert not lock.exists()
