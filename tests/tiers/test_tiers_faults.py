"""Failures are loud: checksum mismatches, injected I/O errors, refused O_DIRECT."""

from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest

from engram_offload.errors import ChecksumError, TierError
from engram_offload.table import read_header
from engram_offload.tiers import direct as direct_module
from engram_offload.tiers import memory as memory_module
from engram_offload.tiers import open_tier

from tier_cases import read, skip_unavailable, uring_available

FLIPPED_PAGE = 4


@pytest.fixture
def damaged(tables, tmp_path):
    """A copy of the fp8 table with one byte flipped in data page 4 (its second row):
    (path, bad row, good row, expected)."""
    src, expected = tables[("fp8_e4m3_ue8m0", 64)]
    path = tmp_path / "damaged.tbl"
    shutil.copy(src, path)
    layout = read_header(path).layout
    with open(path, "r+b") as f:
        f.seek(FLIPPED_PAGE * layout.page_bytes + layout.data_offset + 100)
        b = f.read(1)
        f.seek(FLIPPED_PAGE * layout.page_bytes + layout.data_offset + 100)
        f.write(bytes([b[0] ^ 0x01]))
    bad_row = layout.page_rows(FLIPPED_PAGE)[1]  # not the row holding the flipped byte: the page is what counts
    return path, bad_row, 0, expected


DIRECT_ENGINES = [{"engine": "threads"}, {"engine": "uring"}]


@pytest.mark.parametrize("tier,options", [("mmap", {})] + [("direct", o) for o in DIRECT_ENGINES])
def test_read_verification_names_the_bad_page(damaged, tier, options):
    path, bad_row, good_row, expected = damaged
    skip_unavailable(tier, options, path.parent)
    with open_tier(tier, read_header(path), **options) as t:
        np.testing.assert_array_equal(read(t, [good_row]), expected[[good_row]])
        with pytest.raises(ChecksumError, match=rf"data page {FLIPPED_PAGE} \(rows [\d,]+\.\.{bad_row:,}\)"):
            read(t, [good_row, bad_row])
        with pytest.raises(ChecksumError):  # still refused the second time
            read(t, [bad_row])


def test_memory_tier_verifies_while_loading(damaged):
    path = damaged[0]
    for verify in (True, None):  # page checksums are checked by default
        with pytest.raises(ChecksumError, match=rf"data page {FLIPPED_PAGE} \(rows "):
            open_tier("memory", read_header(path), verify_reads=verify)
    open_tier("memory", read_header(path), verify_reads=False).close()


