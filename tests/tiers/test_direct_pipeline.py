"""The direct tier's pipelined native read: chunks on two lanes give the rows, the counts and
the errors (a bad page, a short read, a closed tier) of the one-call read."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from engram_offload.errors import ChecksumError, TierError
from engram_offload.table import make_random_table, read_header
from engram_offload.tiers import open_tier

from test_page_checks import flip
from tier_cases import read, skip_unavailable
from tiny_tables import tiny_config

CHUNK = 16  # rows a chunk: many chunks on both lanes in a small table


@pytest.fixture(scope="module")
def v2_table(tmp_path_factory):
    path = make_random_table(tmp_path_factory.mktemp("pipeline") / "t.tbl", tiny_config(), seed=3, block_size=16384)
    with open_tier("memory", read_header(path)) as t:
        return path, t.rows.numpy().copy()


@pytest.fixture()
def table_copy(v2_table, tmp_path):
    path = tmp_path / "copy.tbl"
    shutil.copy(v2_table[0], path)
    skip_unavailable("direct", {"engine": "uring"}, tmp_path)
    return path, v2_table[1]


def direct(path, pipeline_rows: int):
    return open_tier("direct", read_header(path), engine="uring", queue_depth=8, pipeline_rows=pipeline_rows)


def batches(num_rows: int, rpp: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [np.unique(rng.integers(0, num_rows, 500)),  # sorted distinct, as a store asks
            np.sort(rng.integers(0, num_rows, 700)),  # ascending, repeats
            np.arange(0, 10 * rpp)]  # whole pages: cuts must move to page ends


def test_the_pipelined_read_gives_the_rows_and_counts_of_one_call(table_copy):
    path, expected = table_copy
    layout = read_header(path).layout
    with direct(path, CHUNK) as piped, direct(path, 0) as plain:
        assert piped._lanes is not None and plain._lanes is None
        for ids in batches(layout.num_rows, layout.rows_per_page):
            assert piped._chunks(ids) is not None and len(piped._chunks(ids)) > 3  # several chunks, two lanes
            np.testing.assert_array_equal(read(piped, ids), expected[ids])
            np.testing.assert_array_equal(read(plain, ids), expected[ids])
        a, b = piped.stats(), plain.stats()
        assert a["rows"] == b["rows"] and a["pages_checked"] == b["pages_checked"] and a["reads"] == b["reads"]
        unsorted = np.random.default_rng(6).integers(0, layout.num_rows, 700)
        assert piped._chunks(unsorted) is None  # any order: one call (chunks would share pages)
        np.testing.assert_array_equal(read(piped, unsorted), expected[unsorted])


def test_chunks_end_at_page_boundaries():
    class Fake:
        pipeline_rows, _lanes = 4, object()

        class layout:  # noqa: N801 - stands for a TableLayout
            rows_per_page = 3

    from engram_offload.tiers.direct import DirectTier

    ids = np.arange(20)
    cuts = DirectTier._chunks(Fake(), ids)  # type: ignore[arg-type]
    assert cuts[0] == 0 and cuts[-1] == 20
    assert all(ids[c] // 3 != ids[c - 1] // 3 for c in cuts[1:-1])  # no page split between lanes
    assert DirectTier._chunks(Fake(), np.arange(8)) is None  # at most two chunks: one call


@pytest.mark.parametrize("where", ["first lane", "second lane"])
def test_a_bad_page_raises_as_in_one_call(table_copy, where):
    path, _ = table_copy
    layout = read_header(path).layout
    rpp = layout.rows_per_page
    ids = np.arange(12 * rpp)  # every row of pages 0..11: a chunk is one page (cut at page ends)
    page = 2 if where == "first lane" else 5  # even chunks: the caller's lane; odd: the helper's
    flip(path, layout.data_offset + page * layout.page_bytes + 7)
    messages = []
    for pipeline_rows in (CHUNK, 0):
        with direct(path, pipeline_rows) as t:
            if pipeline_rows:
                cuts = t._chunks(ids)
                assert cuts is not None
                k = next(k for k in range(len(cuts) - 1) if cuts[k] <= page * rpp < cuts[k + 1])
                assert k % 2 == (0 if where == "first lane" else 1)
            with pytest.raises(ChecksumError) as info:
                read(t, ids)
            messages.append(str(info.value))
            assert read(t, [3 * rpp]).shape == (1, layout.row_bytes)  # still usable
    assert messages[0] == messages[1] and f"data page {page} " in messages[0]


def test_a_short_read_raises_as_in_one_call(table_copy):
    path, expected = table_copy
    header = read_header(path)
    layout = header.layout
    ids = np.arange(11 * layout.rows_per_page)  # pages 0..10; page 10 alone is past the end below
    with open_tier("direct", header, engine="uring", queue_depth=8, pipeline_rows=CHUNK) as piped, \
            open_tier("direct", header, engine="uring", queue_depth=8, pipeline_rows=0) as plain:
        assert piped._chunks(ids) is not None
        os.truncate(path, layout.data_offset + 10 * layout.page_bytes)
        messages = []
        for t in (piped, plain):
            with pytest.raises(TierError) as info:
                read(t, ids)
            messages.append(str(info.value))
            np.testing.assert_array_equal(read(t, [5]), expected[[5]])  # the rings are still usable
    assert messages[0] == messages[1]
    assert "end of file" in messages[0] and f"{layout.data_offset + 10 * layout.page_bytes}" in messages[0]


def test_a_closed_tier_refuses_as_before(table_copy):
    path, _ = table_copy
    messages = []
    for pipeline_rows in (CHUNK, 0):
        t = direct(path, pipeline_rows)
        t.close()
        with pytest.raises(ValueError) as info:
            read(t, np.arange(200))
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "closed" in messages[0]


def test_pipelining_is_off_by_default(table_copy):
    path, _ = table_copy
    with open_tier("direct", read_header(path), engine="uring") as t:
        assert t.pipeline_rows == 0 and t._lanes is None and t._chunks(np.arange(5000)) is None
