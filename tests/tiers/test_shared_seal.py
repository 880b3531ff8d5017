"""The shared segment's seal: checked once by its loader, then a sample of pages at each attach.

A loader seals the segment it checked (``segments.seal``): the head bound to the file's owner,
device, inode and ctime. A later process whose file still matches checks ``verify_attach``
pages spread over the table instead of every page; a copy, a file made again or one changed
since (its ctime moved) has every page checked, as ``verify_attach="full"`` asks for.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engram_offload.table import make_random_table, random_rows, read_header
from engram_offload.tiers import segments, shared
from engram_offload.tiers.segments import DATA_OFFSET, MAGIC, READY, VERSION, seal, seal_problem, uid_folder
from engram_offload.tiers.shared import DEFAULT_ATTACH_PAGES, SharedTier, segment_name

from second_uid import in_child
from tier_cases import read
from tiny_tables import tiny_config

CONFIG = tiny_config("bf16", 80)  # 3,304 rows of 160 bytes, 25 a page: 133 pages


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = make_random_table(tmp_path_factory.mktemp("seal") / "t.table", CONFIG, seed=4)
    return path, np.concatenate(list(random_rows(CONFIG, 4)))


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Warnings are errors: an attach that replaces the segment fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def attach(table: str, shm: str, options: dict, expected: np.ndarray) -> dict:
    """(In another process) open ``table`` on the shared tier: its stats, and whether it read the rows."""
    with SharedTier(read_header(table), shm_dir=shm, **options) as tier:
        stats = tier.stats()
        return {key: stats[key] for key in ("loaded_here", "replaced", "attach_check", "attach_pages_checked")} | {
            "rows": np.array_equal(read(tier, np.arange(tier.num_rows)), expected)}


def loaded(path: Path, shm_dir: Path) -> Path:
    """Load ``path``'s segment in this process (checked, sealed); the segment's path."""
    with SharedTier(read_header(path), shm_dir=shm_dir) as tier:
        assert tier.loaded and tier.stats()["attach_check"] == "loaded"
        return tier.segment


def problem(segment: Path) -> str | None:
    fd = os.open(segment, os.O_RDONLY)
    try:
        return seal_problem(fd, os.fstat(fd))
    finally:
        os.close(fd)


def test_a_fresh_load_seals_and_another_process_checks_a_sample_or_every_page_when_asked(table, shm_dir):
    path, expected = table
    segment = loaded(path, shm_dir)
    assert problem(segment) is None
    pages = read_header(path).layout.num_pages
    assert DEFAULT_ATTACH_PAGES < pages
    for options, check, checked in [({}, "sample", DEFAULT_ATTACH_PAGES), ({"verify_attach": 5}, "sample", 5),
                                    ({"verify_attach": 0}, "sample", 0), ({"verify_attach": 500}, "sample", pages),
                                    ({"verify_attach": "full"}, "full: asked for", pages)]:
        status, answer = in_child(attach, str(path), str(shm_dir), options, expected, uid=None, timeout=60)
        assert status == "ok", answer
        assert answer == {"loaded_here": False, "replaced": None, "attach_check": check,
                          "attach_pages_checked": checked, "rows": True}, options
    assert problem(segment) is None  # attaching changed nothing


def test_the_sample_takes_one_page_in_each_of_as_many_equal_stretches(table, shm_dir, monkeypatch):
    path, _ = table
    loaded(path, shm_dir)
    seen: list[np.ndarray] = []
    checked = shared.bad_pages

    def recording(header, pages, data):
        seen.append(pages.copy())
        return checked(header, pages, data)

    monkeypatch.setattr(shared, "bad_pages", recording)
    n = read_header(path).layout.num_pages
    for _ in range(3):
        with quiet(), SharedTier(read_header(path), shm_dir=shm_dir, verify_attach=10) as tier:
            assert tier.attach_check == "sample" and tier.attach_pages_checked == 10
        pages = np.concatenate(seen)
        seen.clear()
        edges = np.linspace(0, n, 11).astype(np.int64)
        assert np.array_equal(np.searchsorted(edges, pages, side="right") - 1, np.arange(10)), pages


def recopy(segment: Path) -> None:
    """Replace ``segment`` by a copy of its bytes (the seal with them), read-only as it was."""
    copy = segment.with_name(".copy")
    shutil.copyfile(segment, copy)
    copy.chmod(0o400)
    os.replace(copy, segment)


def touch(segment: Path) -> None:
    """Set the segment's times to what they are: only its ctime moves."""
    before = segment.stat()
    os.utime(segment, ns=(before.st_atime_ns, before.st_mtime_ns))


