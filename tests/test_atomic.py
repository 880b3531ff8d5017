"""atomic_path / write_bytes_atomic: whole files or none, synced before and after the rename."""

from __future__ import annotations

import os

import pytest

from engram_offload import atomic
from engram_offload.atomic import atomic_path, write_bytes_atomic


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
