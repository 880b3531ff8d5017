"""``engram-offload shared list|drop``: this uid's shared-tier segments, listed and dropped,
never one a process uses."""

from __future__ import annotations

import json
import os
from pathlib import Path

from engram_offload.cli import main
from engram_offload.table import make_random_table
from engram_offload.table.format import read_header
from engram_offload.tiers.segments import LOCK_SUFFIX, uid_folder
from engram_offload.tiers.shared import SharedTier, segment_name

from tiny_tables import tiny_config


def listed(shm_dir: Path, capsys) -> dict[str, dict]:
    assert main(["shared", "list", "--shm-dir", str(shm_dir), "--json"]) == 0
    return {e["name"]: e for e in json.loads(capsys.readouterr().out)}


def test_list_and_drop_segments_but_never_one_in_use(tmp_path, shm_dir, capsys):
    assert listed(shm_dir, capsys) == {}  # no folder yet: nothing, no error
    path = make_random_table(tmp_path / "t.table", tiny_config("bf16", 80), seed=4)
    header = read_header(path)
    name = segment_name(header)
    with SharedTier(header, shm_dir=shm_dir):
        entry = listed(shm_dir, capsys)[name]
        assert entry["kind"] == "segment" and entry["state"] == "ready" and entry["in_use"]
        assert entry["table"] == str(path.resolve()) and entry["bytes"] >= header.layout.num_rows * header.layout.row_bytes
        assert main(["shared", "drop", name, "--shm-dir", str(shm_dir)]) == 1  # in use: kept
        assert f"kept {name}" in capsys.readouterr().out
        assert main(["shared", "drop", "--all", "--shm-dir", str(shm_dir)]) == 1
        assert (uid_folder(shm_dir) / name).exists()
        capsys.readouterr()
    assert listed(shm_dir, capsys)[name]["in_use"] is False
    assert main(["shared", "list", "--shm-dir", str(shm_dir)]) == 0
    text = capsys.readouterr().out
    assert f"  {name}  " in text and "unused" in text and (" KiB" in text or " MiB" in text)
    assert main(["shared", "drop", name, "--shm-dir", str(shm_dir)]) == 0
    assert f"dropped {name}" in capsys.readouterr().out
    assert os.listdir(uid_folder(shm_dir)) == []  # the segment and its lock file


def test_a_lock_file_left_without_its_segment_is_listed_and_dropped(tmp_path, shm_dir, capsys):
    path = make_random_table(tmp_path / "t.table", tiny_config("bf16", 80), seed=4)
    header = read_header(path)
    name = segment_name(header)
    with SharedTier(header, shm_dir=shm_dir):
        pass
    os.unlink(uid_folder(shm_dir) / name)  # removed by hand (rm), its lock file left behind
    entries = listed(shm_dir, capsys)
    assert list(entries) == [name + LOCK_SUFFIX]
    assert entries[name + LOCK_SUFFIX]["state"] == "orphan lock" and not entries[name + LOCK_SUFFIX]["in_use"]
    assert main(["shared", "drop", "--all", "--shm-dir", str(shm_dir)]) == 0
    assert os.listdir(uid_folder(shm_dir)) == []


def test_drop_needs_names_or_all_and_names_what_is_not_there(shm_dir, capsys):
    assert main(["shared", "drop", "--shm-dir", str(shm_dir)]) == 2
    assert "give segment names" in capsys.readouterr().err
    assert main(["shared", "drop", "engram-0123", "--shm-dir", str(shm_dir)]) == 1
    assert "no segment engram-0123" in capsys.readouterr().err


def test_files_of_other_names_in_the_shm_folder_are_neither_listed_nor_dropped(shm_dir, capsys):
    segment, lock = shm_dir / "engram-0123456789abcdef", shm_dir / "engram-0123456789abcdef.lock"
    segment.write_bytes(b"\0" * 8192)
    lock.write_bytes(b"")
    assert listed(shm_dir, capsys) == {}
    main(["shared", "drop", "--all", "--shm-dir", str(shm_dir)])
    assert segment.exists() and lock.exists()
