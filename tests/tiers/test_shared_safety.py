"""The shared tier on a shared host: what another local user plants, a segment changed or
truncated after loading, old versions, modes, and one-line messages (docs/threat-model.md).

The other user is a forked child running as uid 65534 (tests that need it skip when not root);
``/dev/shm`` is stood in for by a private folder opened up the same way (mode 1777).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import xxhash

from engram_offload.errors import ChecksumError, TierError
from engram_offload.table import make_random_table, random_rows, read_header
from engram_offload.tiers.segments import DATA_OFFSET, HEAD, MAGIC, READY, VERSION, seal, seal_problem, uid_folder
from engram_offload.tiers.shared import SharedTier, segment_name

from second_uid import NOBODY, Held, in_child, needs_root
from tier_cases import read
from tiny_tables import tiny_config

CONFIG = tiny_config("bf16", 80)  # 3,304 rows of 160 bytes, 25 a page


@pytest.fixture
def public_shm(shm_dir):
    """``shm_dir`` open to every local user as ``/dev/shm`` is (mode 1777)."""
    shm_dir.chmod(0o1777)
    return shm_dir


@pytest.fixture(scope="module")
def public_table():
    """A table every local user may read: (path, its rows ``[num_rows, row_bytes]``)."""
    folder = Path(tempfile.mkdtemp(prefix="engram-public-"))
    folder.chmod(0o755)
    path = make_random_table(folder / "t.table", CONFIG, seed=4)
    path.chmod(0o644)
    yield path, np.concatenate(list(random_rows(CONFIG, 4)))
    shutil.rmtree(folder, ignore_errors=True)


def all_rows(tier) -> np.ndarray:
    return read(tier, np.arange(tier.num_rows))


def one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message and "\n" not in message, message
    return message


def digest(rows: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(rows).tobytes())


# ----------------------------------------------------------------- case 1: planted by another uid
def plant_old_layout_segment(path: str, fingerprint: int, nbytes: int) -> None:
    """(As another uid) a ready segment at the name the shared tier used to use, every byte 0x5A."""
    head = struct.pack("<8sIIQQII", MAGIC, 1, READY, fingerprint, nbytes, os.getpid(), 0)
    with open(path, "wb") as f:
        f.write(head.ljust(DATA_OFFSET, b"\0") + b"\x5a" * nbytes)
    os.chmod(path, 0o644)


@needs_root
def test_a_segment_another_uid_planted_at_the_predictable_name_is_never_served(public_table, public_shm):
    path, expected = public_table
    header = read_header(path)
    planted = public_shm / segment_name(header)
    assert in_child(plant_old_layout_segment, str(planted), header.fingerprint(), expected.nbytes) == ("ok", None)
    with SharedTier(header, shm_dir=public_shm) as tier:
        assert np.array_equal(all_rows(tier), expected)
        assert np.array_equal(tier.rows.numpy(), expected)
    assert planted.stat().st_uid == NOBODY  # not used, not touched


def plant_folder(folder: str, kind: str, target: str, fingerprint: int, nbytes: int) -> str | None:
    """(As another uid) this uid's segment folder made first: a folder with a ready, sealed
    segment of wrong rows in it, one open to all, a symbolic link, or a file."""
    if kind == "symlink":
        os.symlink(target, folder)
        return None
    if kind == "file":
        Path(folder).write_bytes(b"")
        return None
    os.mkdir(folder, 0o777 if kind == "open folder" else 0o700)
    os.chmod(folder, 0o777 if kind == "open folder" else 0o700)
    seg = os.path.join(folder, f"engram-{fingerprint:016x}")
    fd = os.open(seg, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o400)
    try:
        os.write(fd, HEAD.pack(MAGIC, VERSION, READY, fingerprint, nbytes, os.getpid(), 0, 0, 0, 0, 0, 0, bytes(16))
                 .ljust(DATA_OFFSET, b"\0") + b"\x5a" * nbytes)
        with mmap.mmap(fd, 0) as mm:
            seal(fd, mm)  # a seal as good as a loader's: the folder's owner is what refuses it
        return seal_problem(fd, os.fstat(fd))
    finally:
        os.close(fd)


@needs_root
@pytest.mark.parametrize("kind, words", [
    ("folder", f"belongs to uid {NOBODY}, not to this process's uid 0"),
    ("open folder", f"belongs to uid {NOBODY}"),
    ("symlink", "is a symbolic link"),
    ("file", "is not a folder"),
])
def test_a_folder_another_uid_made_under_this_uids_name_is_refused_naming_it(public_table, public_shm, tmp_path,
                                                                              kind, words):
    path, expected = public_table
    header = read_header(path)
    folder = uid_folder(public_shm)
    target = tmp_path / "private"  # a folder of root's, closed to others: a symlink must not lead there
    target.mkdir(mode=0o700)
    assert in_child(plant_folder, str(folder), kind, str(target), header.fingerprint(), expected.nbytes) == (
        "ok", None)  # (folder) its segment's seal holds
    with pytest.raises(TierError) as caught:
        SharedTier(header, shm_dir=public_shm)
    message = one_line(caught.value)
    assert str(folder) in message and words in message and "shm_dir=" in message
    assert list(target.iterdir()) == []


def hold_lock(path: str) -> None:
    """(As another uid) create ``path`` and hold an exclusive flock on it until the child ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)


