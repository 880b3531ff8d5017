"""``make-table``, ``verify`` and ``bench-tier`` through ``cli.main``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from engram_offload import cli
from engram_offload.engram.config import EngramConfig
from engram_offload.machine import free_disk_bytes
from engram_offload.table import TableLayout, read_header
from engram_offload.table.writer import boot_id
from engram_offload.units import format_bytes

SCALE = "2e-5"  # deepseek-v4.1-flash at 2e-5: about 17 k rows of 264 bytes


def test_make_table_is_seeded_and_verifies(tmp_path, capsys):
    a, b, c = (str(tmp_path / n) for n in ("a.tbl", "b.tbl", "c.tbl"))
    for out, seed in ((a, "1"), (b, "1"), (c, "2")):
        assert cli.main(["make-table", "--preset", "deepseek-v4.1-flash", "--scale", SCALE,
                         "--out", out, "--seed", seed]) == 0
    assert open(a, "rb").read() == open(b, "rb").read() != open(c, "rb").read()
    header = read_header(a)
    assert header.config == EngramConfig.from_name("deepseek-v4.1-flash").scaled(float(SCALE))
    assert cli.main(["verify", a]) == 0
    assert "OK" in capsys.readouterr().out


def test_verify_fails_on_a_flipped_byte(tmp_path, capsys):
    path = tmp_path / "t.tbl"
    assert cli.main(["make-table", "--scale", SCALE, "--out", str(path)]) == 0
    layout = read_header(path).layout
    start = layout.data_offset + 3 * layout.page_bytes
    with open(path, "r+b") as f:
        f.seek(start + 7)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    capsys.readouterr()
    assert cli.main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    first, last = layout.page_rows(3)
    assert f"data page 3 (rows {first:,}..{last:,})" in err


def test_verify_foreign_and_missing_files(tmp_path, capsys):
    (tmp_path / "x").write_bytes(b"not a table at all" * 10)
    assert cli.main(["verify", str(tmp_path / "x")]) == 1
    assert "not an engram-offload table" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path / "missing")]) == 1


def test_bench_tier_json(tmp_path, capsys, monkeypatch):
    from engram_offload.bench import cold

    drop = tmp_path / "drop_caches"
    monkeypatch.setattr(cold, "DROP_CACHES", str(drop))  # never the host's caches
    path = str(tmp_path / "t.tbl")
    assert cli.main(["make-table", "--scale", SCALE, "--out", path]) == 0
    for tier in ("memory", "mmap", "direct"):
        capsys.readouterr()
        assert cli.main(["bench-tier", "--table", path, "--tier", tier, "--seconds", "0.2",
                         "--batch", "256", "--queue-depth", "4", "--cold", "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["tier"] == tier and result["rows"] > 0 and result["rows_per_s"] > 0
        assert {"reads_per_s", "cpu_us_per_read", "engine", "table_bytes", "cold_method"} <= set(result)
        assert "posix_fadvise(DONTNEED)" in result["cold_method"]
        assert not drop.exists()  # only the table's pages, unless --drop-all-caches
    assert cli.main(["bench-tier", "--table", path, "--tier", "direct", "--seconds", "0.1"]) == 0
    assert "reads/s" in capsys.readouterr().out


# ---------------------------------------------------------------- interrupted and failed writes
WRITER = """
import os, signal, sys
from engram_offload import cli
from engram_offload.table import generate

real_rows = generate.random_rows

def rows_then_signal(config, seed=0, chunk_rows=generate.CHUNK_ROWS):
    chunks = real_rows(config, seed, chunk_rows=1024)
    yield next(chunks)
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))  # mid-write, after the first rows
    yield from chunks

generate.random_rows = rows_then_signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file size limit is an error, not a signal
sys.exit(cli.main(["make-table", "--scale", "%s", "--out", sys.argv[2], "--no-progress"]))
""" % SCALE


def run_writer(signal_name: str, out, limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    import resource

    def limit():
        # as from a terminal: a test run started in the background inherits SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if limit_bytes:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-c", WRITER, signal_name, str(out)], capture_output=True,
                          text=True, timeout=120, preexec_fn=limit)


@pytest.mark.parametrize("signal_name,code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_signal_during_make_table_removes_the_temporary_file(tmp_path, signal_name, code):
    proc = run_writer(signal_name, tmp_path / "t.tbl")
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and signal_name in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_write_failure_is_one_line_and_leaves_nothing(tmp_path):
    """A write that fails part-way (here: the file size limit, EFBIG, as ENOSPC would) is one
    line on stderr, exit code 1, and leaves no temporary file."""
    proc = run_writer("SIGCONT", tmp_path / "t.tbl", limit_bytes=1 << 20)  # SIGCONT: harmless
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "File too large" in lines[0] and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_killed_writers_leftovers_are_cleaned(tmp_path, capsys):
    """SIGKILL leaves the temporary file; the next write to the same path removes it, and
    ``verify --clean`` removes any other table's (and only dead writers')."""
    for out in ("t.tbl", "u.tbl"):
        assert run_writer("SIGKILL", tmp_path / out).returncode == -signal.SIGKILL
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and all(name.endswith(".tmp") for name in left)
    live = tmp_path / f".v.tbl.{boot_id()}.{os.getpid()}.0123abcd.tmp"
    live.write_bytes(b"a live writer's table")
    assert cli.main(["make-table", "--scale", SCALE, "--out", str(tmp_path / "t.tbl"), "--no-progress"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["t.tbl", live.name, left[1]])
    capsys.readouterr()
    assert cli.main(["verify", "--clean", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"removed {tmp_path / left[1]}" in out and "1 temporary file(s)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["t.tbl", live.name])


def test_make_table_checks_free_disk_first(tmp_path, capsys):
    need = TableLayout.for_config(EngramConfig.from_name("deepseek-v4.1-flash")).file_bytes
    if free_disk_bytes(tmp_path) >= need:
        pytest.skip("this disk has room for the full table")
    assert cli.main(["make-table", "--full", "--out", str(tmp_path / "t.tbl")]) == 1
    err = capsys.readouterr().err
    assert "make-table of" in err and f"needs {format_bytes(need)} of disk" in err and "--force" in err
    assert len(err.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []
