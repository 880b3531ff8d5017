"""Progress off a terminal: periodic plain lines, never a bar's redraws."""

from __future__ import annotations

import subprocess
import sys

from engram_offload.table import progress


def test_progress_off_a_terminal_is_periodic_lines(monkeypatch, capsys):
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.0)  # a line at every update
    with progress.byte_progress("writing t.tbl", 4 << 20, True) as advance:
        for _ in range(4):
            advance(1 << 20)
    err = capsys.readouterr().err
    assert err.splitlines() == [f"writing t.tbl: {n}.0 MiB of 4.0 MiB ({n * 25}%)" for n in range(1, 5)]


def test_progress_lines_are_spaced_and_the_last_one_printed(capsys):
    lines = progress.LineProgress("training steps", 300, lambda n: f"{int(n):,}", every=3600)
    for step in range(1, 301):
        lines.update(step, f"loss {1 / step:.3f}")
    lines.close()
    assert capsys.readouterr().err.splitlines() == ["training steps: 300 of 300 (100%)  loss 0.003"]


def test_make_table_in_a_pipe_prints_lines_not_a_bar(tmp_path):
    """A real command whose stderr is a pipe: no carriage returns or escape codes in it."""
    code = ("import sys; from engram_offload.table import progress; progress.LINE_SECONDS = 0.0; progress.PROGRESS_MIN_BYTES = 0; "
            "from engram_offload.cli import main; sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, "make-table", "--scale", "2e-4", "--out",
                          str(tmp_path / "t.tbl")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("writing t.tbl: ")]
    assert lines and lines[-1].endswith("(100%)"), run.stderr
    assert "\r" not in run.stderr and "\x1b" not in run.stderr
