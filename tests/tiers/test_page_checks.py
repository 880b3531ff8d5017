"""Every page read is checked against its checksum, on every tier that reads pages (direct
with either engine, mmap) and at load (memory, pinned); a transient bad read is read again."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest

from engram_offload._native import NO_NATIVE_ENV
from engram_offload.errors import ChecksumError
from engram_offload.table import make_random_table, random_rows, read_header
from engram_offload.tiers import open_tier

from tier_cases import read, skip_unavailable
from tiny_tables import tiny_config

PAGE_READERS = [("direct", {"engine": "threads"}), ("direct", {"engine": "uring"}), ("mmap", {})]
# The Python read steps, where a wrapped engine read can corrupt a transfer (the uring engine's
# with ENGRAM_OFFLOAD_NO_NATIVE set after the open; the native call's own case:
# tests/tiers/test_native_rows.py).
PYTHON_PAGE_READERS = [("direct", {"engine": "threads"}), ("direct", {"engine": "uring"}), ("mmap", {})]


@pytest.fixture(scope="module")
def v2_table(tmp_path_factory):
    """(path, expected raw rows): fp8 rows, 62 a page."""
    config = tiny_config()
    path = make_random_table(tmp_path_factory.mktemp("v2") / "t.tbl", config, seed=5)
    return path, np.concatenate(list(random_rows(config, 5)))


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x20]))
        f.flush()


def page_of_interest(layout) -> tuple[int, int, int]:
    """A page in the middle: (page, its first row, its last row)."""
    page = layout.num_pages // 2
    return (page, *layout.page_rows(page))


def open_quietly(tier, path, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pinned without CUDA warns
        return open_tier(tier, read_header(path), **options)


@pytest.mark.parametrize("tier,options", PAGE_READERS)
def test_a_flipped_byte_fails_the_next_read_of_a_row_in_its_page(v2_table, tmp_path, tier, options):
    src, expected = v2_table
    path = tmp_path / "copy.tbl"
    shutil.copy(src, path)
    skip_unavailable(tier, options, tmp_path)
    layout = read_header(path).layout
    page, first, last = page_of_interest(layout)
    if tier == "mmap":  # a write under an open mapping changes the mtime: a TierError of its own
        flip(path, layout.data_offset + page * layout.page_bytes + 7)
    with open_quietly(tier, path, **options) as t:
        if tier != "mmap":
            np.testing.assert_array_equal(read(t, [first, last]), expected[[first, last]])
            flip(path, layout.data_offset + page * layout.page_bytes + 7)  # a byte of the first row
        others = [0, first - 1, last + 1, layout.num_rows - 1]
        np.testing.assert_array_equal(read(t, others), expected[others])  # other pages still read
        with pytest.raises(ChecksumError, match=rf"data page {page} \(rows {first:,}\.\.{last:,}\) does not "
                                                r"match its checksum after a re-read"):
            read(t, [0, last])  # the last row of the page: its bytes are intact, its page is not
        stats = t.stats()
        assert stats["page_rereads"] == 1 and stats["pages_checked"] >= 3


@pytest.mark.parametrize("tier", ["memory", "pinned"])
def test_resident_tiers_check_every_page_while_loading(v2_table, tmp_path, tier):
    src, expected = v2_table
    path = tmp_path / "copy.tbl"
    shutil.copy(src, path)
    layout = read_header(path).layout
    page, first, last = page_of_interest(layout)
    flip(path, layout.data_offset + page * layout.page_bytes + layout.page_bytes - 1)  # the page's padding
    for verify in (None, True):
        with pytest.raises(ChecksumError, match=rf"data page {page} \(rows {first:,}\.\.{last:,}\)"):
            open_quietly(tier, path, verify_reads=verify)
    with open_quietly(tier, path, verify_reads=False) as t:  # unchecked: the rows as stored
        assert t.stats()["verified_on_load"] is False
        np.testing.assert_array_equal(t.rows.numpy(), expected)
    with open_quietly(tier, src) as t:
        stats = t.stats()
        assert stats["verified_on_load"] is True and stats["load_bytes"] == layout.data_bytes
        assert stats["load_seconds"] > 0


def corrupt_first_call(real, buffer_arg: int):
    """``real`` wrapped: its first call's destination gets one byte flipped after the real read."""
    calls = []

    def wrapper(*args):
        real(*args)
        if not calls:
            args[buffer_arg][5] ^= 0xFF
        calls.append(1)

    return wrapper, calls


@pytest.mark.parametrize("tier,options", PYTHON_PAGE_READERS)
def test_a_transient_bad_read_is_read_again_and_succeeds(v2_table, monkeypatch, tier, options):
    path, expected = v2_table
    skip_unavailable(tier, options, path.parent)
    ids = np.array([3, 400, 401, 2000])
    with open_quietly(tier, path, **options) as t:
        if options.get("engine") == "uring":
            monkeypatch.setenv(NO_NATIVE_ENV, "1")  # read on every call: the Python steps
        if tier == "direct":
            t._engine.read, calls = corrupt_first_call(t._engine.read, 2)  # (offsets, lengths, dest, dests)
        else:
            t._copy, calls = corrupt_first_call(t._copy, 2)
        np.testing.assert_array_equal(read(t, ids), expected[ids])
        # direct: the batch, then the one bad page again; mmap reads it again with pread
        assert len(calls) == (2 if tier == "direct" else 1)
        assert t.stats()["page_rereads"] == 1


def test_a_transient_bad_read_while_loading_is_read_again(v2_table, monkeypatch):
    from engram_offload.tiers import memory as memory_module

    path, expected = v2_table
    real, calls = memory_module._read_fully, []

    def flaky(fd, view, offset, where):
        real(fd, view, offset, where)
        if not calls:
            view[10] ^= 0x01
        calls.append(offset)

    monkeypatch.setattr(memory_module, "_read_fully", flaky)
    with open_quietly("memory", path) as t:
        np.testing.assert_array_equal(t.rows.numpy(), expected)
    # the first chunk, the re-read of its bad page, then nothing else of the first chunk again
    assert calls[1] == read_header(path).layout.data_offset and calls.count(calls[0]) == 2


def test_direct_reads_whole_pages(v2_table, tmp_path):
    path, _ = v2_table
    skip_unavailable("direct", {}, path.parent)
    with open_quietly("direct", path, engine="threads") as t:
        read(t, [0, 1, 200])  # two pages
        stats = t.stats()
        assert stats["reads"] == 2 and stats["bytes_read"] == 2 * 4096 and stats["pages_checked"] == 2
