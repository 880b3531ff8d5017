"""The pool's per-row checksums: the C helper and the xxhash fallback agree, and find every bad row."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from engram_offload.pool.layout import ROW_SUM_BYTES, bad_rows, row_keys, rows_with_sums
from engram_offload.table import pagesum
from engram_offload.table.pagesum import row_sums


@pytest.fixture(params=["native", "xxhash"])
def helper(request, monkeypatch):
    if request.param == "native":
        if not pagesum.native_available():
            pytest.skip("the _pagesum helper is not built")
    else:
        monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "1")
    return request.param


@pytest.mark.parametrize("row_bytes", [1, 68, 264, 4400])
def test_row_sums_are_the_low_half_of_xxh3_of_each_row(helper, row_bytes):
    rows = np.random.default_rng(row_bytes).integers(0, 256, (37, row_bytes + 9), dtype=np.uint8)
    want = [xxhash.xxh3_64_intdigest(r[:row_bytes].tobytes()) & 0xFFFFFFFF for r in rows]
    assert row_sums(rows, row_bytes, row_bytes + 9).tolist() == want


def test_bad_rows_finds_each_altered_row_or_sum(helper):
    rows = np.random.default_rng(1).integers(0, 256, (300, 264), dtype=np.uint8)
    fp, ids = "5f3a09c2e1d4b7a8", np.arange(1000, 1300)
    packed = rows_with_sums(rows, fp, ids)
    stride = 264 + ROW_SUM_BYTES
    assert packed.shape == (300, stride) and np.array_equal(packed[:, :264], rows)
    assert bad_rows(packed, 264, stride, fp, ids).size == 0
    packed[0, 0] ^= 1  # a row byte
    packed[150, 263] ^= 0x80  # the row's last byte
    packed[299, 264 + 3] ^= 2  # a byte of the stored sum
    assert bad_rows(packed, 264, stride, fp, ids).tolist() == [0, 150, 299]


def test_a_row_holds_its_checksum_only_at_its_own_place_in_its_own_table(helper):
    """The checksum binds the row id and the table: a row moved with its checksum, an extent
    read as another of the same length, another table's rows under this table's key all fail."""
    rows = np.random.default_rng(2).integers(0, 256, (200, 68), dtype=np.uint8)
    fp, ids = "00000000000000ff", np.arange(200)
    packed = rows_with_sums(rows, fp, ids)
    assert bad_rows(packed, 68, 72, fp, ids).size == 0
    moved = packed.copy()
    moved[7] = packed[3]  # row 3 and its checksum written over row 7
    assert bad_rows(moved, 68, 72, fp, ids).tolist() == [7]
    assert bad_rows(packed, 68, 72, fp, ids + 200).size == 200  # the same bytes as another extent's rows
    assert bad_rows(packed, 68, 72, "00000000000000fe", ids).size == 200  # as another table's
    assert bad_rows(np.roll(packed, 1, axis=0), 68, 72, fp, ids).size == 200
    assert np.unique(row_keys(fp, np.arange(1 << 16))).size > (1 << 16) - 5  # distinct keys


def test_a_buffer_of_partial_rows_is_refused(helper):
    with pytest.raises(ValueError, match="whole number of 268-byte strides holding a 264-byte row"):
        row_sums(bytes(268 * 2 + 1), 264, 268)
    with pytest.raises(ValueError, match="cannot hold a 264-byte row and its checksum"):
        bad_rows(bytes(266 * 2), 264, 266, "00", np.arange(2))