def linked(segment: Path) -> None:
    os.link(segment, segment.with_name("again"))


def renamed_away_and_back(segment: Path) -> None:
    os.rename(segment, segment.with_name("away"))
    os.rename(segment.with_name("away"), segment)


@pytest.mark.parametrize("change, why", [
    (recopy, "was sealed as another file (uid 0, device "),
    (touch, "was changed after it was sealed (its ctime moved)"),
    (linked, "was changed after it was sealed (its ctime moved)"),
    (renamed_away_and_back, "was changed after it was sealed (its ctime moved)"),
])
def test_a_copy_or_a_segment_changed_since_it_was_sealed_has_every_page_checked(table, shm_dir, change, why):
    path, expected = table
    segment = loaded(path, shm_dir)
    change(segment)
    assert why.replace("uid 0", f"uid {os.geteuid()}") in problem(segment)
    with quiet(), SharedTier(read_header(path), shm_dir=shm_dir) as tier:
        assert not tier.loaded and tier.replaced is None
        assert tier.attach_check.startswith("full: " + why.split(" (uid")[0])
        assert tier.attach_pages_checked == tier.layout.num_pages
        assert np.array_equal(read(tier, np.arange(tier.num_rows)), expected)


def test_a_segment_whose_loader_ended_before_sealing_it_has_every_page_checked(table, shm_dir, monkeypatch):
    path, _ = table
    monkeypatch.setattr(shared, "seal", lambda fd, mm: None)
    segment = loaded(path, shm_dir)
    monkeypatch.undo()
    assert problem(segment) == "is not sealed (its loader did not finish sealing it)"
    with quiet(), SharedTier(read_header(path), shm_dir=shm_dir) as tier:
        assert tier.attach_check == "full: is not sealed (its loader did not finish sealing it)"
        assert tier.attach_pages_checked == tier.layout.num_pages


