"""The pool layout's stored header record: its version checks and the messages they give."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engram_offload.errors import TableFormatError
from engram_offload.pool.key import PoolKey
from engram_offload.pool.layout import (
    MAX_EXTENT_BYTES,
    POOL_LAYOUT_VERSION,
    PoolLayout,
    PoolLayoutError,
    bad_rows,
    header_from_record,
    layout_version_problem,
    stored_layout_version,
)
from engram_offload.table import make_random_table, read_header

from tiny_tables import tiny_config


@pytest.fixture(scope="module")
def playout(tmp_path_factory):
    path = make_random_table(tmp_path_factory.mktemp("layout") / "t.tbl", tiny_config("int8", 64), seed=4)
    return PoolLayout(read_header(path), 97)


def _with_version(record: bytes, version) -> bytes:
    meta = json.loads(record)
    meta["pool_layout"] = version
    return json.dumps(meta).encode()


@pytest.mark.parametrize("version", ["3", 3.0, None, [3]])
def test_a_version_that_is_not_an_integer_is_unreadable(playout, version):
    record = _with_version(playout.header_record(), version)
    assert stored_layout_version(record) is None
    with pytest.raises(TableFormatError, match="unreadable table header in the pool .no pool layout version"):
        header_from_record(record, "t")
    assert stored_layout_version(b"not json") is None and stored_layout_version(b"[]") is None
    assert stored_layout_version(playout.header_record()) == POOL_LAYOUT_VERSION


@pytest.mark.parametrize("version,why", [(0, ""), (1, " (rows without checksums)"),
                                         (2, " (row checksums not bound to the rows' places)"),
                                         (3, " (tables named by their block digests)"),
                                         (4, " (row checksums not keyed)"), (6, "")])
def test_another_layout_version_is_refused_with_the_fix(playout, version, why):
    expected = (f"pool table x was published with pool layout version {version}{why}; this engram-offload reads "
                f"version {POOL_LAYOUT_VERSION}: re-publish with engram-offload pool publish TABLE --pool URL "
                "(it replaces the old layout's keys)")
    assert layout_version_problem("pool table x", version) == expected
    record = _with_version(playout.header_record(), version)
    with pytest.raises(PoolLayoutError) as caught:
        header_from_record(record, "pool table x")
    assert str(caught.value) == expected
    header, rows = header_from_record(record, "pool table x", any_version=True)
    assert rows == 97 and header.layout.num_rows == playout.header.layout.num_rows
    assert header.path == Path(playout.fingerprint)  # a table opened from the pool is named by its fingerprint


@pytest.mark.parametrize("drop", ["table", "sums_digest", "extent_rows"])
def test_a_record_missing_a_field_is_unreadable(playout, drop):
    meta = json.loads(playout.header_record())
    del meta[drop]
    with pytest.raises(TableFormatError, match=f"^pool table x: unreadable table header in the pool .*'{drop}'"):
        header_from_record(json.dumps(meta).encode(), "pool table x")


def test_row_ids_and_rows_must_agree_in_number():
    with pytest.raises(ValueError, match="^3 rows to check against 2 row ids$"):
        bad_rows(bytes(3 * 16), 8, 16, "00", np.arange(2), PoolKey(None, bytes(32)))


def test_extents_cover_the_rows_in_order_each_97_rows_of_a_row_and_its_checksum(playout):
    starts, counts = playout.starts, playout.counts
    assert starts[0] == 0 and (starts[1:] == starts[:-1] + counts[:-1]).all()
    assert int(starts[-1] + counts[-1]) == playout.header.layout.num_rows
    assert playout.stride == playout.header.layout.row_bytes + 8 and int(counts[0]) == 97


def test_extent_rows_from_one_up_to_redis_string_limit(playout):
    header = playout.header
    assert PoolLayout(header, 1).counts.max() == 1
    with pytest.raises(ValueError, match="^extent_rows must be >= 1, got 0$"):
        PoolLayout(header, 0)
    most = MAX_EXTENT_BYTES // playout.stride  # extents of exactly 512 MiB or less
    assert PoolLayout(header, most).extent_rows == most
    if most * playout.stride == MAX_EXTENT_BYTES:
        PoolLayout(header, most)  # exactly at the limit
    with pytest.raises(ValueError, match=(rf"^extents of {most + 1:,} rows of {playout.stride} bytes \(with their "
                                          r"checksums\) exceed Redis's 512 MiB string limit: choose fewer extent rows$")):
        PoolLayout(header, most + 1)
