"""The shared segment's scrubber: every page checked again in the background, by one process a segment.

A byte flipped in a loaded segment through a writable mapping, its mtime put back (as root, or
the operator's uid, can do; as a bit the hardware flips does), is found by the scrubber within a
pass; the segment is marked damaged and its name removed, and every attached reader refuses it
from then on, naming the segment and the page; the next open loads a fresh copy.
"""

from __future__ import annotations

import mmap
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from engram_offload.errors import TierError
from engram_offload.table import make_random_table, random_rows, read_header
from engram_offload.tiers import scrub
from engram_offload.tiers.segment_admin import list_segments
from engram_offload.tiers.segments import DAMAGED, DATA_OFFSET, mark_damaged, read_head, seal
from engram_offload.tiers.shared import SharedTier

from second_uid import in_child
from tier_cases import read
from tiny_tables import tiny_config

CONFIG = tiny_config("bf16", 80)  # 3,304 rows of 160 bytes, 25 a page: 133 pages
WAIT = 30.0  # the most any test waits for an event (it comes in well under a second)
AGAIN = "close the store and open the table again (a fresh open loads a new copy)"


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = make_random_table(tmp_path_factory.mktemp("scrub") / "t.table", CONFIG, seed=5)
    return path, np.concatenate(list(random_rows(CONFIG, 5)))


