"""Format version 2: page checksums (the native helper against the xxhash package), the
layout and trailer, ``verify`` naming a bad page, and ``upgrade`` from version 1."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import xxhash

from engram_offload import cli
from engram_offload.errors import ChecksumError, TableFormatError
from engram_offload.table import make_random_table, pagesum, random_rows, read_header, verify_table
from engram_offload.table.upgrade import upgrade_table
from engram_offload.tiers import open_tier

from tiny_tables import tiny_config


def reference_sums(data: bytes, page: int) -> list[int]:
    return [xxhash.xxh3_64_intdigest(data[i:i + page]) & 0xFFFFFFFF for i in range(0, len(data), page)]


@pytest.mark.parametrize("page", [4096, 8192])
def test_page_sums_are_the_low_half_of_xxh3_natively_and_without_the_helper(page, monkeypatch):
    data = np.random.default_rng(page).integers(0, 256, 37 * page, dtype=np.uint8)
    want = reference_sums(data.tobytes(), page)
    assert pagesum.page_sums(data, page).tolist() == want
    assert pagesum.page_sums(data, page, portable=True).tolist() == want
    monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    assert not pagesum.native_available()
    assert pagesum.page_sums(data, page).tolist() == want
    with pytest.raises(ValueError, match="whole number of 4096-byte pages"):
        pagesum.page_sums(data[:100], 4096)


@pytest.mark.parametrize("fmt,head_dim", [("fp8_e4m3_ue8m0", 64), ("fp32", 1100)])
def test_version_2_trailer_holds_one_checksum_per_data_page(tmp_path, fmt, head_dim):
    path = make_random_table(tmp_path / "t.tbl", tiny_config(fmt, head_dim), seed=3, block_size=8192)
    header = read_header(path)
    layout = header.layout
    assert layout.version == 2 and layout.page_sums_bytes == 4 * layout.num_pages
    data = path.read_bytes()[layout.data_offset:layout.trailer_offset]
    assert header.page_sums.tolist() == reference_sums(data, layout.page_bytes)
    assert layout.file_bytes == os.path.getsize(path)
    first, last = layout.page_rows(layout.num_pages - 1)
    assert last == layout.num_rows - 1 and first == (layout.num_pages - 1) * layout.rows_per_page


def test_verify_names_a_bad_page_and_a_damaged_page_trailer_fails_at_open(tmp_path):
    path = make_random_table(tmp_path / "t.tbl", tiny_config(), seed=3, block_size=8192)
    layout = read_header(path).layout
    data = bytearray(path.read_bytes())
    damaged = tmp_path / "trailer.tbl"
    flipped = bytearray(data)
    flipped[layout.trailer_offset + 4 * 3] ^= 0x01  # the checksum of page 3
    damaged.write_bytes(bytes(flipped))
    with pytest.raises(TableFormatError, match="trailer is damaged"):
        read_header(damaged)
    # A flip that leaves the block checksums intact cannot exist; verify reports the block first.
    data[layout.data_offset + 5 * layout.page_bytes + 9] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"block 2 "):
        verify_table(path)


def test_upgrade_rewrites_a_version_1_table_with_the_same_rows(tmp_path, capsys):
    config = tiny_config("bf16", 80)
    path = make_random_table(tmp_path / "t.tbl", config, seed=4, block_size=8192, version=1)
    expected = np.concatenate(list(random_rows(config, 4)))
    old = read_header(path)
    assert old.layout.version == 1
    assert cli.main(["upgrade", str(path), "--no-progress"]) == 0
    assert "upgraded from format version 1 to 2" in capsys.readouterr().out
    new = read_header(path)
    assert new.layout.version == 2 and new.page_sums is not None
    assert new.config == old.config and new.layout.block_size == old.layout.block_size
    verify_table(path)
    with open_tier("memory", new) as t:
        np.testing.assert_array_equal(t.rows.numpy(), expected)
        assert t.stats()["verified_on_load"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["t.tbl"]  # no temporary file left
    assert cli.main(["upgrade", str(path)]) == 0
    assert "already format version 2; nothing to do" in capsys.readouterr().out


def test_upgrade_refuses_a_damaged_version_1_table_and_leaves_it_as_it_was(tmp_path):
    path = make_random_table(tmp_path / "t.tbl", tiny_config(), seed=4, block_size=8192, version=1)
    layout = read_header(path).layout
    data = bytearray(path.read_bytes())
    data[layout.data_offset + 3 * 8192 + 17] ^= 0x01  # block 3
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="block 3 "):
        upgrade_table(path, progress=False)
    assert path.read_bytes() == bytes(data) and read_header(path).layout.version == 1
    assert [p.name for p in tmp_path.iterdir()] == ["t.tbl"]
    copy = tmp_path / "copy.tbl"
    shutil.copy(path, copy)
    assert cli.main(["upgrade", str(copy)]) == 1
