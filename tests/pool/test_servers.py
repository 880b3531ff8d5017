"""Local Redis servers on 127.0.0.1: ports picked in range and outside the ephemeral range, a
node's start, failure and stop, a cluster over every slot, messages that say what to do."""

from __future__ import annotations

import io
import os
import random
import re
import signal
import socket
import threading
from pathlib import Path

import pytest

from engram_offload.pool import servers
from engram_offload.pool.client import PoolClient, PoolError
from engram_offload.pool.servers import (
    LocalPool,
    PortTakenError,
    RedisNode,
    ephemeral_ports,
    free_port_base,
    redis_server_missing,
    start_local_pool,
)

from redis_servers import skip_without_redis

OFFSET = servers.CLUSTER_BUS_OFFSET


class CountingRandom(random.Random):
    """A seeded ``random.Random`` that counts the ports it picked."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.picks = 0

    def randrange(self, *args, **kwargs) -> int:  # type: ignore[override]
        self.picks += 1
        return super().randrange(*args, **kwargs)


def only(base: int, nodes: int = 1) -> dict:
    """``free_port_base`` arguments whose one candidate is ``base``."""
    return {"low": base, "high": base + nodes + OFFSET + 1}


def test_without_redis_server_the_message_says_how_to_install(monkeypatch, tmp_path):
    found = tmp_path / "redis-server"  # any executable of that name on PATH will do
    found.write_text("#!/bin/sh\n")
    found.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert redis_server_missing() is None
    monkeypatch.setenv("PATH", "")
    said = "redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)"
    assert redis_server_missing() == said
    with pytest.raises(PoolError, match=f"^{re.escape(said)}$"):
        start_local_pool(1, None)
    with pytest.raises(ValueError, match="^nodes must be >= 1, got 0$"):
        start_local_pool(0, None)


def test_the_ephemeral_range_is_the_kernels_or_else_linuxs_default(monkeypatch):
    kernel = tuple(map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()))
    assert ephemeral_ports() == kernel
    def kernel_file(path, *args, **kwargs):  # a kernel whose range is not Linux's default
        if path != "/proc/sys/net/ipv4/ip_local_port_range":
            raise FileNotFoundError(path)
        return io.StringIO("40000\t50999\n")

    monkeypatch.setattr(servers, "open", kernel_file, raising=False)
    assert ephemeral_ports() == (40000, 50999)
    monkeypatch.setattr(servers, "open", lambda *a, **k: io.StringIO("not numbers"), raising=False)
    assert ephemeral_ports() == (32768, 60999)

    def unreadable(*args, **kwargs):
        raise PermissionError("no /proc here")

    monkeypatch.setattr(servers, "open", unreadable, raising=False)
    assert ephemeral_ports() == (32768, 60999)


def test_free_ports_and_their_bus_ports_lie_between_1024_and_65535_outside_the_ephemeral_range(monkeypatch):
    """Each case leaves ``free_port_base`` one candidate: taken when every port of it (the
    nodes' and their bus ports, +10000) is usable, else 400 picks and an error naming the range."""
    monkeypatch.setattr(servers, "ephemeral_ports", lambda: (20000, 21000))  # below the kernel's range
    usable = [(1024, 1), (55535, 1), (19999, 1), (21001, 1), (9999, 1), (11001, 1), (19998, 2), (21001, 3)]
    for base, nodes in usable:
        assert free_port_base(nodes, rng=random.Random(base), **only(base, nodes)) == base, (base, nodes)
    unusable = [(1023, 1), (55536, 1), (20000, 1), (21000, 1), (10000, 1), (11000, 1), (19999, 2), (19990, 11)]
    for base, nodes in unusable:
        rng = CountingRandom(base)
        low, high = only(base, nodes).values()
        with pytest.raises(PoolError, match=(rf"^found no {nodes} free ports \(and their bus ports\) between {low} "
                                             rf"and {high} outside the ephemeral range 20000-21000: give --port$")):
            free_port_base(nodes, rng=rng, **only(base, nodes))
        assert rng.picks == 400, (base, nodes)
    for seed in range(20):  # a range that is too small still yields its first port
        assert free_port_base(1, 5000, 5000, random.Random(seed)) == 5000
    monkeypatch.setattr(servers, "ephemeral_ports", lambda: (1, 65535))  # nothing usable: the default range is named
    with pytest.raises(PoolError, match=(r"^found no 1 free ports \(and their bus ports\) between 10000 and 65535 "
                                         r"outside the ephemeral range 1-65535: give --port$")):
        free_port_base(1)


def test_a_port_or_bus_port_in_use_is_not_picked(monkeypatch):
    base = free_port_base(2)
    monkeypatch.setattr(servers, "ephemeral_ports", lambda: (1, 1))
    for port in (base, base + 1, base + OFFSET, base + 1 + OFFSET):
        with socket.socket() as held:
            held.bind(("127.0.0.1", port))
            held.listen(1)
            with pytest.raises(PoolError, match="^found no 2 free ports"):
                free_port_base(2, rng=random.Random(0), **only(base, 2))
    assert free_port_base(2, rng=random.Random(0), **only(base, 2)) == base


def test_a_port_held_only_by_a_closed_connection_is_free():
    """A connection the server side closed waits in TIME_WAIT on the server's port: redis-server
    binds with SO_REUSEADDR, so the port counts as free."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    assert not servers._port_free(port)  # listening
    accepted.close()  # the server's end closes first: it is the one left in TIME_WAIT
    assert client.recv(1) == b""
    client.close()
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError):  # without SO_REUSEADDR the port is not to be had
        plain.bind(("127.0.0.1", port))
    assert servers._port_free(port)


def test_servers_started_with_die_with_parent_die_with_the_thread_that_started_them(tmp_path):
    """``PR_SET_PDEATHSIG`` fires when the thread that started the child ends (``pool serve``
    starts its servers on its main thread, so with the process)."""
    skip_without_redis()
    pools: list[LocalPool] = []
    thread = threading.Thread(target=lambda: pools.append(start_local_pool(1, None, tmp_path, die_with_parent=True)))
    thread.start()
    thread.join()
    [pool] = pools
    try:
        assert pool.nodes[0].process.wait(timeout=10) == -signal.SIGKILL  # at once; 10 s on a loaded machine
    finally:
        pool.stop()


def test_a_local_server_in_a_folder_of_its_own_is_gone_with_it_when_stopped():
    skip_without_redis()
    with start_local_pool(1, None) as pool:
        node, root = pool.nodes[0], pool.directory
        assert pool.cluster is False and node.cluster is False and root.name.startswith("engram-pool-")
        assert node.directory == root / f"node-{node.port}" and (node.directory / f"redis-{node.port}.log").exists()
        assert pool.url == node.url == f"redis://127.0.0.1:{node.port}"
        with PoolClient(pool.url) as client:
            assert client.call("SET", "k", b"v") == b"OK"
        pool.wait_ready(0.0)  # a plain server is ready at once
    assert node.process.returncode == 0 and not root.exists()  # stopped by SIGTERM, its folder removed


def test_a_password_is_asked_of_every_client_and_kept_off_the_command_line(tmp_path, no_key_file):
    skip_without_redis()
    with start_local_pool(1, None, tmp_path, password="s3cret") as pool:
        node = pool.nodes[0]
        assert "s3cret" not in repr(node)
        assert b"s3cret" not in Path(f"/proc/{node.process.pid}/cmdline").read_bytes()
        with pytest.raises(PoolError, match="NOAUTH"):
            PoolClient(pool.url)
        conn = node.connect(5.0)
        try:
            assert conn.call("PING") == b"PONG"
        finally:
            conn.close()
    assert tmp_path.exists()  # a folder it was given is left


def test_a_cluster_splits_the_slots_evenly_in_port_order(tmp_path):
    skip_without_redis()
    with start_local_pool(3, None, tmp_path) as pool:
        assert pool.cluster is True and all(n.cluster for n in pool.nodes)
        ports = [n.port for n in pool.nodes]
        assert ports == list(range(ports[0], ports[0] + 3))
        assert pool.url == "redis://" + ",".join(f"127.0.0.1:{p}" for p in ports)
        assert pool.directory == tmp_path and [n.directory for n in pool.nodes] == [tmp_path / f"node-{p}" for p in ports]
        assert not any(n.die_with_parent for n in pool.nodes)
        conn = pool.nodes[0].connect(5.0)
        try:
            slots = sorted((int(s[0]), int(s[1]), int(s[2][1])) for s in conn.call("CLUSTER", "SLOTS"))
        finally:
            conn.close()
        assert slots == [(0, 5460, ports[0]), (5461, 10921, ports[1]), (10922, 16383, ports[2])]
        assert all(servers._cluster_ok(n, 3) for n in pool.nodes)
        assert not servers._cluster_ok(pool.nodes[0], 2)
        pool.nodes[2].kill()
        assert pool.nodes[2].process.returncode == -signal.SIGKILL
        assert not servers._cluster_ok(pool.nodes[2], 3)  # nothing answers


def test_a_cluster_that_never_becomes_healthy_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(servers, "_cluster_ok", lambda node, nodes: False)
    pool = LocalPool([RedisNode(1, tmp_path, True)], True, tmp_path)
    with pytest.raises(PoolError, match=r"^the local cluster did not become healthy within 0.2 s$"):
        pool.wait_ready(0.2)


def test_a_cluster_missing_slots_is_not_healthy(tmp_path):
    """One node holding half the slots has the one range a one-node cluster has, but the cluster
    is not healthy until every slot is served."""
    skip_without_redis()
    node = RedisNode(free_port_base(1), tmp_path, True)
    node.start()
    try:
        conn = node.connect(5.0)
        try:
            assert not isinstance(conn.call("CLUSTER", "ADDSLOTSRANGE", 0, 8191), Exception)
            assert len(conn.call("CLUSTER", "SLOTS")) == 1
            assert not servers._cluster_ok(node, 1)
            assert not isinstance(conn.call("CLUSTER", "ADDSLOTSRANGE", 8192, servers.NUM_SLOTS - 1), Exception)
        finally:
            conn.close()
        LocalPool([node], True, tmp_path).wait_ready(20)  # healthy once every slot is served
        assert servers._cluster_ok(node, 1)
    finally:
        node.stop()


def test_a_port_answered_by_another_redis_server_is_an_error_naming_its_pid(tmp_path, monkeypatch):
    """The port was free when checked; before the node's own server binds it, another
    redis-server answers there. Its answer is not taken for the node's: the node's server is
    stopped and the error names the other's pid. (A stand-in that never binds plays the node's
    slow server; the check is made to pass, as in the race.)"""
    skip_without_redis()
    other = RedisNode(free_port_base(1), tmp_path / "other", False)
    other.start()
    try:
        slow = tmp_path / "bin" / "redis-server"  # reads its settings, then never binds
        slow.parent.mkdir()
        slow.write_text("#!/bin/sh\ncat > /dev/null\nexec sleep 60\n")
        slow.chmod(0o755)
        monkeypatch.setenv("PATH", f"{slow.parent}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setattr(servers, "_port_free", lambda *_: True)
        node = RedisNode(other.port, tmp_path / "node", False)
        with pytest.raises(PortTakenError) as taken:
            node.start(timeout=20)
        assert str(taken.value) == (f"port {other.port} on 127.0.0.1 is served by another redis-server "
                                    f"(pid {other.process.pid}), not the one started: choose another --port")
        assert node.process.poll() is not None  # the node's own server was stopped
        assert other.process.poll() is None
    finally:
        other.stop()


def test_a_plain_server_cannot_form_a_cluster(tmp_path):
    skip_without_redis()
    with start_local_pool(1, None, tmp_path) as pool:
        assert not servers._cluster_ok(pool.nodes[0], 1)  # CLUSTER INFO is an error reply
        with pytest.raises(PoolError, match=rf"^127.0.0.1:{pool.nodes[0].port}: CLUSTER ADDSLOTSRANGE failed: "
                                            ".*cluster support disabled"):
            servers._form_cluster(pool)


def test_a_server_that_exits_at_start_says_why(tmp_path):
    """A bad configuration line (here smuggled in through the password) stops redis-server
    before it answers: its own message is the error."""
    skip_without_redis()
    port = free_port_base(1)
    node = RedisNode(port, tmp_path, False, password="x\nno-such-directive yes")
    with pytest.raises(PoolError, match=rf"(?s)^redis-server on port {port} exited at start: .*no-such-directive") as e:
        node.start()
    assert type(e.value) is PoolError


def test_a_start_message_is_its_last_2000_characters_not_utf8_ones_replaced(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "redis-server"  # exits at once: 2,500 'a's, then a byte that is not UTF-8
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nhead -c 2500 /dev/zero | tr '\\0' a >&2\nprintf 'bad \\377 line\\n' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    port = free_port_base(1)
    with pytest.raises(PoolError, match=f"^redis-server on port {port} exited at start: a{{1990}}bad \ufffd line$"):
        RedisNode(port, tmp_path / "node", False).start()


def test_a_port_taken_between_the_check_and_the_bind_is_a_port_taken_error(tmp_path, monkeypatch):
    """The port is free when checked, then taken before redis-server binds it: redis-server
    exits, its log says why, and the error is a ``PortTakenError``."""
    skip_without_redis()
    monkeypatch.setattr(servers, "_port_free", lambda *_: True)
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port_base(1)))
        held.listen(1)
        port = held.getsockname()[1]
        node = RedisNode(port, tmp_path, False)
        with pytest.raises(PortTakenError, match=rf"(?s)^redis-server on port {port} exited at start: .*"
                                                 "Address already in use"):
            node.start()
    assert "Address already in use" in node.log_tail()


def test_a_server_that_never_answers_is_stopped_and_named(tmp_path, monkeypatch):
    skip_without_redis()

    def no_answer(self, timeout):
        raise ConnectionRefusedError("nothing answers")

    monkeypatch.setattr(RedisNode, "connect", no_answer)
    node = RedisNode(free_port_base(1), tmp_path, False)
    with pytest.raises(PoolError, match=rf"^redis-server on port {node.port} did not answer within 0.3 s$"):
        node.start(timeout=0.3)
    assert node.process.returncode == 0  # stopped (SIGTERM) before the error


def test_the_log_tail_is_the_last_2000_characters_of_a_log_that_may_not_exist(tmp_path):
    node = RedisNode(7001, tmp_path / "never-started", False)
    assert node.log_tail() == ""
    node.kill()  # nothing started: nothing to kill or stop
    node.stop()
    node.directory.mkdir()
    (node.directory / "redis-7001.log").write_bytes(b"a" * 1000 + b"\xff" + b"b" * 2500)
    tail = node.log_tail()
    assert tail == "b" * 2000
    (node.directory / "redis-7001.log").write_bytes(b"start \xff end")
    assert node.log_tail() == "start \ufffd end"


def test_a_stopped_node_is_not_healthy_and_is_asked_within_a_bound(tmp_path):
    """``_cluster_ok`` on a node that accepts connections but never answers gives False after
    its one-second timeout; forming a cluster with it fails after five seconds (the first
    ``CLUSTER ADDSLOTSRANGE`` times out), never hangs."""
    skip_without_redis()
    with start_local_pool(3, None, tmp_path) as pool:
        node = pool.nodes[0]
        node.process.send_signal(signal.SIGSTOP)
        try:
            result: list = []
            thread = threading.Thread(target=lambda: result.append(servers._cluster_ok(node, 3)), daemon=True)
            thread.start()
            thread.join(10)
            assert result == [False]
            errors: list = []

            def form() -> None:
                try:
                    servers._form_cluster(pool)
                except OSError as exc:
                    errors.append(exc)

            thread = threading.Thread(target=form, daemon=True)
            thread.start()
            thread.join(20)
            assert not thread.is_alive() and len(errors) == 1 and "timed out" in str(errors[0]), errors
        finally:
            node.process.send_signal(signal.SIGCONT)


def test_a_meet_the_first_node_refuses_is_an_error_naming_the_node(tmp_path):
    skip_without_redis()
    base = free_port_base(2)
    nodes = [RedisNode(base + i, tmp_path / f"node-{i}", True) for i in range(2)]
    pool = LocalPool(nodes, True, tmp_path)
    try:
        for node in nodes:
            node.start()
        conn = nodes[0].connect(5.0)
        try:
            assert conn.call("ACL", "SETUSER", "default", "-cluster|meet") == b"OK"
        finally:
            conn.close()
        with pytest.raises(PoolError, match=rf"^CLUSTER MEET 127.0.0.1:{base + 1} failed: NOPERM"):
            servers._form_cluster(pool)
    finally:
        pool.stop()


def test_two_nodes_are_a_cluster_on_the_port_given(tmp_path):
    skip_without_redis()
    port = free_port_base(2)
    with start_local_pool(2, port, tmp_path) as pool:
        assert pool.cluster is True and [n.port for n in pool.nodes] == [port, port + 1]
        conn = pool.nodes[1].connect(5.0)
        try:
            slots = sorted((int(s[0]), int(s[1]), int(s[2][1])) for s in conn.call("CLUSTER", "SLOTS"))
        finally:
            conn.close()
        assert slots == [(0, 8191, port), (8192, 16383, port + 1)]
    with start_local_pool(port=None, directory=tmp_path / "one") as pool:
        assert len(pool.nodes) == 1 and pool.cluster is False


def test_a_taken_port_is_retried_on_other_ports_only_when_none_was_given(monkeypatch):
    """Without a port, a ``PortTakenError`` (a port taken between the pick and the bind) starts
    over on other ports, 20 times at most; with a port it is the error at once."""
    calls: list[int] = []

    def taken_until(succeed_at: int):
        def start(nodes, port, directory, password, die_with_parent, host):
            calls.append(port)
            if len(calls) < succeed_at:
                raise PortTakenError(f"port {port} taken")
            return "started"
        return start

    monkeypatch.setattr(servers, "redis_server_missing", lambda: None)
    monkeypatch.setattr(servers, "_start", taken_until(3))
    assert start_local_pool(1, None) == "started" and len(calls) == 3
    calls.clear()
    with pytest.raises(PortTakenError, match="^port 7005 taken$"):
        start_local_pool(1, 7005)
    assert calls == [7005]
    calls.clear()
    monkeypatch.setattr(servers, "_start", taken_until(10 ** 6))
    with pytest.raises(PortTakenError):
        start_local_pool(1, None)
    assert len(calls) == servers.PORT_TRIES == 20


def test_stop_kills_a_server_that_ignores_sigterm_and_a_missing_folder_is_no_error(tmp_path):
    """A stopped process (SIGSTOP) keeps SIGTERM pending: after 5 s ``stop`` sends SIGKILL."""
    skip_without_redis()
    pool = start_local_pool(1, None)
    pool.nodes[0].process.send_signal(signal.SIGSTOP)
    done = threading.Thread(target=pool.stop, daemon=True)
    done.start()
    done.join(30)
    assert not done.is_alive() and pool.nodes[0].process.returncode == -signal.SIGKILL
    LocalPool([], False, tmp_path / "gone", own_directory=True).stop()  # its folder is gone already


def test_the_pid_in_info_server():
    assert servers._info_pid(b"# Server\r\nredis_version:7.0\r\nodd:\xff\r\nprocess_id:4242\r\n") == 4242
    assert servers._info_pid(b"# Server\r\nredis_version:7.0\r\n") is None


def test_a_cluster_node_needs_its_bus_port_free_and_a_plain_one_does_not(tmp_path):
    skip_without_redis()
    port = free_port_base(1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", port + OFFSET))
        held.listen(1)
        with pytest.raises(PortTakenError, match=(rf"^port {port + OFFSET} on 127.0.0.1 is taken by another process: "
                                                  "choose another --port$")):
            RedisNode(port, tmp_path / "cluster", True).start()
        plain = RedisNode(port, tmp_path / "deeper" / "plain", False)  # its folder and the one above are made
        try:
            plain.start()
            assert plain.process.poll() is None and (plain.directory / f"redis-{port}.log").exists()
        finally:
            plain.stop()