def open_and_digest(table: str, shm: str, options: dict | None = None) -> tuple[bool, str, int]:
    """Open ``table`` on the shared tier: (loaded here, the segment, digest of every row read)."""
    with SharedTier(read_header(table), shm_dir=shm, **(options or {})) as tier:
        return tier.loaded, str(tier.segment), digest(all_rows(tier))


@needs_root
def test_a_held_lock_another_uid_planted_does_not_stall_the_open(public_table, public_shm):
    path, expected = public_table
    lock = public_shm / (segment_name(read_header(path)) + ".lock")
    with Held(hold_lock, str(lock)) as answer:
        assert answer == ("ok", None)
        status, (loaded, _, rows) = in_child(open_and_digest, str(path), str(public_shm), uid=None, timeout=60)
    assert status == "ok" and loaded and rows == digest(expected)


def plant_symlink(link: str, target: str) -> None:
    os.symlink(target, link)


@needs_root
def test_a_lock_another_uid_planted_as_a_symlink_creates_nothing_where_it_points(public_table, public_shm, tmp_path):
    path, expected = public_table
    header = read_header(path)
    victim = tmp_path / "victim"  # in a folder of root's
    assert in_child(plant_symlink, str(public_shm / (segment_name(header) + ".lock")), str(victim)) == ("ok", None)
    with SharedTier(header, shm_dir=public_shm) as tier:
        assert np.array_equal(all_rows(tier), expected)
    assert not victim.exists()


@pytest.mark.parametrize("which", ["lock", "segment"])
def test_a_symlink_in_this_uids_folder_is_never_followed(public_table, shm_dir, tmp_path, which):
    header = read_header(public_table[0])
    folder = uid_folder(shm_dir)
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    name = segment_name(header) + (".lock" if which == "lock" else "")
    (folder / name).symlink_to(victim)
    with pytest.raises(TierError) as caught:
        SharedTier(header, shm_dir=shm_dir)
    assert f"{folder / name} is a symbolic link" in one_line(caught.value)
    assert not victim.exists()


@pytest.mark.parametrize("what, mode, words", [("folder", 0o755, "is mode 0755"), ("segment", 0o644, "is mode 0644"),
                                               ("lock", 0o666, "is mode 0666"),  # open to every user
                                               ("folder", 0o750, "is mode 0750"), ("segment", 0o640, "is mode 0640"),
                                               ("lock", 0o660, "is mode 0660")])  # open to the group only
def test_this_uids_folder_or_files_open_to_others_are_refused(public_table, shm_dir, what, mode, words):
    header = read_header(public_table[0])
    with SharedTier(header, shm_dir=shm_dir):
        pass
    folder = uid_folder(shm_dir)
    target = {"folder": folder, "segment": folder / segment_name(header),
              "lock": folder / (segment_name(header) + ".lock")}[what]
    target.chmod(mode)
    with pytest.raises(TierError) as caught:
        SharedTier(header, shm_dir=shm_dir)
    assert f"{target} " in one_line(caught.value) and words in str(caught.value)