class FlakyPread:
    """An ``os.preadv`` stand-in failing as scripted, then reading for real."""

    def __init__(self, mode: str, failures: int = 10**9) -> None:
        self.mode, self.failures, self.calls = mode, failures, 0

    def __call__(self, fd, buffers, offset):
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            if self.mode == "eio":
                raise OSError(errno.EIO, "Input/output error")
            if self.mode == "eof":
                return 0
            if self.mode == "short":  # half of the request, sector aligned
                view = buffers[0]
                half = max(512, len(view) // 2 // 512 * 512)
                return os.preadv(fd, [view[:half]], offset) if len(view) > 512 else os.preadv(fd, [view], offset)
            if self.mode == "ragged":  # a short read ending mid-sector
                view = buffers[0]
                got = os.preadv(fd, [view], offset)
                return min(got, 700)
        return os.preadv(fd, buffers, offset)


def open_flaky(tables, pread, **options):
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    skip_unavailable("direct", {}, path.parent)
    return open_tier("direct", read_header(path), engine="threads", pread=pread, **options), expected


@pytest.mark.parametrize("mode,failures", [("eio", 2), ("short", 50), ("ragged", 3)])
def test_transient_failures_are_retried(tables, mode, failures):
    pread = FlakyPread("none", 0)
    t, expected = open_flaky(tables, pread, queue_depth=2, retries=3)
    with t:
        ids = np.random.default_rng(0).integers(0, t.num_rows, 200)
        pread.mode, pread.failures = mode, failures
        np.testing.assert_array_equal(read(t, ids), expected[ids])
        assert t.stats()["retries"] >= 1


def test_persistent_failures_raise_tier_error(tables):
    pread = FlakyPread("none", 0)
    t, _ = open_flaky(tables, pread, queue_depth=3, retries=2)
    with t:
        pread.mode, pread.failures = "eio", 10**9
        calls = pread.calls
        with pytest.raises(TierError, match=r"offset \d+ failed after 0 bytes and 2 retries: Input/output error"):
            read(t, [0])
        assert pread.calls - calls == 3  # 1 + retries attempts


@pytest.mark.parametrize("failures", [1, 10**9])
def test_end_of_file_is_not_retried(tables, failures):
    pread = FlakyPread("none", 0)
    t, _ = open_flaky(tables, pread, queue_depth=1, retries=3)
    with t:
        pread.mode, pread.failures = "eof", failures
        calls = pread.calls
        with pytest.raises(TierError, match=r"failed after 0 bytes and 0 retries: end of file"):
            read(t, [0])
        assert pread.calls - calls == 1


def test_hard_errors_are_not_retried(tables):
    calls = []

    def pread(fd, buffers, offset):
        if calls:
            calls.append(offset)
            raise OSError(errno.EBADF, "Bad file descriptor")
        calls.append(offset)
        return os.preadv(fd, buffers, offset)

    t, _ = open_flaky(tables, pread, queue_depth=1)
    with t:
        with pytest.raises(TierError, match="Bad file descriptor"):
            read(t, [5])
        assert len(calls) == 2  # probe, then the failing read: not retried


def test_refused_o_direct_is_a_clear_error(tables, monkeypatch):
    path, _ = tables[("fp32", 64)]
    real_open = os.open

    def no_direct(p, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args)

    monkeypatch.setattr(direct_module.os, "open", no_direct)
    with pytest.raises(TierError, match="refuses O_DIRECT.*mmap or memory tier"):
        open_tier("direct", read_header(path), engine="threads")


def test_o_direct_refused_at_read_is_a_clear_error(tables):
    path, _ = tables[("fp32", 64)]
    skip_unavailable("direct", {}, path.parent)

    def pread(fd, buffers, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    with pytest.raises(TierError, match="refuses O_DIRECT"):
        open_tier("direct", read_header(path), engine="threads", pread=pread)


def test_engine_choice(tables):
    path, _ = tables[("fp32", 64)]
    skip_unavailable("direct", {}, path.parent)
    with pytest.raises(ValueError, match="unknown direct engine"):
        open_tier("direct", read_header(path), engine="spdk")
    with open_tier("direct", read_header(path), engine="threads") as t:
        assert t.stats()["engine"] == "threads"
    with open_tier("direct", read_header(path)) as t:
        assert t.stats()["engine"] == ("uring" if uring_available() else "threads")


@pytest.mark.parametrize("chunk_bytes", [32 << 20, 12288, 4096])
def test_memory_tier_finds_the_bad_page_whatever_the_load_chunk(tables, damaged, chunk_bytes, monkeypatch):
    """Pages checked in load chunks of 32 MiB, 12 KiB or 4 KiB."""
    monkeypatch.setattr(memory_module, "LOAD_CHUNK_BYTES", chunk_bytes)
    with pytest.raises(ChecksumError, match=rf"data page {FLIPPED_PAGE} "):
        open_tier("memory", read_header(damaged[0]), verify_reads=True)
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    with open_tier("memory", read_header(path), verify_reads=True) as t:
        np.testing.assert_array_equal(t.rows.numpy(), expected)


def engines_for(fd):
    engines = [direct_module.ThreadEngine(fd, threads=2)]
    if uring_available():
        engines.append(direct_module.UringEngine(fd, queue_depth=4))
    return engines


def test_engines_fail_alike(tables):
    """One policy, one sentence: end of file and refused (misaligned) O_DIRECT reads."""
    path, _ = tables[("fp32", 64)]
    skip_unavailable("direct", {}, path.parent)
    size = os.path.getsize(path)
    past_end = (size // 4096 + 1) * 4096
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = direct_module.aligned_empty(8192)
    cases = [(past_end, errno.EIO, f"read of 4096 bytes at file offset {past_end} failed after 0 bytes and 0 "
                                   "retries: end of file"),
             (512 + 1, errno.EINVAL, "read of 4096 bytes at file offset 513 failed after 0 bytes and 0 retries: "
                                     "Invalid argument")]
    try:
        for engine in engines_for(fd):
            for offset, err, message in cases:
                with pytest.raises(OSError) as info:
                    engine.read(np.array([offset], np.int64), np.array([4096], np.int64), buf, np.zeros(1, np.int64))
                assert (info.value.errno, info.value.strerror) == (err, message), engine.name
            engine.close()
    finally:
        os.close(fd)
