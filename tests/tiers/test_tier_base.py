"""The tier interface every tier shares (tiers/base.py): row-id checks, the output check,
counting, closing, and what a tier says about itself; on the real memory tier."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engram_offload.table import read_header
from engram_offload.tiers import as_row_ids, open_tier

from tier_cases import read


def close_within(tier, seconds: float = 5.0) -> None:
    """Close ``tier``, failing (not hanging) when close does not return within ``seconds``."""
    closer = threading.Thread(target=tier.close, daemon=True)
    closer.start()
    closer.join(seconds)
    assert not closer.is_alive(), f"close() did not return within {seconds} s"


def test_row_ids_in_every_accepted_form():
    assert as_row_ids(torch.tensor([[3, 1], [2, 0]]), 10).tolist() == [3, 1, 2, 0]  # flattened
    strided = np.arange(20)[::3]
    got = as_row_ids(strided, 20)
    assert got.tolist() == list(range(0, 20, 3)) and got.dtype == np.int64 and got.flags.c_contiguous
    assert as_row_ids(np.array([7, 9], np.uint32), 10).dtype == np.int64
    empty = as_row_ids([], 10)  # an empty list is float64 to NumPy: still no ids
    assert empty.dtype == np.int64 and empty.shape == (0,)
    assert as_row_ids(np.zeros((0, 3), np.int32), 10).shape == (0,)
    with pytest.raises(TypeError, match=r"^row ids must be integers, got dtype float64$"):
        as_row_ids([1.0, 2.0], 10)
    with pytest.raises(IndexError, match=r"^row id 1000 \(at position 1\) is out of range: the table has "
                                         r"1,000 rows \(ids 0\.\.999\)$"):
        as_row_ids([5, 1000, -1], 1000)


def test_sorted_distinct_ids():
    assert as_row_ids([4], 10, sorted_distinct=True).tolist() == [4]
    assert as_row_ids([0, 9], 10, sorted_distinct=True).tolist() == [0, 9]
    assert as_row_ids([], 10, sorted_distinct=True).tolist() == []
    for unsorted in ([3, 3], [5, 4], [0, 2, 1]):
        with pytest.raises(ValueError, match=r"^row ids must be sorted distinct ids \(strictly increasing\): "
                                             r"pass dedup\(ids\).unique$"):
            as_row_ids(unsorted, 10, sorted_distinct=True)
        assert as_row_ids(unsorted, 10).tolist() == unsorted  # without the flag, any order
    with pytest.raises(IndexError, match=r"^row id 10 \(at position 1\)"):  # range first, then order
        as_row_ids([5, 10, 2], 10, sorted_distinct=True)
    assert as_row_ids(np.zeros(0, np.int64), 10, sorted_distinct=True).shape == (0,)
    # sorted ids are range-checked by their ends: one past the end, or below 0, is still refused
    with pytest.raises(IndexError, match=r"^row id 10 \(at position 2\) is out of range"):
        as_row_ids([0, 5, 10], 10, sorted_distinct=True)
    with pytest.raises(IndexError, match=r"^row id -1 \(at position 0\) is out of range"):
        as_row_ids([-1, 5, 9], 10, sorted_distinct=True)


@pytest.fixture
def memory_tier(tables):
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    tier = open_tier("memory", read_header(path))
    yield tier, expected
    close_within(tier)


def test_reads_are_counted(memory_tier):
    tier, expected = memory_tier
    fresh = tier.stats()
    assert fresh["tier"] == "memory"
    assert [fresh[k] for k in ("requests", "rows", "reads", "bytes_read", "retries", "pages_checked",
                               "page_rereads")] == [0] * 7
    np.testing.assert_array_equal(read(tier, [5, 0, 5]), expected[[5, 0, 5]])
    out = torch.empty((0, tier.row_bytes), dtype=torch.uint8)
    assert tier.read_rows(np.zeros(0, np.int64), out) is out  # no rows: nothing read, still a request
    stats = tier.stats()
    assert (stats["requests"], stats["rows"], stats["bytes_read"]) == (2, 3, 3 * tier.row_bytes)
    assert set(stats) >= {"tier", "requests", "rows", "reads", "bytes_read", "retries", "pages_checked",
                          "page_rereads"}


def test_the_output_buffer_is_checked(memory_tier):
    tier, _ = memory_tier
    rb = tier.row_bytes
    for out in (torch.empty((2, rb), dtype=torch.int8), torch.empty((3, rb), dtype=torch.uint8),
                torch.empty((2, rb + 1), dtype=torch.uint8), torch.empty(2 * rb, dtype=torch.uint8)):
        with pytest.raises(ValueError, match=rf"^out must be uint8 \[2, {rb}\], got {out.dtype} "
                                             rf"{tuple(out.shape)}".replace("(", r"\(").replace(")", r"\)") + "$"):
            tier.read_rows(np.array([0, 1]), out)
    assert tier.stats()["requests"] == 0  # refused reads are not counted


def test_close_refuses_new_reads_and_is_idempotent(tables):
    path, expected = tables[("fp32", 64)]
    header = read_header(path)
    tier = open_tier("memory", header)
    assert repr(tier) == f"MemoryTier({str(path)!r}, rows={header.layout.num_rows:,})"
    assert tier.num_rows == header.layout.num_rows and tier.row_bytes == 256
    np.testing.assert_array_equal(read(tier, [1]), expected[[1]])
    close_within(tier)
    assert tier.closed
    close_within(tier)  # again: nothing happens
    with pytest.raises(ValueError, match=rf"^the memory tier of {path} is closed$"):
        read(tier, [1])
    with pytest.raises(ValueError, match=r"is closed$"):
        read(tier, [])  # even a read of nothing


def test_close_waits_for_a_read_in_flight(tables):
    """close() returns only after the read using the medium has finished with it."""
    path, expected = tables[("fp32", 64)]
    tier = open_tier("memory", read_header(path))
    inside, release, order = threading.Event(), threading.Event(), []
    real_read = tier._read

    def slow_read(ids, out):
        inside.set()
        release.wait(10)
        real_read(ids, out)
        order.append("read done")

    tier._read = slow_read
    got = []
    reader = threading.Thread(target=lambda: got.append(read(tier, [2, 3])), daemon=True)
    reader.start()
    assert inside.wait(10)
    closer = threading.Thread(target=lambda: (tier.close(), order.append("closed")), daemon=True)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close returned while a read was in flight"
    release.set()
    reader.join(10)
    closer.join(10)
    assert order == ["read done", "closed"]
    np.testing.assert_array_equal(got[0], expected[[2, 3]])
    # a second reader after close, and a second close, do not wait for anything
    with pytest.raises(ValueError, match="is closed"):
        read(tier, [0])


def test_a_tier_closes_as_a_context_manager(tables):
    path, _ = tables[("fp32", 64)]
    tier = open_tier("memory", read_header(path))
    exited = threading.Event()

    def use():
        with tier:
            read(tier, [0])
        exited.set()

    threading.Thread(target=use, daemon=True).start()
    assert exited.wait(5), "leaving the with block did not close the tier in time"
    assert tier.closed
