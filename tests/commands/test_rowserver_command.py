"""``engram-offload row-server``: a real process serving exact rows, stopped by SIGTERM with its
socket removed and exit code 0."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_offload.serving.rowserver import RowClient
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
    table = make_random_table(tmp_path / "t.table", config, seed=3, block_size=16384)
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
    table = make_random_table(tmp_path / "t.table", config, seed=3, block_size=16384)
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
