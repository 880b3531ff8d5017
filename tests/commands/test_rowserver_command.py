"""``engram-offload row-server``: a real process serving exact rows, stopped by SIGTERM with its
socket removed and exit code 0."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_offload.cli import main
from engram_offload.serving.rowserver import RowClient
from engram_offload.serving.rowserver.server import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_ROWS
from engram_offload.serving.store import open_table
from engram_offload.table import make_random_table, random_rows

from tiny_tables import tiny_config

CLI = "import sys; from engram_offload.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.fixture
def socket_dir():
    directory = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))  # Unix socket paths: at most 107 bytes
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_row_server_serves_until_sigterm_then_removes_its_socket(tmp_path, socket_dir, sig):
    config = tiny_config("fp8_e4m3_ue8m0", 64)
    table = make_random_table(tmp_path / "t.table", config, seed=3)
    expected = np.concatenate(list(random_rows(config, 3)))
    sock = socket_dir / "rows.sock"
    server = subprocess.Popen([sys.executable, "-c", CLI, "row-server", "--table", str(table), "--socket", str(sock),
                               "--cache-bytes", "10%"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # printed once the socket listens
        assert line.startswith(f"serving {table}") and sock.exists(), (line, server.stderr.read() if server.stderr else "")
        with RowClient(sock) as client:
            ids = np.arange(0, client.num_rows, 7)
            assert torch.equal(client.read_raw(ids), torch.from_numpy(expected[ids]))
            assert client.stats()["store"]["rows_unique"] > 0
        server.send_signal(sig)
        out, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, err
    assert not sock.exists() and f"stopped ({sig.name})" in err


def test_row_server_refuses_a_second_server_on_the_socket(tmp_path, socket_dir):
    config = tiny_config("fp8_e4m3_ue8m0", 64)
    table = make_random_table(tmp_path / "t.table", config, seed=3)
    sock = socket_dir / "rows.sock"
    first = subprocess.Popen([sys.executable, "-c", CLI, "row-server", "--table", str(table), "--socket", str(sock)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline().startswith("serving")
        second = subprocess.run([sys.executable, "-c", CLI, "row-server", "--table", str(table), "--socket", str(sock)],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 1 and "a row server already serves" in second.stderr
        assert sock.exists()  # the first one's socket is left alone
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0 and not sock.exists()


# ---------------------------------------------------------------------- the command in this process
@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """A small fp8 table and its rows (``[num_rows, row_bytes]`` uint8)."""
    config = tiny_config("fp8_e4m3_ue8m0", 64)
    path = make_random_table(tmp_path_factory.mktemp("rowserver") / "t.table", config, seed=8)
    return path, np.concatenate(list(random_rows(config, 8)))


def test_row_server_says_why_it_cannot_serve_in_one_line(table, socket_dir, capsys):
    path, _ = table
    sock = socket_dir / "rows.sock"
    assert main(["row-server", "--table", str(socket_dir / "none.table"), "--socket", str(sock)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("engram-offload row-server: error: ") and err.count("\n") == 1
    sock.write_text("not a socket")
    assert main(["row-server", "--table", str(path), "--socket", str(sock)]) == 1
    assert capsys.readouterr().err == (f"engram-offload row-server: error: {sock} exists and is not a socket: "
                                       "choose another socket path\n")
    assert sock.read_text() == "not a socket"


def serve_in_process(argv: list[str], sock: Path, while_serving, stop: int) -> int:
    """``engram-offload row-server`` in this process; a thread waits (60 s at most) for ``sock``,
    calls ``while_serving()``, then sends this process ``stop``. The signal handlers are restored after."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def act_then_stop() -> None:
        try:
            deadline = time.monotonic() + 60
            while not sock.exists():
                assert time.monotonic() < deadline, "the row server did not serve within 60 s"
                time.sleep(0.01)
            while_serving()
        finally:
            os.kill(os.getpid(), stop)

    thread = threading.Thread(target=act_then_stop, daemon=True)
    thread.start()
    try:
        return main(["row-server", *argv])
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        thread.join(timeout=30)


