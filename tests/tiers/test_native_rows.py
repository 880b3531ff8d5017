"""The direct tier's native row read (``UringReader.read_rows``): whole pages read through a
real io_uring from a real file, checked, re-read once, rows copied out; the Python steps
(threads engine, or ``ENGRAM_OFFLOAD_NO_NATIVE`` set after a uring open) give the same rows
and the same counts."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from engram_offload._native import NO_NATIVE_ENV
from engram_offload.errors import ChecksumError, TierError
from engram_offload.table import make_random_table, read_header
from engram_offload.tiers import open_tier, uring

from test_page_checks import flip
from tier_cases import read, skip_unavailable
from tiny_tables import tiny_config

NATIVE = {"engine": "uring"}
READERS = [("native", NATIVE), ("uring, Python steps", NATIVE), ("threads", {"engine": "threads"})]


@pytest.fixture(scope="module")
def v2_table(tmp_path_factory):
    """(path, the memory tier's rows): fp8 rows, 62 a page, a partial last page."""
    path = make_random_table(tmp_path_factory.mktemp("native") / "t.tbl", tiny_config(), seed=7)
    with open_tier("memory", read_header(path)) as t:
        rows = t.rows.numpy().copy()
    layout = read_header(path).layout
    assert layout.num_rows % layout.rows_per_page  # the last page is partial
    return path, rows


@pytest.fixture()
def table_copy(v2_table, tmp_path):
    path = tmp_path / "copy.tbl"
    shutil.copy(v2_table[0], path)
    skip_unavailable("direct", NATIVE, tmp_path)
    return path, v2_table[1]


def open_direct(path, **options):
    return open_tier("direct", read_header(path), **options)


def spy_engine_reads(t) -> list:
    """Calls of the engine's span read from now on (the Python steps; the native call makes none)."""
    calls: list = []
    real = t._engine.read

    def counted(*args):
        calls.append(len(args[0]))
        return real(*args)

    t._engine.read = counted
    return calls


def id_cases(layout) -> dict[str, np.ndarray]:
    rpp, n = layout.rows_per_page, layout.num_rows
    page = layout.num_pages // 2
    first, last = layout.page_rows(page)
    rng = np.random.default_rng(3)
    return {
        "random sorted": np.unique(rng.integers(0, n, 400)),
        "random, repeats, any order": rng.integers(0, n, 700),
        "first and last row of a page": np.array([first, last]),
        "first and last row of the table": np.array([0, n - 1]),
        "one id": np.array([rpp + 1]),
        "many ids in one page": np.arange(first, last + 1)[::-1].copy(),
        "every row": np.arange(n),
        "pages going back": np.array([n - 1, 0, rpp * 3, 1, rpp * 3 + 2]),
    }


@pytest.mark.parametrize("name,options", READERS, ids=[name for name, _ in READERS])
def test_rows_equal_the_memory_tiers_and_the_counts_match(v2_table, tmp_path, monkeypatch, name, options):
    path, expected = v2_table
    skip_unavailable("direct", options, tmp_path)
    layout = read_header(path).layout
    with open_direct(path, **options) as t:
        if name == "uring, Python steps":
            monkeypatch.setenv(NO_NATIVE_ENV, "1")  # read on every call: the uring engine's spans, Python checks
        before = t.stats()
        spans = spy_engine_reads(t)
        pages = 0
        for case, ids in id_cases(layout).items():
            np.testing.assert_array_equal(read(t, ids), expected[ids], err_msg=case)
            pages += len(np.unique(ids // layout.rows_per_page))
        stats = t.stats()
    assert (spans == []) == (name == "native")
    assert stats["reads"] - before["reads"] == pages
    assert stats["bytes_read"] - before["bytes_read"] == pages * layout.page_bytes
    assert stats["pages_checked"] - before["pages_checked"] == pages
    assert stats["page_rereads"] == 0


def test_native_off_by_environment_gives_the_same_rows(v2_table, tmp_path, monkeypatch):
    path, expected = v2_table
    skip_unavailable("direct", NATIVE, tmp_path)
    ids = np.random.default_rng(5).integers(0, len(expected), 300)
    with open_direct(path, **NATIVE) as t:
        spans = spy_engine_reads(t)
        native_rows = read(t, ids)
        assert spans == []
        monkeypatch.setenv(NO_NATIVE_ENV, "1")
        python_rows = read(t, ids)
        assert spans  # the Python steps ran
    np.testing.assert_array_equal(native_rows, expected[ids])
    np.testing.assert_array_equal(python_rows, native_rows)


def test_rows_land_in_a_strided_out(v2_table, tmp_path):
    path, expected = v2_table
    skip_unavailable("direct", NATIVE, tmp_path)
    ids = np.array([9, 4, 2000, 1])
    with open_direct(path, **NATIVE) as t:
        out = torch.zeros((t.row_bytes, len(ids)), dtype=torch.uint8).t()  # [n, row_bytes], not contiguous
        t.read_rows(ids, out)
    np.testing.assert_array_equal(out.numpy(), expected[ids])


def test_a_flipped_byte_fails_the_next_read_of_a_row_in_its_page(table_copy):
    path, expected = table_copy
    layout = read_header(path).layout
    page = layout.num_pages // 2
    first, last = layout.page_rows(page)
    with open_direct(path, **NATIVE) as t:
        np.testing.assert_array_equal(read(t, [first, last]), expected[[first, last]])
        flip(path, layout.data_offset + page * layout.page_bytes + layout.row_bytes + 3)  # a byte of row first+1
        others = [0, first - 1, last + 1, layout.num_rows - 1]
        np.testing.assert_array_equal(read(t, others), expected[others])
        with pytest.raises(ChecksumError, match=rf"data page {page} \(rows {first:,}\.\.{last:,}\) does not "
                                                r"match its checksum after a re-read"):
            read(t, [1, last])  # the last row of the page: its bytes are intact, its page is not
        stats = t.stats()
    assert stats["page_rereads"] == 1 and stats["pages_checked"] >= 2 + 4 + 1
    stored = np.frombuffer(path.read_bytes(), np.uint8)[layout.row_offsets(np.array([first + 1]))[0]:]
    assert (stored[: layout.row_bytes] != expected[first + 1]).sum() == 1  # the bytes as stored: one flipped


def damaging_reads(monkeypatch, pages: int) -> list:
    """The next native call damages its first ``pages`` page transfers (the extension's
    fault hook: one byte flipped after the read, before the check); returns its results."""
    real = uring.UringReader.read_rows
    results: list = []

    def damaging(self, *args, **kwargs):
        got = real(self, *args, damage=pages if not results else 0, **kwargs)
        results.append(got)
        return got

    monkeypatch.setattr(uring.UringReader, "read_rows", damaging)
    return results


def test_a_transient_bad_transfer_is_read_again_and_succeeds(table_copy, monkeypatch):
    path, expected = table_copy
    ids = np.array([3, 400, 401, 2000])
    with open_direct(path, **NATIVE) as t:
        results = damaging_reads(monkeypatch, 1)
        np.testing.assert_array_equal(read(t, ids), expected[ids])
        stats = t.stats()
    assert len(results) == 1 and results[0].page_rereads == 1 and results[0].bad_page == -1
    assert stats["page_rereads"] == 1 and stats["reads"] == 3 + 1  # 3 pages, 1 of them again


def test_a_page_bad_on_both_reads_raises(table_copy, monkeypatch):
    path, _ = table_copy
    layout = read_header(path).layout
    with open_direct(path, **NATIVE) as t:
        damaging_reads(monkeypatch, 2)
        with pytest.raises(ChecksumError, match=rf"data page 1 \(rows {layout.rows_per_page:,}\.\."):
            read(t, [layout.rows_per_page + 5])
        assert t.stats()["page_rereads"] == 1


def test_a_page_past_the_end_of_the_file_raises_naming_the_file(table_copy):
    path, expected = table_copy
    layout = read_header(path).layout
    with open_direct(path, **NATIVE) as t:
        os.truncate(path, layout.data_offset + 2 * layout.page_bytes)
        np.testing.assert_array_equal(read(t, [0, 1, 70]), expected[[0, 1, 70]])
        with pytest.raises(TierError, match=rf"{path.name}: .*file offset "
                                            rf"{layout.data_offset + 5 * layout.page_bytes}.*end of file"):
            read(t, [0, 5 * layout.rows_per_page])
        np.testing.assert_array_equal(read(t, [3]), expected[[3]])  # the ring is still usable


@pytest.fixture()
def reader(table_copy):
    path, expected = table_copy
    header = read_header(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    with uring.UringReader(fd, 8) as r:
        yield r, header, expected
    os.close(fd)


@pytest.mark.parametrize("bad_id", [-1, "num_rows"])
def test_ids_out_of_range_are_refused_before_any_io(reader, bad_id):
    r, header, _ = reader
    layout = header.layout
    bad = layout.num_rows if bad_id == "num_rows" else bad_id
    out = np.zeros((3, layout.row_bytes), np.uint8)
    with pytest.raises(IndexError, match=rf"row id {bad} \(at position 1\) is out of range"):
        r.read_rows(np.array([0, bad, 2]), out, layout, header.page_sums)
    assert r.syscalls == 0 and not out.any()


def test_an_out_too_small_is_refused_before_any_io(reader):
    r, header, _ = reader
    layout = header.layout
    out = np.zeros((2, layout.row_bytes), np.uint8)
    with pytest.raises(ValueError, match="out holds"):
        r.read_rows(np.array([0, 1, 2]), out, layout, header.page_sums)
    assert r.syscalls == 0 and not out.any()


def test_the_reader_reads_more_pages_than_its_queue_depth(reader):
    r, header, expected = reader
    ids = np.arange(0, header.layout.num_rows, 7)  # every page, 8 reads in flight at most
    out = np.empty((len(ids), header.layout.row_bytes), np.uint8)
    got = r.read_rows(ids, out, header.layout, header.page_sums)
    np.testing.assert_array_equal(out, expected[ids])
    assert got == uring.RowsRead(header.layout.num_pages, header.layout.num_pages, 0, -1)


def read_every_page(r, header):
    ids = np.arange(0, header.layout.num_rows, 5)
    out = np.empty((len(ids), header.layout.row_bytes), np.uint8)
    got = r.read_rows(ids, out, header.layout, header.page_sums)
    return ids, out, got


@pytest.mark.parametrize("queue_depth, huge", [(8, False), (64, True), (128, True)])
def test_page_slots_of_256_kib_or_more_lie_on_huge_pages_and_stay_registered(table_copy, queue_depth, huge):
    path, expected = table_copy
    header = read_header(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with uring.UringReader(fd, queue_depth) as r:
            assert not r.fixed_pages and not r.huge_pages  # nothing allocated before the first read
            ids, out, got = read_every_page(r, header)
            np.testing.assert_array_equal(out, expected[ids])
            assert got.pages_checked == header.layout.num_pages and got.bad_page == -1
            assert r.queue_depth * header.layout.page_bytes >= (256 << 10) or not huge
            assert (r.huge_pages, r.fixed_pages) == (huge, True)
    finally:
        os.close(fd)


# Run in a child process without CAP_IPC_LOCK (root's ignores RLIMIT_MEMLOCK): a ring of 128
# page slots (512 KiB, one 2 MiB huge page) under a memory-lock limit of `limit` KiB.
MEMLOCK_CHILD = """
import os, resource, sys
import numpy as np
from engram_offload.table import read_header
from engram_offload.tiers import uring
path, limit = sys.argv[1], int(sys.argv[2])
header = read_header(path)
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit << 10, limit << 10))
ids = np.arange(0, header.layout.num_rows, 3)
out = np.empty((len(ids), header.layout.row_bytes), np.uint8)
with uring.UringReader(fd, 128) as r:
    got = r.read_rows(ids, out, header.layout, header.page_sums)
    print(int(r.huge_pages), int(r.fixed_pages), got.bad_page)
np.save(sys.stdout.buffer, out)
"""


# 1 MiB: the 4 KiB pages fit, a 2 MiB huge page does not (the kernel may have given 4 KiB pages
# anyway: then the huge advice stands); 256 KiB: neither fits, reads are plain.
@pytest.mark.parametrize("limit_kib, huge, fixed", [(8192, True, True), (1024, None, True), (256, False, False)])
def test_a_memory_lock_limit_takes_the_huge_page_then_the_registration_never_the_rows(
        table_copy, limit_kib, huge, fixed):
    path, expected = table_copy  # the child opens it before it gives up root
    run = subprocess.run([sys.executable, "-c", MEMLOCK_CHILD, str(path), str(limit_kib)], capture_output=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr.decode()
    first, _, rest = run.stdout.partition(b"\n")
    got_huge, got_fixed, bad_page = (int(v) for v in first.split())
    assert (got_fixed, bad_page) == (fixed, -1) and huge in (None, got_huge)
    ids = np.arange(0, read_header(path).layout.num_rows, 3)
    np.testing.assert_array_equal(np.load(io.BytesIO(rest)), expected[ids])
