"""Never a wrong row, never a crashed process: closing under readers, truncation, descriptors."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from engram_offload.errors import TierError
from engram_offload.machine import available_memory_bytes
from engram_offload.table import read_header
from engram_offload.table.format import TableLayout, encode_header
from engram_offload.tiers import open_tier
from engram_offload.tiers.direct import DEFAULT_RINGS

from tier_cases import direct_io_refused, read, skip_unavailable, uring_available
from tiny_tables import tiny_config

CRASH_CASES = Path(__file__).with_name("crash_cases.py")


def run_child(*args: str, env: dict | None = None):
    """Run a ``crash_cases.py`` scenario; a death by signal fails the test, not pytest."""
    proc = subprocess.run([sys.executable, str(CRASH_CASES), *args], capture_output=True, text=True, timeout=300,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, f"child died (returncode {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_closing_an_mmap_store_waits_for_a_read_in_flight(tables, tmp_path):
    path = tmp_path / "copy.tbl"
    shutil.copy(tables[("fp8_e4m3_ue8m0", 64)][0], path)
    result = run_child("close_during_read", str(path))
    assert result == {"close_waited": True, "rows_ok": True, "refused_after_close": True}


def test_a_table_truncated_under_an_open_store_gives_an_error_or_its_rows(tables, tmp_path):
    """Streaming tiers refuse with ``TierError`` (never SIGBUS); resident ones keep their rows."""
    cases = [("mmap", {}), ("direct", {"engine": "threads"}),
             ("direct", {"engine": "uring"}), ("memory", {})]
    if direct_io_refused(tmp_path):
        cases = [c for c in cases if c[0] != "direct"]
    if not uring_available():
        cases = [c for c in cases if c[1].get("engine") != "uring"]
    runs = []
    for i, (tier, options) in enumerate(cases):
        path = tmp_path / f"copy-{i}.tbl"
        shutil.copy(tables[("fp8_e4m3_ue8m0", 64)][0], path)
        runs.append((tier, options, str(path)))
    results = run_child("truncated", json.dumps(runs))
    for (tier, options, path), result in zip(runs, results):
        assert result["before"] is True, (tier, options)
        if tier == "memory":
            assert result["after"] == "rows_ok"
        else:
            assert result["after"].startswith(f"TierError: {path}"), (tier, options, result)


@pytest.mark.parametrize("native", [True, False], ids=["sigbus-guard", "pread"])
def test_an_mmap_store_whose_file_shrinks_during_a_copy_gives_a_tier_error(tables, tmp_path, native):
    """Truncation between the size check and the copy: SIGBUS caught (native helper) or never
    raised (pread), and the read fails with TierError; the child process exits cleanly."""
    from engram_offload.tiers.mmap import guarded_copy_available

    if native and not guarded_copy_available():
        pytest.skip("the native SIGBUS-guarded copy is not built")
    src = tables[("fp8_e4m3_ue8m0", 64)][0]
    paths = [tmp_path / "a.tbl", tmp_path / "b.tbl"]
    for path in paths:
        shutil.copy(src, path)
    env = {} if native else {"ENGRAM_OFFLOAD_NO_NATIVE": "1"}
    result = run_child("truncated_mid_read", json.dumps({}), *map(str, paths), env=env)
    assert result["copy"].startswith(f"TierError: {paths[0]} "), result
    assert result["read_before"] == 4 and result["readers"] == ["TierError"] * 4, result


def test_closing_a_direct_store_waits_for_an_inline_read(tables):
    """A single-span read runs in the caller's thread: close must not free its descriptor,
    which the next table opened would reuse (rows of another table)."""
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    other_path, _ = tables[("fp32", 64)]
    skip_unavailable("direct", {}, path.parent)
    entered, go, hold = threading.Event(), threading.Event(), threading.Event()

    def pread(fd, buffers, offset):
        if hold.is_set():
            entered.set()
            go.wait()
        return os.preadv(fd, buffers, offset)

    t = open_tier("direct", read_header(path), engine="threads", queue_depth=1, pread=pread)
    ids = [0, 1, 2, 3]  # one page: one span, read inline
    got, errors = [], []

    def reader():
        try:
            got.append(read(t, ids))
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    hold.set()
    worker = threading.Thread(target=reader)
    worker.start()
    assert entered.wait(10)
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close returned while a read was using the descriptor"
    with open_tier("direct", read_header(other_path), engine="threads") as other:  # would take the fd
        go.set()
        worker.join()
        closer.join()
        assert other.num_rows > 0
    assert errors == []
    np.testing.assert_array_equal(got[0], expected[ids])
    with pytest.raises(ValueError, match="closed"):
        read(t, ids)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_many_short_lived_threads_share_a_few_rings(tables):
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    skip_unavailable("direct", {"engine": "uring"}, path.parent)
    failures = []
    with open_tier("direct", read_header(path), engine="uring", queue_depth=8) as t:
        read(t, [0])
        before = open_descriptors()

        def worker(seed):
            ids = np.random.default_rng(seed).integers(0, t.num_rows, 20)
            if not np.array_equal(read(t, ids), expected[ids]):
                failures.append(seed)

        for wave in range(40):  # 2,000 threads, 50 alive at a time
            threads = [threading.Thread(target=worker, args=(wave * 50 + i,)) for i in range(50)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        grown = open_descriptors() - before
    assert failures == []
    assert grown <= DEFAULT_RINGS - 1, f"{grown} descriptors more after 2,000 caller threads"
    assert open_descriptors() <= before - 2  # the table's descriptor and its ring(s) closed


def sparse_table(path: Path, config) -> Path:
    """A valid table file whose data region is a hole: a huge table costing no disk."""
    layout = TableLayout.for_config(config)
    sums = bytes(layout.page_sums_bytes)  # zero checksums: nothing reads the rows
    trailer = sums + struct.pack("<Q", xxhash.xxh3_64_intdigest(sums))
    with open(path, "wb") as f:
        f.write(encode_header(layout))
        f.seek(layout.trailer_offset)
        f.write(trailer + struct.pack("<Q", xxhash.xxh3_64_intdigest(trailer)))
    return path


@pytest.mark.parametrize("tier", ["memory", "pinned"])
def test_resident_tiers_refuse_a_table_larger_than_free_memory(tmp_path, tier):
    available = available_memory_bytes()
    if available is None:
        pytest.skip("no MemAvailable in /proc/meminfo")
    start = max(10**6, available // 100)  # ~16 rows of ~100 bytes per start: about 16x MemAvailable
    header = read_header(sparse_table(tmp_path / "huge.tbl", tiny_config(starts=(start, start + 7))))
    need = header.layout.num_rows * header.layout.row_bytes
    assert need > available
    copies = 2 if tier == "pinned" and torch.cuda.is_available() else 1
    with pytest.raises(TierError, match=rf"needs {copies * need / 2**30:,.2f} GiB.* and [\d,.]+ GiB is available "
                                        r"\(MemAvailable\).*check_memory=False"):
        open_tier(tier, header)


def test_a_table_rewritten_in_place_under_an_mmap_store_gives_an_error(tables, tmp_path):
    src, expected = tables[("fp8_e4m3_ue8m0", 64)]
    path = tmp_path / "copy.tbl"
    shutil.copy(src, path)
    os.utime(path, ns=(10**18, 10**18))  # an old mtime: the rewrite below surely changes it
    with open_tier("mmap", read_header(path)) as t:
        np.testing.assert_array_equal(read(t, [0, 7]), expected[[0, 7]])
        with open(path, "r+b") as f:
            f.seek(t.layout.row_offsets(np.array([7]))[0])
            f.write(bytes(x ^ 0xFF for x in expected[7]))
        with pytest.raises(TierError, match=r"was modified \(its mtime changed\) while open"):
            read(t, [0, 7])