@pytest.mark.parametrize("stop,options", [(signal.SIGTERM, "all"), (signal.SIGINT, "none"), (signal.SIGTERM, "cache")])
def test_row_server_serves_with_its_options_until_sigterm_or_sigint(table, socket_dir, capsys, stop, options):
    """The command in this process: a client in a thread checks what it serves, then signals this
    process; the handler closes the server from a thread and the command returns 0."""
    path, expected = table
    sock = socket_dir / "rows.sock"
    rb = tiny_config("fp8_e4m3_ue8m0", 64).row_bytes
    seen: dict[str, object] = {}

    def check() -> None:
        with RowClient(sock) as client:
            seen["rows"] = client.read_raw([2, 9]).numpy()
            seen["stats"] = client.stats()
            seen["tier"] = client.tier

    given = ["--tier", "mmap", "--cache-bytes", f"{100 * rb}", "--policy", "lru", "--max-rows", "50",
             "--max-connections", "3"]
    given = {"all": given, "none": [], "cache": ["--cache-bytes", "1MiB"]}[options]
    assert serve_in_process(["--table", str(path), "--socket", str(sock), *given], sock, check, stop) == 0
    tier = "mmap" if options == "all" else "direct"
    assert capsys.readouterr().out == f"serving {path} ({tier} tier) on {sock}; SIGTERM or Ctrl-C stops it\n"
    assert np.array_equal(seen["rows"], expected[[2, 9]])
    stats = seen["stats"]
    if options == "cache":  # the default policy, the size in words
        with open_table(path, "direct", cache_bytes=1 << 20) as same:
            assert stats["levels"][0]["capacity_rows"] == same.stats()["levels"][0]["capacity_rows"]
        assert stats["levels"][0]["policy"] == "lfu"
    elif options == "all":
        assert seen["tier"] == "mmap"
        assert (stats["server"]["max_rows"], stats["server"]["max_connections"]) == (50, 3)
        assert stats["levels"][0]["policy"] == "lru" and stats["levels"][0]["capacity_rows"] == 100
    else:  # the defaults: the direct tier, no cache
        assert seen["tier"] == "direct" and [level["level"] for level in stats["levels"]] == ["tier"]
        assert (stats["server"]["max_rows"], stats["server"]["max_connections"]) == (
            DEFAULT_MAX_ROWS, DEFAULT_MAX_CONNECTIONS)
    assert not sock.exists()  # closed, from the handler's thread


def test_row_server_says_it_serves_before_serving_even_into_a_pipe(table, socket_dir, monkeypatch):
    """The "serving" line is flushed before the first connection is served: a supervisor reading
    the server's stdout through a pipe (block-buffered) sees it at once, not when the server exits."""
    path, _ = table
    sock = socket_dir / "rows.sock"

    class Sink(io.RawIOBase):  # what has left the buffer, as a pipe would see it
        def __init__(self) -> None:
            self.seen = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            self.seen += bytes(data)
            return len(data)

    sink = Sink()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(sink, 1 << 16), write_through=False))
    seen_when_served: list[bytes] = []

    def connect() -> None:
        with RowClient(sock):
            seen_when_served.append(bytes(sink.seen))

    assert serve_in_process(["--table", str(path), "--socket", str(sock)], sock, connect, signal.SIGTERM) == 0
    assert seen_when_served == [f"serving {path} (direct tier) on {sock}; SIGTERM or Ctrl-C stops it\n".encode()]


@pytest.mark.parametrize("tier, message", [
    ("remote", "argument --tier: the remote tier reads a Redis pool, not the table file: give one of memory, "
               "pinned, mmap, direct, shared"),
    ("1=memory/14=direct", "argument --tier: '1=memory/14=direct' is a placement; this command reads every layer "
                           "from one tier: give one of memory, pinned, mmap, direct, shared"),
])
def test_row_server_refuses_a_tier_it_cannot_serve_in_one_line(table, socket_dir, capsys, tier, message):
    path, _ = table
    assert main(["row-server", "--table", str(path), "--socket", str(socket_dir / "s"), "--tier", tier]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert list(socket_dir.iterdir()) == []


def test_row_server_names_a_socket_path_it_cannot_bind_before_opening_the_table(table, socket_dir, capsys):
    path, _ = table
    missing = socket_dir / "no-such-folder" / "rows.sock"
    long = socket_dir / ("r" * 200)
    for sock, message in [
        (missing, f"the socket's folder {missing.parent} does not exist: create it (mode 0700, yours only) or give "
                  "a socket path in a folder that exists"),
        (long, f"the socket path {long} is {len(str(long))} bytes, over the 107 a Unix socket's path may have: give "
               "a shorter path (such as /run/engram/rows.sock)"),
    ]:
        assert main(["row-server", "--table", str(path), "--socket", str(sock), "--tier", "memory"]) == 1
        assert capsys.readouterr().err == f"engram-offload row-server: error: {message}\n"
    assert list(socket_dir.iterdir()) == []  # no .lock left behind