def flip(segment: Path, offset: int, reseal: bool = False) -> None:
    """Flip a byte of ``segment`` through a writable mapping, then put its mtime back (or, with
    ``reseal``, seal it again, as a mapping made before the seal leaves it): only the page
    checksums can tell."""
    before = segment.stat()
    segment.chmod(0o600)
    fd = os.open(segment, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as mm:
            mm[offset] ^= 0xFF
            os.fchmod(fd, 0o400)
            if reseal:
                seal(fd, mm)
    finally:
        os.close(fd)
    if not reseal:
        os.utime(segment, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert segment.stat().st_mtime_ns == before.st_mtime_ns


def the_elected(tiers: list[SharedTier]) -> SharedTier:
    """The one tier of ``tiers`` whose scrubber won the election (waited for, bounded)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        for tier in tiers:
            if tier.scrubber.elected.wait(0.01):
                return tier
    raise AssertionError("no scrubber was elected")


def test_a_flipped_byte_is_found_and_every_attached_reader_refuses_the_segment(table, shm_dir):
    path, expected = table
    header = read_header(path)
    row = 2345
    page = row // header.layout.rows_per_page
    with SharedTier(header, shm_dir=shm_dir, scrub_seconds=0.05) as first, \
            SharedTier(header, shm_dir=shm_dir, scrub_seconds=0.05, sample_pages=0) as second:
        assert first.loaded and not second.loaded
        scrubbing = the_elected([first, second])
        assert scrubbing.scrubber.wait_passes(1, WAIT)
        assert np.array_equal(read(second, [row, 7]), expected[[row, 7]])
        flip(first.segment, DATA_OFFSET + row * CONFIG.row_bytes + 5)
        assert scrubbing.scrubber.found.wait(WAIT)
        message = (f"the shared segment {first.segment} was found damaged by process {os.getpid()}'s check "
                   f"(data page {page} (rows {page * 25:,}..{page * 25 + 24:,}) differs from {path}): {AGAIN}")
        assert scrubbing.scrubber.problem == message
        for tier in (first, second):  # the changed row, and any other: never served from it again
            for rows in ([row], [7]):
                with pytest.raises(TierError) as caught:
                    read(tier, rows)
                assert str(caught.value) == message
        assert not first.segment.exists()  # the next open loads afresh
        fd = os.open(f"/proc/self/fd/{first._fd}", os.O_RDONLY)
        try:
            head = read_head(fd)
            assert head is not None and (head.state, head.pid, head.progress) == (DAMAGED, os.getpid(), page)
        finally:
            os.close(fd)
        other = second if scrubbing is first else first
        assert other.scrubber.found.wait(WAIT)  # the other process's scrubber sees the mark, and stops
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with SharedTier(header, shm_dir=shm_dir) as fresh:
                assert fresh.loaded and fresh.replaced is None
                assert np.array_equal(read(fresh, np.arange(fresh.num_rows)), expected)


def scrub_and_read(table: str, shm: str, rows: list[int]) -> str:
    """(In another process) attach trusting the seal, scrub until the changed page is found, then read ``rows``."""
    with SharedTier(read_header(table), shm_dir=shm, verify_attach=0, scrub_seconds=0.05) as tier:
        assert not tier.loaded and tier.scrubber.found.wait(WAIT)
        try:
            read(tier, rows)
        except TierError as exc:
            return str(exc)
        return "served"


def test_a_process_that_does_not_scrub_refuses_the_segment_another_found_damaged(table, shm_dir):
    path, _ = table
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir, scrub_seconds=None) as loader:
        flip(loader.segment, DATA_OFFSET + 3, reseal=True)  # data page 0
        status, answer = in_child(scrub_and_read, str(path), str(shm_dir), [3000], uid=None, timeout=60)
        assert status == "ok" and answer.startswith(f"the shared segment {loader.segment} was found damaged by "
                                                    "process "), answer
        assert "'s check (data page 0 (rows 0..24) differs from " in answer
        with pytest.raises(TierError) as caught:
            read(loader, [3000])
        assert str(caught.value) == answer


def test_one_process_scrubs_a_segment_and_another_takes_over_when_it_closes(table, shm_dir):
    header = read_header(table[0])
    tiers = [SharedTier(header, shm_dir=shm_dir, scrub_seconds=0.05) for _ in range(3)]
    try:
        elected = the_elected(tiers)
        assert elected.scrubber.wait_passes(3, WAIT)
        assert [t.scrubber.elected.is_set() for t in tiers].count(True) == 1
        assert [t.scrubber.pages_checked for t in tiers if t is not elected] == [0, 0]
        assert elected.stats()["scrub_passes"] >= 3 and elected.stats()["scrub_elected"]
        elected.close()
        tiers.remove(elected)
        successor = the_elected(tiers)
        assert successor.scrubber.wait_passes(1, WAIT)
    finally:
        for tier in tiers:
            tier.close()


def test_a_pass_is_paced_to_scrub_seconds_and_capped(table, shm_dir, monkeypatch):
    header = read_header(table[0])
    nbytes = header.layout.num_rows * header.layout.row_bytes
    with SharedTier(header, shm_dir=shm_dir, scrub_seconds=0.25) as tier:
        assert tier.scrubber.rate == nbytes / 0.25
        started = time.monotonic()
        assert tier.scrubber.wait_passes(2, WAIT)
        assert time.monotonic() - started >= 2 * 0.25 * 0.9  # the first chunk waits its turn too
        assert tier.scrubber.pages_checked >= 2 * header.layout.num_pages
    monkeypatch.setattr(scrub, "MAX_SCRUB_BYTES_PER_S", 1000)
    with SharedTier(header, shm_dir=shm_dir, scrub_seconds=0.25) as tier:
        assert tier.scrubber.rate == 1000
    with SharedTier(header, shm_dir=shm_dir, scrub_seconds=None) as tier:
        assert tier.scrubber is None and "scrub_passes" not in tier.stats()


def test_an_attach_that_replaces_a_changed_segment_marks_it_for_the_processes_still_on_it(table, shm_dir):
    path, expected = table
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir, scrub_seconds=None) as old:
        flip(old.segment, DATA_OFFSET + 1000 * CONFIG.row_bytes)
        with pytest.warns(RuntimeWarning, match=r"differs from the table at data page 40 \(rows 1,000..1,024\)"):
            new = SharedTier(header, shm_dir=shm_dir, verify_attach="full", scrub_seconds=None)
        with new:
            assert new.loaded and np.array_equal(read(new, [1000, 5]), expected[[1000, 5]])
        with pytest.raises(TierError, match=rf"found damaged by process {os.getpid()}'s check \(data page 40 "):
            read(old, [5])


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), True, "600"])
def test_scrub_seconds_is_a_positive_number_or_none(table, shm_dir, value):
    with pytest.raises(ValueError) as caught:
        SharedTier(read_header(table[0]), shm_dir=shm_dir, scrub_seconds=value)
    assert str(caught.value) == ("scrub_seconds must be a positive number of seconds (or None: no background "
                                 f"check), got {value!r}")



def test_a_segment_marked_damaged_is_listed_so_and_refused(table, shm_dir):
    path, _ = table
    with SharedTier(read_header(path), shm_dir=shm_dir, scrub_seconds=None) as tier:
        before = tier.segment.stat()
        mark_damaged(tier._fd, 3)
        after = tier.segment.stat()
        assert after.st_mode & 0o777 == 0o400 and after.st_mtime_ns != before.st_mtime_ns
        [entry] = list_segments(shm_dir)
        assert (entry.name, entry.state, entry.in_use) == (tier.segment.name, "damaged", True)
        with pytest.raises(TierError, match=rf"\(data page 3 \(rows 75..99\) differs from {path}\): close the store"):
            read(tier, [0])


def opened(path: str) -> int:
    """How many of this process's descriptors are open on ``path``."""
    return sum(os.path.realpath(f"/proc/self/fd/{fd}") == path for fd in os.listdir("/proc/self/fd"))


def test_a_forked_child_does_not_keep_the_scrubbers_lock(table, shm_dir):
    with SharedTier(read_header(table[0]), shm_dir=shm_dir, scrub_seconds=0.05) as tier:
        assert tier.scrubber.elected.wait(WAIT)
        lock = os.path.realpath(f"{tier.segment}.lock")
        assert opened(lock) == 1
        assert in_child(opened, lock, uid=None, timeout=60) == ("ok", 0)  # it would hold the election after us
    assert opened(lock) == 0
