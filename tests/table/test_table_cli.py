"""``make-table``, ``verify`` and ``bench-tier`` through ``cli.main``."""

from __future__ import annotations

import json

from engram_offload import cli
from engram_offload.config import EngramConfig
from engram_offload.table import read_header

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
    assert cli.main(["make-table", "--scale", SCALE, "--out", str(path), "--block-size", "65536"]) == 0
    layout = read_header(path).layout
    start, end = layout.block_range(3)
    with open(path, "r+b") as f:
        f.seek(start + 7)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    capsys.readouterr()
    assert cli.main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"block 3 (bytes {start:,}..{end:,})" in err


def test_verify_foreign_and_missing_files(tmp_path, capsys):
    (tmp_path / "x").write_bytes(b"not a table at all" * 10)
    assert cli.main(["verify", str(tmp_path / "x")]) == 1
    assert "not an engram-offload table" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path / "missing")]) == 1


def test_bench_tier_json(tmp_path, capsys, monkeypatch):
    from engram_offload.tiers import bench

    monkeypatch.setattr(bench, "DROP_CACHES", str(tmp_path / "drop_caches"))  # leave the host's caches
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
        assert (tmp_path / "drop_caches").read_text() == "1\n"
    assert cli.main(["bench-tier", "--table", path, "--tier", "direct", "--seconds", "0.1"]) == 0
    assert "reads/s" in capsys.readouterr().out
