"""``pool serve``: the key file's password by default, ``--no-password`` on loopback only,
one-line refusals, and nothing left behind when it is killed."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engram_offload.cli import main
from engram_offload.pool.client import PoolClient, PoolError
from engram_offload.pool.key import KEY_ENV, load_key
from engram_offload.pool.publish import pool_status, publish_table
from engram_offload.pool.servers import free_port_base
from engram_offload.table import make_random_table

from redis_servers import skip_without_redis
from tiny_tables import tiny_config

CLI = "import sys; from engram_offload.cli import main; sys.exit(main())"


@pytest.fixture(autouse=True)
def key_file(monkeypatch, tmp_path) -> Path:
    path = tmp_path / "keys" / "pool.key"
    monkeypatch.setenv(KEY_ENV, str(path))
    monkeypatch.delenv("ENGRAM_OFFLOAD_POOL_PASSWORD", raising=False)
    return path


def serve(args: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLI, "pool", "serve", "--pool-nodes", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def servers_of(pid: int) -> list[int]:
    children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in children if Path(f"/proc/{c}/comm").read_text().strip() == "redis-server"]


def gone(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "Z" in state.split()[1]  # dead, waiting to be reaped


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def one_line_error(argv: list[str], capsys, code: int = 1) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("bind", ["10.1.2.3", "192.168.0.7"])
def test_no_password_is_refused_unless_the_servers_bind_loopback(bind, capsys):
    err = one_line_error(["pool", "serve", "--no-password", "--bind", bind], capsys)
    assert err == (f"engram-offload pool: error: --no-password with --bind {bind} would let any host that reaches it "
                   "rewrite the pool: drop --no-password, or bind a loopback address\n")


def test_a_bind_that_is_not_one_ipv4_address_is_a_usage_error(capsys):
    err = one_line_error(["pool", "serve", "--bind", "0.0.0.0"], capsys, code=2)
    assert "0.0.0.0 would listen on every interface: give one address of this machine" in err
    err = one_line_error(["pool", "serve", "--bind", "localhost"], capsys, code=2)
    assert "'localhost' is not an IPv4 address" in err
    err = one_line_error(["pool", "serve", "--no-password", "--requirepass", "k"], capsys, code=2)
    assert "not allowed with argument" in err


def test_a_folder_or_a_huge_file_as_the_key_file_is_a_one_line_error(tmp_path, capsys):
    err = one_line_error(["pool", "serve", "--requirepass", str(tmp_path)], capsys)
    assert err == (f"engram-offload pool: error: the pool key file {tmp_path} is not a regular file: give the path "
                   "of the key file itself\n")
    huge = tmp_path / "huge.key"
    huge.write_text("password " + "x" * (4 << 20) + "\n")
    huge.chmod(0o600)
    err = one_line_error(["pool", "serve", "--requirepass", str(huge)], capsys)
    assert f"the pool key file {huge} is larger than 4096 bytes, so not a key file" in err


def test_serve_requires_the_password_of_the_default_key_file_and_clients_find_it(tmp_path, key_file, monkeypatch):
    """Without options: a key file written under $XDG_CONFIG_HOME (0600, in a 0700 folder),
    the servers asking its password; publish, status and the tier find it there."""
    skip_without_redis()
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    port = free_port_base(1)
    proc = serve(["--port", str(port), "--dir", str(tmp_path / "d")])
    try:
        assert proc.stdout is not None and "serving one Redis server" in proc.stdout.readline()
        path = tmp_path / "config" / "engram-offload" / "pool.key"
        assert proc.stdout.readline().strip() == (f"password required: it is in {path}, with the row key; clients "
                                                  "read both there")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        password = load_key(path).password
        [server] = servers_of(proc.pid)
        assert password.encode() not in Path(f"/proc/{server}/cmdline").read_bytes()
        url = f"redis://127.0.0.1:{port}"
        table = make_random_table(tmp_path / "t.tbl", tiny_config("int8", 64), seed=3)
        publish_table(table, url, extent_rows=500, progress=False)
        assert pool_status(url)["tables"][0]["complete"]
        monkeypatch.setenv(KEY_ENV, str(tmp_path / "none.key"))
        with pytest.raises(PoolError, match="NOAUTH"):
            PoolClient(url)
    finally:
        proc.terminate()
        proc.wait(60)


def test_serve_with_another_key_file_names_the_variable_clients_need(tmp_path):
    skip_without_redis()
    port, other = free_port_base(1), tmp_path / "other.key"
    proc = serve(["--port", str(port), "--dir", str(tmp_path / "d"), "--requirepass", str(other)])
    try:
        assert proc.stdout is not None and "serving one Redis server" in proc.stdout.readline()
        assert proc.stdout.readline().strip() == (f"password required: it is in {other}, with the row key; clients "
                                                  f"read both there (set {KEY_ENV}={other} for them)")
    finally:
        proc.terminate()
        proc.wait(60)


def test_no_password_on_loopback_warns_loudly(tmp_path, key_file):
    skip_without_redis()
    port = free_port_base(1)
    proc = serve(["--port", str(port), "--dir", str(tmp_path / "d"), "--no-password"])
    try:
        assert proc.stdout is not None and "serving one Redis server" in proc.stdout.readline()
        assert proc.stderr is not None and proc.stderr.readline().startswith(
            "WARNING: --no-password: any local user may read, delete and overwrite the pool's values")
        load_key(key_file, create=True)  # its password is sent, and the server, asking none, says so
        with PoolClient(f"redis://127.0.0.1:{port}") as client:
            assert client.call("SET", "k", "v") == b"OK"
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_serve_ended_even_by_sigkill_leaves_no_servers_and_no_folder(tmp_path, sig):
    """Without --dir the servers work in a temporary engram-pool-* folder: when serve ends,
    even killed, the servers die with it and a watcher removes the folder after them."""
    skip_without_redis()
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = serve(["--port", str(free_port_base(1))], TMPDIR=str(temp))
    try:
        assert proc.stdout is not None and "serving one Redis server" in proc.stdout.readline()
        [folder] = list(temp.glob("engram-pool-*"))
        servers = servers_of(proc.pid)
        assert len(servers) == 1 and folder.is_dir()
        proc.send_signal(sig)
        proc.wait(60)
        assert wait_until(lambda: all(gone(pid) for pid in servers)), "redis-server outlived pool serve"
        assert wait_until(lambda: not folder.exists(), 30), f"{folder} outlived pool serve and its servers"
    finally:
        proc.kill()
        proc.wait()