# ------------------------------------------------------------------ case 2: changed after loading
def change_byte(segment: Path, offset: int) -> None:
    """Flip one byte of the segment through a writable mapping (root: the segment is 0400), then
    put its modification time back: only the page checksums can tell."""
    before = segment.stat()
    segment.chmod(0o600)
    fd = os.open(segment, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as mm:
            mm[offset] ^= 0xFF
    finally:
        os.close(fd)
    segment.chmod(0o400)
    os.utime(segment, ns=(before.st_atime_ns, before.st_mtime_ns))


def row_offset(row: int) -> int:
    return DATA_OFFSET + row * CONFIG.row_bytes + 7


def test_a_byte_changed_after_loading_is_refused_by_attached_readers(public_table, shm_dir):
    path, expected = public_table
    header = read_header(path)
    row = 1234
    page = row // header.layout.rows_per_page
    with SharedTier(header, shm_dir=shm_dir) as sampled, \
            SharedTier(header, shm_dir=shm_dir, verify_reads=True) as checked:
        change_byte(sampled.segment, row_offset(row))
        with pytest.raises(ChecksumError) as caught:
            read(sampled, [row])  # its one row: the sample is that row's page
        message = one_line(caught.value)
        assert f"at data page {page} " in message and "changed after it was loaded" in message
        with pytest.raises(ChecksumError, match=f"at data page {page} "):
            read(checked, [3, 3000, row, 17])
        assert np.array_equal(read(checked, [3, 3000, 17]), expected[[3, 3000, 17]])  # the other pages are whole
        rpp = header.layout.rows_per_page
        assert checked.stats()["pages_checked"] == len({3 // rpp, 3000 // rpp, page}) + len({3 // rpp, 3000 // rpp})


def test_a_later_attacher_replaces_a_changed_segment_and_serves_the_tables_rows(public_table, shm_dir):
    path, expected = public_table
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir) as first:
        segment = first.segment
    change_byte(segment, row_offset(2000))
    with pytest.warns(RuntimeWarning, match=r"differs from the table at data page 80 \(rows 2,000..2,024\): replaced"):
        second = SharedTier(header, shm_dir=shm_dir)
    with second:
        assert second.loaded and "data page 80" in second.replaced
        assert np.array_equal(all_rows(second), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with SharedTier(header, shm_dir=shm_dir) as third:  # the fresh copy passes
            assert not third.loaded and third.replaced is None and third.stats()["attach_check_seconds"] > 0


def test_a_segment_touched_after_loading_is_refused_by_attached_readers(public_table, shm_dir):
    header = read_header(public_table[0])
    with SharedTier(header, shm_dir=shm_dir) as tier:
        before = tier.segment.stat()
        os.utime(tier.segment, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
        with pytest.raises(TierError, match="was modified .its mtime changed. after"):
            read(tier, [5])


# ---------------------------------------------------------- case 6: truncated under attached readers
def truncate_and_read(table: str, shm: str, race: bool, native: bool) -> str:
    """Attach, truncate the segment to its head, read: the error's message, or "served"."""
    os.environ["ENGRAM_OFFLOAD_NO_NATIVE"] = "" if native else "1"
    with SharedTier(read_header(table), shm_dir=shm) as tier:
        tier.sample_pages = 0  # the rows' own copy is what is tested
        tier.segment.chmod(0o600)
        os.truncate(tier.segment, DATA_OFFSET)
        if race:  # truncated after the read's size check: the guarded copy's turn
            tier._check_unchanged = lambda: None
        try:
            all_rows(tier)
        except TierError as exc:
            return str(exc)
    return "served"


@pytest.mark.parametrize("race, native, words", [
    (False, True, f"shrank to {DATA_OFFSET:,} bytes"),
    (True, True, "shrank during a read (SIGBUS caught)"),
    (True, False, "ended early during a read"),
])
def test_a_segment_truncated_under_an_attached_reader_gives_a_tier_error_not_sigbus(public_table, shm_dir,
                                                                                    race, native, words):
    with SharedTier(read_header(public_table[0]), shm_dir=shm_dir):
        pass  # loaded by this process; the child attaches
    status, message = in_child(truncate_and_read, str(public_table[0]), str(shm_dir), race, native, uid=None)
    assert status == "ok" and words in message and "open the table again" in message, message


def truncate_then_attach(table: str, shm: str) -> tuple[list[str], bool, int]:
    header = read_header(table)
    with SharedTier(header, shm_dir=shm) as tier:
        segment = tier.segment
    segment.chmod(0o600)
    os.truncate(segment, DATA_OFFSET + 1000)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with SharedTier(header, shm_dir=shm) as again:
            return [str(w.message) for w in seen], again.loaded, digest(all_rows(again))


def test_attaching_a_truncated_segment_replaces_it_naming_its_size(public_table, shm_dir):
    path, expected = public_table
    status, answer = in_child(truncate_then_attach, str(path), str(shm_dir), uid=None)
    assert status == "ok", answer
    seen, loaded, rows = answer
    assert loaded and rows == digest(expected)
    total = DATA_OFFSET + expected.nbytes
    assert len(seen) == 1 and f"was {DATA_OFFSET + 1000:,} bytes, {total:,} expected" in seen[0], seen


# --------------------------------------------------------------- case 12: old versions of a table
def segments(shm_dir: Path) -> set[str]:
    """The segments in ``shm_dir`` and in this uid's folder there."""
    found = [p for folder in (shm_dir, uid_folder(shm_dir)) if folder.is_dir() for p in folder.iterdir()]
    return {p.name for p in found if p.is_file() and p.name.startswith("engram-") and not p.name.endswith(".lock")}


def test_unused_old_versions_go_when_a_rewritten_table_loads_and_those_in_use_stay(tmp_path, shm_dir):
    path, other = tmp_path / "t.table", tmp_path / "other.table"
    make_random_table(other, CONFIG, seed=9)
    with SharedTier(read_header(other), shm_dir=shm_dir):  # another table's segment: never touched
        pass

    def version(seed: int) -> SharedTier:
        make_random_table(path, CONFIG, seed=seed)  # rewritten: renamed over the old file
        return SharedTier(read_header(path), shm_dir=shm_dir)

    first = version(1)
    first.close()  # its segment outlives it
    second = version(2)
    assert segments(shm_dir) == {segment_name(read_header(other)), segment_name(second.header)}
    assert not (uid_folder(shm_dir) / (segment_name(first.header) + ".lock")).exists()
    with version(3) as third:  # the second is in use: it stays
        assert np.array_equal(all_rows(third), np.concatenate(list(random_rows(CONFIG, 3))))
        assert segments(shm_dir) == {segment_name(read_header(other)), segment_name(second.header),
                                     segment_name(third.header)}
    assert np.array_equal(all_rows(second), np.concatenate(list(random_rows(CONFIG, 2))))
    second.close()


@needs_root
def test_a_load_that_does_not_fit_names_the_old_versions_still_in_use(tmp_path):
    mount = tmp_path / "small-shm"
    mount.mkdir()
    path = make_random_table(tmp_path / "t.table", CONFIG, seed=1)
    size = (DATA_OFFSET + CONFIG.num_rows * CONFIG.row_bytes) * 3 // 2  # room for one segment, not two
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        old = read_header(path)
        with SharedTier(old, shm_dir=mount):
            make_random_table(path, CONFIG, seed=2)
            with pytest.raises(TierError) as caught:
                SharedTier(read_header(path), shm_dir=mount)
        message = one_line(caught.value)
        assert f"{segment_name(old)} (" in message and f"{path}, in use)" in message and "remove_segment" in message
        with SharedTier(read_header(path), shm_dir=mount) as new:  # once closed, the old version makes room
            assert new.loaded and segments(mount) == {segment_name(new.header)}
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


# --------------------------------------------------------------------- case 13: modes, other uids
def readable_files(top: str) -> list[str]:
    """(As another uid) every file under ``top`` it can open and read."""
    found = []
    for folder, _, files in os.walk(top):
        for name in files:
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    f.read(1)
                found.append(os.path.join(folder, name))
            except OSError:
                pass
    return found


@needs_root
def test_no_other_uid_can_read_a_segment(public_table, public_shm):
    header = read_header(public_table[0])
    with SharedTier(header, shm_dir=public_shm) as tier:
        assert in_child(readable_files, str(public_shm)) == ("ok", [])
        folder = uid_folder(public_shm)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE(tier.segment.stat().st_mode) == 0o400
        assert stat.S_IMODE((folder / (segment_name(header) + ".lock")).stat().st_mode) & 0o077 == 0


# ------------------------------------------------------------------------- case 14: messages
@needs_root
def test_another_uid_gets_a_copy_of_its_own(public_table, public_shm):
    path, expected = public_table
    header = read_header(path)
    with SharedTier(header, shm_dir=public_shm):
        status, answer = in_child(open_and_digest, str(path), str(public_shm))
    assert status == "ok", answer
    assert answer == (True, str(public_shm / f"engram-uid-{NOBODY}" / segment_name(header)), digest(expected))


@needs_root
def test_another_uid_pointed_at_this_uids_folder_gets_one_line_naming_it(public_table, public_shm):
    path, _ = public_table
    with SharedTier(read_header(path), shm_dir=public_shm):
        status, message = in_child(open_and_digest, str(path), str(uid_folder(public_shm)))
    assert status == "error" and message.startswith("TierError: ") and "\n" not in message
    assert f"uid ({NOBODY}) may not enter {uid_folder(public_shm)}" in message and "shm_dir=" in message


@pytest.mark.parametrize("options, error, words", [
    ({"segment": ""}, ValueError, "plain file name"),
    ({"segment": "a/b"}, ValueError, "'a/b'"),
    ({"segment": ".."}, ValueError, "not hidden"),
    ({"segment": "model.lock"}, ValueError, "not ending in .lock"),
    ({"segment": "a\0b"}, ValueError, "plain file name"),
    ({"segment": "tab\there"}, ValueError, "printable"),
    ({"segment": "x" * 300}, ValueError, "at most 200 bytes"),
    ({"segment": 5}, ValueError, "file name (str), got int 5"),
    ({"shm_dir": ""}, ValueError, "absolute path"),
    ({"shm_dir": "relative/folder"}, ValueError, "'relative/folder'"),
    ({"shm_dir": "/dev/shm\0x"}, ValueError, "absolute path"),
    ({"shm_dir": b"/dev/shm"}, ValueError, "folder path (str), got bytes"),
    ({"shm_dir": 5}, ValueError, "got int 5"),
    ({"shm_dir": "/no/such/folder"}, TierError, "/no/such/folder, which is not a folder"),
    ({"shm_dir": "TABLE"}, TierError, "which is not a folder"),
    ({"lock_timeout": 0}, ValueError, "lock_timeout"),
    ({"lock_timeout": "5"}, ValueError, "lock_timeout"),
    ({"sample_pages": -1}, ValueError, "sample_pages"),
    ({"sample_pages": 1.5}, ValueError, "sample_pages"),
])
def test_odd_options_get_one_line_naming_them(public_table, shm_dir, options, error, words):
    path, _ = public_table
    if options.get("shm_dir") == "TABLE":
        options = {"shm_dir": str(path)}
    with pytest.raises(error) as caught:
        SharedTier(read_header(path), **{"shm_dir": shm_dir, **options})
    assert words in one_line(caught.value)
    assert not uid_folder(shm_dir).exists() or not segments(shm_dir)  # nothing loaded


# ---------------------------------------------------------- replacing a damaged segment, in this process
def truncate_segment(segment: Path, size: int) -> None:
    segment.chmod(0o600)
    os.truncate(segment, size)
    segment.chmod(0o400)


def outside_the_package(filename: str) -> bool:
    """Whether a warning points outside engram_offload (at the line that opened the tier)."""
    import engram_offload

    return not Path(filename).resolve().is_relative_to(Path(engram_offload.__file__).resolve().parent)


def test_a_replaced_segments_warning_names_why_and_points_at_the_callers_line(public_table, shm_dir):
    path, expected = public_table
    header = read_header(path)
    total = DATA_OFFSET + expected.nbytes
    with SharedTier(header, shm_dir=shm_dir) as first:
        segment = first.segment
    truncate_segment(segment, DATA_OFFSET + 1000)  # caught by the head's check, under the lock
    with pytest.warns(RuntimeWarning) as seen:
        with SharedTier(header, shm_dir=shm_dir) as tier:
            assert tier.loaded and np.array_equal(all_rows(tier), expected)
            assert tier.replaced == f"was {DATA_OFFSET + 1000:,} bytes, {total:,} expected (truncated or damaged)"
    assert [outside_the_package(w.filename) for w in seen] == [True]
    assert str(seen[0].message) == (f"the shared segment {segment} {tier.replaced}: replaced by a fresh load of "
                                    f"{path} (processes still attached to the old one keep it)")
    change_byte(segment, row_offset(100))  # caught by the page check, after the lock
    with pytest.warns(RuntimeWarning, match=r"at data page 4 ") as seen:
        SharedTier(header, shm_dir=shm_dir).close()
    assert [outside_the_package(w.filename) for w in seen] == [True]


def test_a_head_that_names_another_size_is_replaced(public_table, shm_dir):
    path, expected = public_table
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir) as first:
        segment = first.segment
    segment.chmod(0o600)
    fd = os.open(segment, os.O_RDWR)
    try:  # the head's data bytes (its fifth field) made larger; the file keeps its size
        os.pwrite(fd, struct.pack("<Q", expected.nbytes + 4096), 24)
    finally:
        os.close(fd)
    segment.chmod(0o400)
    with pytest.warns(RuntimeWarning, match="holds"):
        with SharedTier(header, shm_dir=shm_dir) as tier:
            assert tier.loaded and np.array_equal(all_rows(tier), expected)
            assert tier.replaced == f"says it holds {expected.nbytes + 4096:,} bytes of rows, {expected.nbytes:,} " \
                                    "expected (damaged)"


AGAIN = "close the store and open the table again (a fresh open replaces a damaged segment)"


@pytest.mark.parametrize("native", [True, False])
def test_a_segment_truncated_under_a_reader_in_this_process_gives_one_line(public_table, shm_dir, monkeypatch, native):
    monkeypatch.setenv("ENGRAM_OFFLOAD_NO_NATIVE", "" if native else "1")
    path, expected = public_table
    header = read_header(path)
    total = DATA_OFFSET + expected.nbytes
    with SharedTier(header, shm_dir=shm_dir, sample_pages=0) as tier:
        assert np.array_equal(all_rows(tier), expected)
        truncate_segment(tier.segment, DATA_OFFSET)
        with pytest.raises(TierError) as caught:
            read(tier, [5])
        assert one_line(caught.value) == (f"the shared segment {tier.segment} shrank to {DATA_OFFSET:,} bytes "
                                          f"({total:,} expected) after {path} was loaded into it: {AGAIN}")
        monkeypatch.setattr(tier, "_check_unchanged", lambda: None)  # truncated after the size check
        with pytest.raises(TierError) as caught:
            read(tier, [5])
        what = "shrank during a read (SIGBUS caught)" if native else "ended early during a read"
        assert one_line(caught.value) == f"the shared segment {tier.segment} {what} after {path} was loaded into it: {AGAIN}"
        tier.sample_pages = 1  # the sampled page's check meets the truncation first
        with pytest.raises(TierError, match="shrank during a read" if native else "ended early during a read"):
            read(tier, [5])


def test_a_changed_page_is_named_in_one_line_with_what_to_do(public_table, shm_dir):
    path, _ = public_table
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir, verify_reads=True) as tier:
        change_byte(tier.segment, row_offset(1234))
        with pytest.raises(ChecksumError) as caught:
            read(tier, [1234])
        assert one_line(caught.value) == (
            f"the shared segment {tier.segment} differs from {path} at data page 49 (rows 1,225..1,249): it was "
            f"changed after it was loaded; {AGAIN}")


# ------------------------------------------------------ one segment name, two versions or two tables
def test_a_named_segment_of_an_older_version_is_replaced_unless_in_use(tmp_path, shm_dir):
    path, other = tmp_path / "t.table", tmp_path / "other.table"
    old = read_header(make_random_table(path, CONFIG, seed=1))
    held = SharedTier(old, segment="engram-model", shm_dir=shm_dir)
    new = read_header(make_random_table(path, CONFIG, seed=2))  # rewritten in place
    with pytest.raises(TierError) as caught:
        SharedTier(new, segment="engram-model", shm_dir=shm_dir)
    assert one_line(caught.value) == (
        f"the shared segment {held.segment} holds an older version of this table, fingerprint "
        f"{old.fingerprint():016x}, not {path} (fingerprint {new.fingerprint():016x}): pick another segment "
        "name, or close the processes using it")
    held.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unused older version goes without a word
        with SharedTier(new, segment="engram-model", shm_dir=shm_dir) as tier:
            assert tier.loaded and np.array_equal(all_rows(tier), np.concatenate(list(random_rows(CONFIG, 2))))
    with SharedTier(read_header(make_random_table(other, CONFIG, seed=3)), shm_dir=shm_dir,
                    segment="engram-other") as in_use:
        with pytest.raises(TierError) as caught:
            SharedTier(new, segment="engram-other", shm_dir=shm_dir)
    assert one_line(caught.value) == (
        f"the shared segment {in_use.segment} holds another table ({other}), fingerprint "
        f"{in_use.fingerprint:016x}, not {path} (fingerprint {new.fingerprint():016x}): pick another segment name, "
        "or remove the stale one with engram_offload.tiers.shared.remove_segment (or rm) when no process uses it")


def test_the_same_version_under_another_name_stays_when_it_loads_again(public_table, shm_dir):
    header = read_header(public_table[0])
    with SharedTier(header, shm_dir=shm_dir, segment="engram-model"):
        pass
    with SharedTier(header, shm_dir=shm_dir) as tier:
        assert tier.loaded
        assert segments(shm_dir) == {"engram-model", segment_name(header)}


# ------------------------------------------------------------ races, made to happen at one point
def test_a_segment_modified_or_cut_short_while_it_is_checked_is_replaced(public_table, shm_dir, monkeypatch):
    path, expected = public_table
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir):
        pass
    check = SharedTier._check_attach
    segment = uid_folder(shm_dir) / segment_name(header)

    def touched(self, fd, mm):
        problem = check(self, fd, mm)
        if not self.replaced:
            before = segment.stat()
            os.utime(segment, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
        return problem

    monkeypatch.setattr(SharedTier, "_check_attach", touched)
    with pytest.warns(RuntimeWarning, match="was modified while it was checked: replaced"):
        with SharedTier(header, shm_dir=shm_dir) as tier:
            assert tier.loaded and tier.replaced == "was modified while it was checked"
            assert np.array_equal(all_rows(tier), expected)

    def cut(self, fd, mm):  # after the head's check and the mapping, before the pages'
        truncate_segment(segment, DATA_OFFSET)
        return check(self, fd, mm)

    monkeypatch.setattr(SharedTier, "_check_attach", cut)
    with pytest.warns(RuntimeWarning, match=rf"ended early \({DATA_OFFSET:,} bytes; SIGBUS caught\): replaced"):
        with SharedTier(header, shm_dir=shm_dir) as tier:
            assert tier.loaded and np.array_equal(all_rows(tier), expected)
            assert 0 < tier.attach_check_seconds <= tier.load_seconds


HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()
"""


class LockHolder:
    """Another process of this uid holding an exclusive ``flock`` on ``path`` until the block ends."""

    def __init__(self, path: Path) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> LockHolder:
        assert self.process.stdout.readline().strip() == "held"
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.stdin.close()
        self.process.wait()


def test_a_segment_a_remover_holds_or_that_vanishes_after_loading_is_named(public_table, shm_dir, monkeypatch):
    from engram_offload.tiers import shared

    header = read_header(public_table[0])
    with SharedTier(header, shm_dir=shm_dir) as tier:
        segment = tier.segment
    with LockHolder(segment):  # as remove_segment or an old version's cleaner holds it
        with pytest.raises(TierError) as caught:
            SharedTier(header, shm_dir=shm_dir)
    assert one_line(caught.value) == (f"the shared segment {segment} is locked by a process removing it: open the "
                                      "table again")
    load = shared._load

    def load_then_vanish(header, folder, name, *args):
        load(header, folder, name, *args)
        folder.unlink(name)

    segment.unlink()
    monkeypatch.setattr(shared, "_load", load_then_vanish)
    with pytest.raises(TierError) as caught:
        SharedTier(header, shm_dir=shm_dir)
    assert one_line(caught.value) == (f"the shared segment {segment} vanished right after it was loaded: another "
                                      "process of this uid removes segments; open the table again")


def test_replacing_a_damaged_segment_waits_for_the_lock_no_longer_than_lock_timeout(public_table, shm_dir,
                                                                                   monkeypatch):
    header = read_header(public_table[0])
    with SharedTier(header, shm_dir=shm_dir) as tier:
        segment = tier.segment
    change_byte(segment, row_offset(7))
    lock = segment.with_name(segment.name + ".lock")
    check = SharedTier._check_attach
    holders = []

    def then_locked(self, fd, mm):  # another process takes the lock between the check and the replacement
        holders.append(LockHolder(lock).__enter__())
        return check(self, fd, mm)

    monkeypatch.setattr(SharedTier, "_check_attach", then_locked)
    try:
        with pytest.raises(TierError, match=f"the lock {lock}"):
            SharedTier(header, shm_dir=shm_dir, lock_timeout=0.2)
    finally:
        for holder in holders:
            holder.__exit__()
    assert len(holders) == 1 and segment.exists()  # not replaced: it waited, then gave up


# ------------------------------------------------------------------------- the folder's free space
@pytest.fixture
def small_tmpfs(tmp_path):
    """``mount(size)``: a tmpfs of ``size`` bytes, open to all (unmounted afterwards)."""
    mounts = []

    def mount(size: int) -> Path:
        where = tmp_path / f"tmpfs-{len(mounts)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


@needs_root
def test_a_folder_with_room_for_exactly_the_segment_loads_it_and_a_page_less_is_refused(tmp_path, small_tmpfs):
    from engram_offload.units import format_bytes

    config = tiny_config("bf16", 256)  # 3,304 rows of 512 bytes: whole pages
    path = make_random_table(tmp_path / "t.table", config, seed=1)
    header = read_header(path)
    need = DATA_OFFSET + config.num_rows * config.row_bytes
    assert need % 4096 == 0
    with SharedTier(header, shm_dir=small_tmpfs(need)) as tier:
        assert tier.loaded and np.array_equal(all_rows(tier), np.concatenate(list(random_rows(config, 1))))
    small = small_tmpfs(need - 4096)
    with pytest.raises(TierError) as caught:
        SharedTier(header, shm_dir=small)
    name = segment_name(header)
    assert one_line(caught.value) == (
        f"{path}: the shared tier needs {format_bytes(need)} in {uid_folder(small)} and {format_bytes(need - 4096)} "
        "is free there; no other segments of this uid are there; or enlarge it (mount -o remount,size=...), or "
        "use the mmap or direct tier")
    with pytest.raises(TierError) as caught:
        SharedTier(header, shm_dir=small, check_memory=False)  # not checked first: the allocation fails
    assert one_line(caught.value) == (f"cannot create the shared segment {uid_folder(small) / name} ({need:,} bytes): "
                                      "No space left on device; no other segments of this uid are there")
    assert segments(small) == set()


def test_a_table_whose_path_is_cut_inside_a_character_in_the_head_opens_and_attaches(tmp_path, shm_dir):
    from engram_offload.tiers.segments import MAX_PATH

    folder = tmp_path
    while len(str(folder).encode()) < MAX_PATH - 130:  # folders named in two-byte characters
        folder = folder / ("é" * 50)
    pad = MAX_PATH - 22 - len(str(folder).encode())  # then the head's last byte is an é's first
    folder = folder / ("x" * pad + "é" * 15)
    folder.mkdir(parents=True)
    path = folder / "t.table"  # made beside, then moved: the writer's temporary name would be too long there
    make_random_table(tmp_path / "t.table", CONFIG, seed=8).rename(path)
    assert str(path).encode()[MAX_PATH - 1] >= 0x80  # the head keeps the first byte of a character only
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir) as first, SharedTier(header, shm_dir=shm_dir) as second:
        assert first.loaded and not second.loaded
        assert np.array_equal(all_rows(second), np.concatenate(list(random_rows(CONFIG, 8))))


def test_a_table_whose_path_is_not_utf8_opens_and_attaches(tmp_path, shm_dir):
    folder = tmp_path / os.fsdecode(b"tables-\xff\xfe")  # a byte name no UTF-8 decoder accepts
    folder.mkdir()
    path = make_random_table(folder / "t.table", CONFIG, seed=9)
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir) as first, SharedTier(header, shm_dir=shm_dir) as second:
        assert first.loaded and not second.loaded and second.replaced is None
        assert np.array_equal(all_rows(second), np.concatenate(list(random_rows(CONFIG, 9))))


def test_a_segment_truncated_between_its_head_check_and_its_mapping_is_replaced(public_table, shm_dir, monkeypatch):
    path, expected = public_table
    header = read_header(path)
    with SharedTier(header, shm_dir=shm_dir) as first:
        segment = first.segment
    total = DATA_OFFSET + expected.nbytes
    opened = SharedTier._open_or_load

    def then_cut(self, *args):  # the head and size checked under the lock; cut before the mapping
        fd = opened(self, *args)
        if not self.loaded:
            truncate_segment(segment, DATA_OFFSET + 1000)
        return fd

    monkeypatch.setattr(SharedTier, "_open_or_load", then_cut)
    with pytest.warns(RuntimeWarning, match="was truncated to .* before it was mapped: replaced"):
        with SharedTier(header, shm_dir=shm_dir) as tier:
            assert tier.loaded and np.array_equal(all_rows(tier), expected)
            assert tier.replaced == (f"was truncated to {DATA_OFFSET + 1000:,} bytes ({total:,} expected) "
                                     "before it was mapped")


def test_a_segment_found_damaged_at_each_of_three_loads_is_an_error_naming_the_cause(public_table, shm_dir,
                                                                                     monkeypatch):
    header = read_header(public_table[0])
    with SharedTier(header, shm_dir=shm_dir) as tier:
        segment = tier.segment
    change_byte(segment, row_offset(7))
    damaged = segment.read_bytes()
    opened, plants = SharedTier._open_or_load, []

    def planted(self, *args):  # something of this uid puts the damaged copy back each time it is removed
        if not segment.exists():
            fd = os.open(segment, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, damaged)
            os.fchmod(fd, 0o400)
            os.close(fd)
            plants.append(segment)
        return opened(self, *args)

    monkeypatch.setattr(SharedTier, "_open_or_load", planted)
    with pytest.warns(RuntimeWarning, match="at data page 0 ") as seen:
        with pytest.raises(TierError) as caught:
            SharedTier(header, shm_dir=shm_dir)
    assert one_line(caught.value) == (
        f"the shared segment {segment} was damaged again each of 3 times it was loaded: something of this uid (or "
        "root) writes to it; find it (fuser -v), then open the table again")
    assert len(seen) == 3 and len(plants) == 2


def test_the_defaults_and_a_segment_name_of_200_bytes(public_table, shm_dir):
    header = read_header(public_table[0])
    with SharedTier(header, shm_dir=shm_dir, segment="é" * 100) as tier:  # 200 bytes: the most a name may have
        assert tier.segment.name == "é" * 100
        assert tier.stats()["sample_pages"] == 1 and tier.stats()["verify_reads"] is False


@pytest.mark.parametrize("folder", ["/proc", "/proc/self"])
def test_a_folder_where_no_segment_can_be_made_is_one_line_naming_it(public_table, folder):
    with pytest.raises(TierError) as caught:
        SharedTier(read_header(public_table[0]), shm_dir=folder)
    assert one_line(caught.value) == (
        f"cannot create {folder}/engram-uid-{os.geteuid()} (No such file or directory): {folder} is not a folder "
        "segments can be made in; pass shm_dir= a tmpfs folder (default /dev/shm)")
