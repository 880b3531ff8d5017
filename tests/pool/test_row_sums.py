"""The pool's per-row checksums: MACs under the operator's key, as documented, that fail for
every altered, misplaced or foreign row."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from engram_offload.pool.key import CHUNK_ROWS, PoolKey, _aes_ecb
from engram_offload.pool.layout import ROW_SUM_BYTES, bad_rows, rows_with_sums

KEY = PoolKey(None, bytes(range(32)))


def test_the_cipher_is_aes_128():
    """FIPS-197's example vector (appendix C.1)."""
    block = np.frombuffer(bytes.fromhex("00112233445566778899aabbccddeeff"), np.uint8).copy()
    _aes_ecb(bytes(range(16)), block)
    assert block.tobytes().hex() == "69c4e0d86a7b0430d8cdb78070b4c55a"


def _documented_tag(key: PoolKey, row: bytes, fp: str, row_id: int) -> int:
    """The MAC as docs/pool.md describes it, one block at a time."""
    def derive(purpose: bytes, size: int = 16) -> bytes:
        return hashlib.blake2b(purpose, key=key.secret, digest_size=size, person=b"engram-pool").digest()

    padded = row + bytes(-len(row) % 16)
    message = int(fp, 16).to_bytes(8, "little") + row_id.to_bytes(8, "little") + padded
    masks = hashlib.shake_256(b"engram-pool masks" + len(row).to_bytes(8, "little") + key.secret).digest(len(message))
    total = 0
    for at in range(0, len(message), 16):
        block = np.frombuffer(bytes(a ^ b for a, b in zip(message[at: at + 16], masks[at: at + 16])), np.uint8).copy()
        _aes_ecb(derive(b"blocks"), block)
        total += int.from_bytes(block[:8], "little") + int.from_bytes(block[8:], "little")
    final = np.frombuffer((total % (1 << 64)).to_bytes(8, "little") + bytes(8), np.uint8).copy()
    _aes_ecb(derive(b"final"), final)
    return int.from_bytes(final[:8], "little")


@pytest.mark.parametrize("row_bytes", [1, 16, 68, 264])
def test_row_tags_are_the_documented_mac(row_bytes):
    """The MAC is part of the pool's format (a pool written by one version is read by another)."""
    rows = np.random.default_rng(row_bytes).integers(0, 256, (9, row_bytes), dtype=np.uint8)
    fp, ids = "c993ba57e528765a", np.array([0, 1, 97, 12345, 1 << 31, (1 << 40) + 3, 7, 8, (1 << 63) - 1])
    tags = KEY.row_tags(rows, row_bytes, row_bytes, fp, ids)
    assert tags.dtype == np.uint64
    assert tags.tolist() == [_documented_tag(KEY, r.tobytes(), fp, int(i)) for r, i in zip(rows, ids)]


def test_row_tags_of_many_rows_are_those_of_each_row():
    rows = np.random.default_rng(5).integers(0, 256, (CHUNK_ROWS + 5, 24), dtype=np.uint8)
    ids = np.arange(len(rows)) * 3
    tags = KEY.row_tags(rows, 24, 24, "00000000000000ff", ids)
    for i in (0, 1, CHUNK_ROWS - 1, CHUNK_ROWS, len(rows) - 1):
        assert tags[i] == KEY.row_tags(rows[i: i + 1], 24, 24, "00000000000000ff", ids[i: i + 1])[0]


def test_bad_rows_finds_each_altered_row_or_sum():
    rows = np.random.default_rng(1).integers(0, 256, (300, 264), dtype=np.uint8)
    fp, ids = "5f3a09c2e1d4b7a8", np.arange(1000, 1300)
    packed = rows_with_sums(rows, fp, ids, KEY)
    stride = 264 + ROW_SUM_BYTES
    assert packed.shape == (300, stride) and np.array_equal(packed[:, :264], rows)
    assert bad_rows(packed, 264, stride, fp, ids, KEY).size == 0
    packed[0, 0] ^= 1  # a row byte
    packed[150, 263] ^= 0x80  # the row's last byte
    packed[299, 264 + 7] ^= 2  # a byte of the stored MAC
    assert bad_rows(packed, 264, stride, fp, ids, KEY).tolist() == [0, 150, 299]


def test_a_row_holds_its_checksum_only_at_its_own_place_in_its_own_table_under_its_key():
    """The MAC binds the row id, the table and the key: a row moved with its MAC, an extent
    read as another of the same length, another table's rows under this table's key, rows
    whose MACs were computed with another key all fail."""
    rows = np.random.default_rng(2).integers(0, 256, (200, 68), dtype=np.uint8)
    fp, ids = "00000000000000ff", np.arange(200)
    packed = rows_with_sums(rows, fp, ids, KEY)
    assert bad_rows(packed, 68, 76, fp, ids, KEY).size == 0
    moved = packed.copy()
    moved[7] = packed[3]  # row 3 and its MAC written over row 7
    assert bad_rows(moved, 68, 76, fp, ids, KEY).tolist() == [7]
    assert bad_rows(packed, 68, 76, fp, ids + 200, KEY).size == 200  # the same bytes as another extent's rows
    assert bad_rows(packed, 68, 76, "00000000000000fe", ids, KEY).size == 200  # as another table's
    assert bad_rows(np.roll(packed, 1, axis=0), 68, 76, fp, ids, KEY).size == 200
    other = PoolKey(None, bytes(31) + b"\x01")
    assert bad_rows(rows_with_sums(rows, fp, ids, other), 68, 76, fp, ids, KEY).size == 200  # another key's
    same_bytes = rows_with_sums(rows[:, :64], fp, ids, KEY)  # a shorter row's MAC over the same first bytes
    assert not np.array_equal(same_bytes[:, 64:], packed[:, 68:])


def test_a_buffer_of_partial_rows_is_refused():
    with pytest.raises(ValueError, match="whole number of 270-byte strides holding a 264-byte row and its checksum"):
        bad_rows(bytes(270 * 2), 264, 270, "00", np.arange(2), KEY)
