"""atomic_path / write_bytes_atomic / write_json_atomic: whole files or none, synced before and after
the rename."""

from __future__ import annotations

import errno
import json
import os

import pytest

from engram_offload import atomic
from engram_offload.atomic import atomic_path, write_bytes_atomic, write_json_atomic


def test_the_file_is_complete_and_synced_when_renamed(tmp_path, monkeypatch):
    target = tmp_path / "sub" / "out.json"
    events: list[tuple[str, object]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", open(src, "rb").read()))  # what the rename publishes
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    write_bytes_atomic(target, b"x" * 10_000)
    assert target.read_bytes() == b"x" * 10_000
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync"]  # the file, the rename, the directory
    assert events[0][1] != str(target) and str(events[0][1]).startswith(str(target.parent))  # the temporary
    assert events[1][1] == b"x" * 10_000  # complete at the rename
    assert events[2][1] == str(target.parent)
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]  # no temporary left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("disk on fire")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_the_temporary_sits_beside_the_target_with_the_given_suffix(tmp_path):
    with atomic_path(tmp_path / "plot.png", suffix=".png") as tmp:
        assert tmp.parent == tmp_path and tmp.name.endswith(".png") and tmp.name.startswith(".plot.png.")
        tmp.write_bytes(b"png")
    assert (tmp_path / "plot.png").read_bytes() == b"png"


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_gets_the_umasks_mode(tmp_path, mask, mode):
    previous = os.umask(mask)
    try:
        assert atomic.current_umask() == mask
        target = write_bytes_atomic(tmp_path / "results.json", b"{}")
        with atomic_path(tmp_path / "plot.png", suffix=".png") as tmp:
            tmp.write_bytes(b"png")
    finally:
        os.umask(previous)
    assert (target.stat().st_mode & 0o777, (tmp_path / "plot.png").stat().st_mode & 0o777) == (mode, mode)


def test_a_replaced_file_keeps_its_mode(tmp_path):
    target = tmp_path / "config.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    previous = os.umask(0o022)
    try:
        write_bytes_atomic(target, b"new")
    finally:
        os.umask(previous)
    assert target.read_bytes() == b"new" and target.stat().st_mode & 0o777 == 0o640


def test_a_json_value_that_cannot_be_written_leaves_nothing_behind(tmp_path):
    target = tmp_path / "out" / "results.json"
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError):
        write_json_atomic(target, loop)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    assert write_json_atomic(target, {"runs": [{"tier": "memory", "at": tmp_path}]}) == target
    assert json.loads(target.read_text())["runs"][0] == {"tier": "memory", "at": str(tmp_path)}
    assert target.read_text().endswith("}\n") and sorted(p.name for p in target.parent.iterdir()) == ["results.json"]


NOREPLACE_WAYS = {
    "renameat2": lambda monkeypatch: None,
    "link": lambda monkeypatch: monkeypatch.setattr(atomic, "_renameat2", lambda: None),
    "exclusive": lambda monkeypatch: (monkeypatch.setattr(atomic, "_renameat2", lambda: None),
                                      monkeypatch.setattr(atomic.os, "link", _links_refused)),
}


def _links_refused(src, dst, **kwargs):
    raise OSError(errno.EPERM, os.strerror(errno.EPERM), dst)  # as vfat refuses a hard link


@pytest.mark.parametrize("way", NOREPLACE_WAYS)
def test_no_replace_keeps_a_file_made_while_the_new_one_was_written(tmp_path, monkeypatch, way):
    NOREPLACE_WAYS[way](monkeypatch)
    target = tmp_path / "results.json"
    with pytest.raises(FileExistsError) as caught:
        with atomic_path(target, replace=False) as tmp:
            tmp.write_bytes(b"new")
            target.write_bytes(b"theirs")  # made after any check the caller did, before the rename
    assert str(caught.value) == (f"{target} exists (made while it was written): it is not written over; "
                                 "remove it or give another path")
    assert target.read_bytes() == b"theirs" and [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert write_json_atomic(tmp_path / "new.json", [1], replace=False).read_text() == "[\n  1\n]\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "results.json"]


def test_the_rename_itself_refuses_a_symbolic_link_in_the_way(tmp_path):
    (tmp_path / "elsewhere").write_bytes(b"kept")
    os.symlink(tmp_path / "elsewhere", tmp_path / "out.json")
    with pytest.raises(FileExistsError, match="out.json exists"):
        write_bytes_atomic(tmp_path / "out.json", b"new", replace=False)
    assert (tmp_path / "elsewhere").read_bytes() == b"kept" and os.path.islink(tmp_path / "out.json")