@contextlib.contextmanager
def mapped_before_the_seal(segment: Path, offsets: list[int]) -> Iterator[mmap.mmap]:
    """A writable mapping of ``segment`` with the pages at ``offsets`` faulted in, then the
    segment sealed again: writes through it move no ctime, as through a mapping made before
    the seal (or a bit the hardware flips)."""
    segment.chmod(0o600)
    fd = os.open(segment, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as mm:
            for offset in offsets:
                mm[offset] = mm[offset]
            os.fchmod(fd, 0o400)
            seal(fd, mm)
            yield mm
    finally:
        os.close(fd)


def page_offset(page: int) -> int:
    """A byte in the first row of data page ``page``."""
    return DATA_OFFSET + page * (4096 // CONFIG.row_bytes) * CONFIG.row_bytes + 3


def test_a_changed_page_the_sample_meets_is_caught_and_the_segment_replaced(table, shm_dir):
    path, expected = table
    segment = loaded(path, shm_dir)
    changed = range(40, 50)  # ten pages in a row: more than a stretch of the 32 sampled (133 / 32)
    with mapped_before_the_seal(segment, [page_offset(p) for p in changed]) as mm:
        for page in changed:
            mm[page_offset(page)] ^= 0xFF
        assert problem(segment) is None  # the seal holds: only the pages tell
        with pytest.warns(RuntimeWarning, match=r"differs from the table at data page 4\d \(rows") as seen:
            tier = SharedTier(read_header(path), shm_dir=shm_dir)
    with tier:
        assert len(seen) == 1 and tier.loaded and tier.attach_check == "loaded"
        assert int(tier.replaced.split("data page ")[1].split()[0]) in changed
        assert np.array_equal(read(tier, np.arange(tier.num_rows)), expected)
    assert problem(segment) is None  # the fresh load is sealed


def test_the_forced_full_check_finds_a_changed_page_a_small_sample_misses(table, shm_dir):
    path, expected = table
    segment = loaded(path, shm_dir)
    with mapped_before_the_seal(segment, [page_offset(77)]) as mm:
        mm[page_offset(77)] ^= 0xFF
        with quiet(), SharedTier(read_header(path), shm_dir=shm_dir, verify_attach=0) as trusting:
            assert trusting.attach_check == "sample" and trusting.attach_pages_checked == 0  # the seal alone
        with pytest.warns(RuntimeWarning, match=r"differs from the table at data page 77 \(rows 1,925..1,949\)"):
            tier = SharedTier(read_header(path), shm_dir=shm_dir, verify_attach="full")
    with tier:
        assert tier.loaded and np.array_equal(read(tier, np.arange(tier.num_rows)), expected)


def test_a_head_changed_under_its_seal_has_every_page_checked(table, shm_dir):
    path, _ = table
    segment = loaded(path, shm_dir)
    with mapped_before_the_seal(segment, [0]) as mm:
        mm[32] ^= 0x01  # the loader pid's low bit: nothing the head's own checks read
        assert problem(segment) == "does not match its seal (its head was changed)"
        with quiet(), SharedTier(read_header(path), shm_dir=shm_dir) as tier:
            assert tier.attach_check == "full: does not match its seal (its head was changed)"
            assert not tier.loaded and tier.attach_pages_checked == tier.layout.num_pages


def test_a_segment_of_the_older_format_is_replaced_with_a_warning(table, shm_dir):
    path, expected = table
    header = read_header(path)
    folder = uid_folder(shm_dir)
    folder.mkdir(mode=0o700)
    segment = folder / segment_name(header)
    fd = os.open(segment, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    try:  # version 2: the head without a seal, every row as the table holds it
        os.write(fd, struct.pack("<8sIIQQIIQ", MAGIC, 2, READY, header.fingerprint(), expected.nbytes, 1, 0, 0)
                 .ljust(DATA_OFFSET, b"\0") + expected.tobytes())
    finally:
        os.close(fd)
    with pytest.warns(RuntimeWarning) as seen:
        with SharedTier(header, shm_dir=shm_dir) as tier:
            assert tier.loaded and np.array_equal(read(tier, np.arange(tier.num_rows)), expected)
    assert [str(w.message) for w in seen] == [
        f"the shared segment {segment} is of segment format 2, which this release does not read (it writes "
        f"{VERSION}): replaced by a fresh load of {path} (processes still attached to the old one keep it)"]
    assert problem(segment) is None


@pytest.mark.parametrize("value", [-1, 1.5, True, "sample", None])
def test_verify_attach_is_full_or_a_count_of_pages(table, shm_dir, value):
    with pytest.raises(ValueError) as caught:
        SharedTier(read_header(table[0]), shm_dir=shm_dir, verify_attach=value)
    assert str(caught.value) == f'verify_attach must be "full" or a whole number of pages >= 0, got {value!r}'


def test_the_seal_binds_what_the_segments_module_says(table, shm_dir):
    segment = loaded(table[0], shm_dir)
    st = segment.stat()
    head = segment.read_bytes()[: segments.HEAD.size]
    assert segments.SEAL.unpack_from(head, segments.SEAL_OFFSET)[:4] == (st.st_uid, st.st_dev, st.st_ino,
                                                                         st.st_ctime_ns)
    assert struct.unpack_from("<I", head, 8)[0] == VERSION == 3
