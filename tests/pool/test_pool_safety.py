"""The pool on a shared host: local servers on the ports they were given (or none), gone with
the process that started them, a password kept out of sight, messages that name the fix."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engram_offload.pool.client import PoolClient, PoolError, parse_pool_url
from engram_offload.pool.publish import pool_status, publish_table
from engram_offload.pool.servers import PortTakenError, ephemeral_ports, free_port_base, start_local_pool
from engram_offload.table import make_random_table

from redis_servers import fresh_pool, skip_without_redis  # noqa: F401 (fixtures)
from tiny_tables import tiny_config

CLI = "import sys; from engram_offload.cli import main; sys.exit(main())"


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return make_random_table(tmp_path_factory.mktemp("pool-safety") / "t.tbl", tiny_config("int8", 64), seed=3)


def pool_cli(argv: list[str]) -> int:
    from engram_offload.commands import pool

    parser = argparse.ArgumentParser(prog="engram-offload")
    pool.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def gone(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return True
    return "Z" in state.split()[1]  # a zombie: dead, waiting for init to reap it


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# ---------------------------------------------------------------------- ports (issue 30's flake)
def test_free_ports_lie_outside_the_ephemeral_range():
    low, high = ephemeral_ports()
    for nodes in (1, 3):
        for _ in range(50):
            base = free_port_base(nodes)
            ports = [p + off for p in range(base, base + nodes) for off in (0, 10000)]
            assert all(not low <= p <= high and 1024 <= p <= 65535 for p in ports), (base, low, high)


def test_pools_started_together_on_free_ports_all_come_up():
    """Six pools started at once by threads (a barrier lines them up): each picks, binds
    and checks its own ports, retrying another pick when one is taken meanwhile."""
    skip_without_redis()
    barrier = threading.Barrier(6)
    pools, errors = [], []

    def start() -> None:
        barrier.wait()
        try:
            pools.append(start_local_pool(1, None))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    try:
        assert not errors and len(pools) == 6
        ports = [pool.nodes[0].port for pool in pools]
        assert len(set(ports)) == 6
        low, high = ephemeral_ports()
        assert not any(low <= port <= high for port in ports)
        for pool in pools:
            with PoolClient(pool.url) as client:
                assert client.call("SET", "k", pool.url) == b"OK" and client.call("GET", "k") == pool.url.encode()
    finally:
        for pool in pools:
            pool.stop()


def test_a_taken_port_is_an_error_never_a_success(fresh_pool, tmp_path):  # noqa: F811
    """Another Redis already answers on the port: the old start took its PONG for the new
    server's, and pool serve printed success while its own server had died."""
    other = fresh_pool(1)
    port = other.nodes[0].port
    with pytest.raises(PortTakenError, match=f"port {port} on 127.0.0.1 is taken by another process"):
        start_local_pool(1, port, tmp_path / "again")
    done = subprocess.run([sys.executable, "-c", CLI, "pool", "serve", "--pool-nodes", "1", "--port", str(port),
                           "--dir", str(tmp_path / "cli")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "serving" not in done.stdout
    assert f"port {port} on 127.0.0.1 is taken by another process: choose another --port" in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_pool_serve_takes_its_servers_along_when_it_ends(tmp_path, sig):
    skip_without_redis()
    port = free_port_base(2)
    serve = subprocess.Popen([sys.executable, "-c", CLI, "pool", "serve", "--pool-nodes", "2", "--port", str(port),
                              "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None and "serving a Redis Cluster" in serve.stdout.readline()
        servers = children(serve.pid)
        assert len(servers) == 2
        serve.send_signal(sig)
        serve.wait(timeout=60)
        assert wait_until(lambda: all(gone(pid) for pid in servers)), "redis-server outlived pool serve"
    finally:
        serve.kill()
        serve.wait()
        for pid in children(serve.pid) if not gone(serve.pid) else []:
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------- the password (the key file: test_pool_key.py)
def test_the_password_is_never_printed(fresh_pool, table, capsys):  # noqa: F811
    pool = fresh_pool(1)
    with PoolClient(pool.url) as client:
        client.each_node("CONFIG", "SET", "requirepass", "s3cret")
    url = pool.url.replace("redis://", "redis://:s3cret@")
    assert pool_cli(["pool", "publish", str(table), "--pool", url, "--extent-rows", "500", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "redis://:***@127.0.0.1:" in out
    for bad in ("redis://:s3cret@127.0.0.1:99999", ":s3cret@127.0.0.1:7001", "http://:s3cret@127.0.0.1:7001",
                "redis://:s3cret@127.0.0.1"):
        with pytest.raises(ValueError) as caught:
            parse_pool_url(bad)
        assert "s3cret" not in str(caught.value) and "***" in str(caught.value)


# ---------------------------------------------------------------------- messages that name the fix
@pytest.mark.parametrize("url, said", [
    ("127.0.0.1:7001", "lacks its scheme: use redis://127.0.0.1:7001"),
    ("redis://127.0.0.1:99999", "port 99999 is out of range (1-65535)"),
    ("redis://127.0.0.1", "lacks a host and port"),
])
def test_bad_pool_urls_say_what_is_wrong(url, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        parse_pool_url(url)


def test_a_port_that_is_not_redis_says_so():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]

    def answer_like_http() -> None:
        for _ in range(4):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(1024)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            conn.close()

    server = threading.Thread(target=answer_like_http, daemon=True)
    server.start()
    try:
        with pytest.raises(PoolError, match=f"127.0.0.1:{port} does not speak the Redis protocol "
                                             r"\(it sent b'HTTP/1.1 400"):
            PoolClient(f"redis://127.0.0.1:{port}", timeout=5)
    finally:
        listener.close()


def test_pool_status_lists_the_tables_beside_foreign_keys(fresh_pool, table):  # noqa: F811
    pool = fresh_pool(1)
    publish_table(table, pool.url, extent_rows=500, progress=False)
    with PoolClient(pool.url) as client:
        client.call("SET", "{not-a-fingerprint}:engram:header", b"x")
        client.call("SET", "{0123456789abcdef}:engram:header", b"\xff not json")
    tables = {t["fingerprint"]: t for t in pool_status(pool.url)["tables"]}
    assert len(tables) == 3 and sum(t["complete"] for t in tables.values()) == 1
    assert "is not an engram-offload table's header" in tables["{not-a-fingerprint}:engram:header"]["problems"][0]
    assert "unreadable" in tables["0123456789abcdef"]["problems"][0]
    assert pool_cli(["pool", "status", "--pool", pool.url]) == 0


def test_publish_refuses_a_pool_that_evicts(fresh_pool, table):  # noqa: F811
    pool = fresh_pool(1)
    with PoolClient(pool.url) as client:
        client.each_node("CONFIG", "SET", "maxmemory", str(64 << 20))
        client.each_node("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    with pytest.raises(PoolError, match="evicts keys when full .*maxmemory-policy allkeys-lru.*set maxmemory-policy "
                                        "noeviction"):
        publish_table(table, pool.url, extent_rows=500, progress=False)
    with PoolClient(pool.url) as client:
        client.each_node("CONFIG", "SET", "maxmemory-policy", "noeviction")
    assert publish_table(table, pool.url, extent_rows=500, progress=False)["sent"] > 0
