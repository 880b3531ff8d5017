"""The pool's per-row checksums: the C helper and the xxhash fallback agree, and find every bad row."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from engram_offload.pool.layout import ROW_SUM_BYTES, rows_with_sums
from engram_offload.table import pagesum
from engram_offload.table.pagesum import bad_row_sums, row_sums


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


def test_bad_row_sums_finds_each_altered_row_or_sum(helper):
    rows = np.random.default_rng(1).integers(0, 256, (300, 264), dtype=np.uint8)
    packed = rows_with_sums(rows)
    stride = 264 + ROW_SUM_BYTES
    assert packed.shape == (300, stride) and np.array_equal(packed[:, :264], rows)
    assert bad_row_sums(packed, 264, stride).size == 0
    packed[0, 0] ^= 1  # a row byte
    packed[150, 263] ^= 0x80  # the row's last byte
    packed[299, 264 + 3] ^= 2  # a byte of the stored sum
    assert bad_row_sums(packed, 264, stride).tolist() == [0, 150, 299]


def test_a_buffer_of_partial_rows_is_refused(helper):
    with pytest.raises(ValueError, match="whole number of 268-byte strides"):
        bad_row_sums(bytes(268 * 2 + 1), 264, 268)
    with pytest.raises(ValueError, match="and 4 bytes after it"):
        bad_row_sums(bytes(266 * 2), 264, 266)
