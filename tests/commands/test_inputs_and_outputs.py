"""The files a command is given and the files it writes: a FIFO or a device is refused before
any read (never waited on), a user's input is read with a bound, JSON that cannot be read is one
line naming the file, an output replaces nothing unless ``--force``, and a write that fails
names the file."""

from __future__ import annotations

import errno
import json
import os
import threading

import numpy as np
import pytest

from engram_offload.cli import main
from engram_offload.integrations.settings import open_store, parse_settings
from engram_offload.planner import trace as trace_module
from engram_offload.table import make_random_table

from tiny_tables import tiny_config

LIMIT = 60.0  # seconds any command here may take (each takes well under one)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return make_random_table(tmp_path_factory.mktemp("io") / "t.table", tiny_config("bf16", 80), seed=2)


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def run(argv: list[str], capsys) -> tuple[int, str]:
    """``main(argv)`` in a thread that must end within ``LIMIT`` (a blocking open would not);
    its exit code and its stderr."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(main(argv)), daemon=True)
    thread.start()
    thread.join(LIMIT)
    assert not thread.is_alive(), f"{argv} blocked"
    return result[0], capsys.readouterr().err


def one_error(argv: list[str], capsys, code: int = 1) -> str:
    rc, err = run(argv, capsys)
    assert rc == code and err.count("\n") == 1, err
    return err.strip()


# ------------------------------------------------------------------------------ inputs
@pytest.mark.parametrize("command", [
    ["verify", "{T}"],
    ["bench-tier", "--table", "{T}", "--tier", "memory", "--seconds", "0.1"],
    ["row-server", "--table", "{T}", "--socket", "/tmp/never.sock"],
])
def test_a_fifo_given_as_the_table_is_refused_not_waited_on(fifo, capsys, command):
    argv = [str(fifo) if a == "{T}" else a for a in command]
    assert one_error(argv, capsys).endswith(f"{fifo} is a FIFO (named pipe), not a regular file: give the table "
                                            "file itself")


def test_a_fifo_given_as_a_plugins_table_is_refused_not_waited_on(fifo):
    settings = parse_settings({"table": str(fifo), "tier": "mmap"})
    result: list = []

    def opening():
        try:
            open_store(settings, None)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            result.append(exc)

    thread = threading.Thread(target=opening, daemon=True)
    thread.start()
    thread.join(LIMIT)
    assert not thread.is_alive() and "is a FIFO (named pipe), not a regular file" in str(result[0])


@pytest.mark.parametrize("source, kind", [("/dev/zero", "a character device"), ("{FIFO}", "a FIFO (named pipe)")])
def test_trace_refuses_token_ids_that_are_not_a_file_before_reading_them(tmp_path, fifo, capsys, source, kind):
    source = str(fifo) if source == "{FIFO}" else source
    out = tmp_path / "t.npy"
    message = one_error(["trace", "--token-ids", source, "--out", str(out)], capsys)
    assert message == (f"engram-offload trace: error: {source} is {kind}, not a regular file: give the token log "
                       "itself")
    assert not out.exists()


def test_trace_reads_a_token_log_only_up_to_its_bound(tmp_path, capsys, monkeypatch):
    log = tmp_path / "tokens.log"
    log.write_text("1 2 3\n" * 20)  # 120 bytes
    monkeypatch.setattr(trace_module, "MAX_TOKEN_LOG_BYTES", 100)
    assert one_error(["trace", "--token-ids", str(log), "--out", str(tmp_path / "t.npy")], capsys) == (
        f"engram-offload trace: error: {log} is over 100 B, the most a token log may hold: give a smaller token log")


@pytest.mark.parametrize("content, message", [
    (b'{"host_dram": "\xff"}', "{F} is not UTF-8 text: give a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, "{F} nests JSON too deeply to read: give a flat object"),
    (b'{"nvme_drives": 1e308}', "server figure nvme_drives must be at most 4,096, got 1e+308"),
    (b'{"nvme_drives": 2.5}', "server figure nvme_drives must be a whole number, got 2.5"),
    (b'{"host_dram": "1e400"}', "server figure host_dram: '1e400' must be a finite number >= 0"),
    (b'{"nvme_iops": ' + b"9" * 400 + b"}", "server figure nvme_iops: " + "9" * 400 + " is not a number"),
])
def test_plan_refuses_a_server_file_it_cannot_use_in_one_line(tmp_path, capsys, content, message):
    server = tmp_path / "server.json"
    server.write_bytes(content)
    got = one_error(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "b300", "--server", str(server)], capsys)
    assert got == "engram-offload plan: error: " + message.replace("{F}", str(server))


@pytest.mark.parametrize("option, what", [("--server", "server file"), ("--trace", "trace file"),
                                          ("--config", "Hugging Face config.json")])
def test_plan_refuses_a_fifo_as_its_server_trace_or_config(fifo, capsys, option, what):
    argv = ["plan", "--gpu", "b300", option, str(fifo)] + ([] if option == "--config" else
                                                          ["--preset", "deepseek-v4.1-flash"])
    assert one_error(argv, capsys).endswith(f"{fifo} is a FIFO (named pipe), not a regular file: give the {what} "
                                            "itself")


def test_plan_reads_the_trace_trace_wrote_whatever_its_name(tmp_path, capsys):
    log, out = tmp_path / "tokens.log", tmp_path / "rows.trace"  # no .npy suffix
    log.write_text("1 2 3 4 5 6 7 8\n9 10 11\n")
    assert main(["trace", "--token-ids", str(log), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "b300", "--trace", str(out), "--json"]) == 0
    ids = np.load(out)
    assert json.loads(capsys.readouterr().out)["workload"]["miss_ratio_curve"].startswith(f"trace of {ids.size:,} ids")


def test_a_npy_trace_whose_header_claims_more_than_it_holds_is_one_line(tmp_path, capsys):
    trace = tmp_path / "t.npy"
    np.save(trace, np.arange(10, dtype=np.int64))
    trace.write_bytes(trace.read_bytes().replace(b"(10,)", b"(10000000000000,)"))
    got = one_error(["plan", "--preset", "deepseek-v4.1-flash", "--gpu", "b300", "--trace", str(trace)], capsys)
    assert got.startswith(f"engram-offload plan: error: {trace} is not a readable .npy array (")


# ----------------------------------------------------------------------------- outputs
def test_trace_never_writes_over_a_file_unless_forced(tmp_path, capsys):
    log, out = tmp_path / "tokens.log", tmp_path / "t.npy"
    log.write_text("1 2 3\n")
    out.write_bytes(b"keep")
    assert one_error(["trace", "--token-ids", str(log), "--out", str(out)], capsys) == (
        f"engram-offload trace: error: {out} exists: the trace is not written over it; give another path, or "
        "--force to replace it")
    assert out.read_bytes() == b"keep"
    assert main(["trace", "--token-ids", str(log), "--out", str(out), "--force"]) == 0
    assert np.load(out).dtype == np.int64


def test_a_full_disk_under_trace_names_the_output(tmp_path, capsys, monkeypatch):
    log, out = tmp_path / "tokens.log", tmp_path / "t.npy"
    log.write_text("1 2 3\n")

    def full(path, arr):
        with open(path, "wb") as f:
            f.write(b"\x93NUMPY")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as the write of a full disk fails

    monkeypatch.setattr(np, "save", full)
    assert one_error(["trace", "--token-ids", str(log), "--out", str(out)], capsys) == (
        f"engram-offload trace: error: No space left on device: {out}; free space or write elsewhere")
    assert list(tmp_path.iterdir()) == [log]


def test_make_table_never_writes_over_a_file_unless_forced(tmp_path, capsys):
    out = tmp_path / "t.table"
    out.write_bytes(b"keep")
    argv = ["make-table", "--scale", "0.0001", "--out", str(out), "--no-progress"]
    assert one_error(argv, capsys) == (f"engram-offload make-table: error: {out} exists: the table is not written "
                                       "over it; give another path, or --force to replace it")
    assert out.read_bytes() == b"keep"
    assert main(argv + ["--force"]) == 0 and out.stat().st_size > 4


def test_bench_refuses_to_write_over_its_results_before_running(tmp_path, capsys):
    (tmp_path / "results.json").write_text("{}")
    assert one_error(["bench", "--out", str(tmp_path), "--no-progress"], capsys) == (
        f"engram-offload bench: error: {tmp_path / 'results.json'} exists: the benchmark result is not written over "
        "it; give another path, or --force to replace it")
    (tmp_path / "results.json").unlink()
    (tmp_path / "plot.png").write_bytes(b"")
    assert one_error(["bench", "--out", str(tmp_path), "--plot", str(tmp_path / "plot.png")], capsys).endswith(
        f"{tmp_path / 'plot.png'} exists: the benchmark result is not written over it; give another path, or "
        "--force to replace it")


def test_bench_keeps_results_made_while_it_ran(tmp_path, capsys, monkeypatch):
    """A results file made after bench's last check, before its rename, is kept (not replaced)."""
    from engram_offload.commands import bench as bench_command

    table_path, results = tmp_path / "t.table", tmp_path / "out" / "results.json"
    assert main(["make-table", "--scale", "0.0001", "--out", str(table_path), "--no-progress"]) == 0
    document = bench_command._document

    def made_meanwhile(*args, **kwargs):
        results.parent.mkdir(exist_ok=True)
        results.write_text("theirs")
        return document(*args, **kwargs)

    monkeypatch.setattr(bench_command, "_document", made_meanwhile)
    argv = ["bench", "--table", str(table_path), "--tiers", "memory", "--cache-states", "cold", "--concurrency", "1",
            "--seconds", "0.1", "--warmup-seconds", "0", "--corpus", "zipf", "--corpus-tokens", "2000",
            "--repeats", "1", "--out", str(results.parent), "--no-progress"]
    rc, err = run(argv, capsys)  # stderr: the plan and progress first, the error last
    assert rc == 1 and err.splitlines()[-1] == (f"engram-offload bench: error: {results} exists (made while it was "
                                                "written): it is not written over; remove it or give another path")
    assert results.read_text() == "theirs" and sorted(p.name for p in results.parent.iterdir()) == ["results.json"]
