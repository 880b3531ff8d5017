"""Page checksums (the native helper against the xxhash package), the layout and trailer,
``verify`` naming a bad page, and the ``upgrade`` command refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from engram_offload import cli
from engram_offload.errors import ChecksumError, TableFormatError
from engram_offload.table import make_random_table, pagesum, read_header, verify_table

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
def test_the_trailer_holds_one_checksum_per_data_page(tmp_path, fmt, head_dim):
    path = make_random_table(tmp_path / "t.tbl", tiny_config(fmt, head_dim), seed=3)
    header = read_header(path)
    layout = header.layout
    assert layout.header_dict()["version"] == 3 and layout.page_sums_bytes == 4 * layout.num_pages
    data = path.read_bytes()[layout.data_offset:layout.trailer_offset]
    assert header.page_sums.tolist() == reference_sums(data, layout.page_bytes)
    assert layout.file_bytes == os.path.getsize(path)
    first, last = layout.page_rows(layout.num_pages - 1)
    assert last == layout.num_rows - 1 and first == (layout.num_pages - 1) * layout.rows_per_page


def test_verify_names_a_bad_page_and_a_damaged_page_trailer_fails_at_open(tmp_path):
    path = make_random_table(tmp_path / "t.tbl", tiny_config(), seed=3)
    layout = read_header(path).layout
    data = bytearray(path.read_bytes())
    damaged = tmp_path / "trailer.tbl"
    flipped = bytearray(data)
    flipped[layout.trailer_offset + 4 * 3] ^= 0x01  # the checksum of page 3
    damaged.write_bytes(bytes(flipped))
    with pytest.raises(TableFormatError, match="trailer is damaged"):
        read_header(damaged)
    data[layout.data_offset + 5 * layout.page_bytes + 9] ^= 0x04
    path.write_bytes(bytes(data))
    first, last = layout.page_rows(5)
    with pytest.raises(ChecksumError, match=rf"data page 5 \(rows {first:,}\.\.{last:,}\) does not match its checksum;"):
        verify_table(path)


def test_upgrade_is_refused_naming_convert(tmp_path, capsys):
    path = make_random_table(tmp_path / "t.tbl", tiny_config(), seed=4)
    before = path.read_bytes()
    assert cli.main(["upgrade", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "upgrade was removed" in err and "rewrite an older table with engram-offload convert" in err
    assert path.read_bytes() == before
