"""``PoolClient`` against a real Redis server on 127.0.0.1."""

from __future__ import annotations

import signal
import socket
import threading
import time

import numpy as np
import pytest

from engram_offload.pool.client import NodeConnection, PoolClient, PoolError, key_slot, parse_pool_url, redact
from engram_offload.pool.key import KEY_ENV, PoolKeyError

from redis_servers import fresh_pool, migrate_slot, redis_cluster, redis_single  # noqa: F401 (fixtures)


def test_an_error_reply_names_a_bytes_key_as_text(redis_single):  # noqa: F811
    with PoolClient(redis_single.url) as client:
        client.call("SET", b"engram-test:counter", b"not a number")
        with pytest.raises(PoolError) as caught:
            client.call("INCR", b"engram-test:counter")
        client.call("DEL", b"engram-test:counter")
    message = str(caught.value)
    assert message.startswith("INCR engram-test:counter: "), message
    assert "not an integer" in message
    with PoolClient(redis_single.url) as client:  # a key that is not UTF-8: escaped, not an error of its own
        client.call("SET", b"engram-test:\xff", b"x")
        with pytest.raises(PoolError, match=r"^INCR engram-test:\\xff: .*not an integer"):
            client.call("INCR", b"engram-test:\xff")
        client.call("DEL", b"engram-test:\xff")


def test_scan_finds_the_keys_of_every_node(fresh_pool):  # noqa: F811
    pool = fresh_pool(3)
    with PoolClient(pool.url) as client:
        assert client.cluster is True and len(client.nodes) == 3
        assert client.owner.dtype == np.int32 and set(client.owner.tolist()) == {0, 1, 2}
        keys = [f"engram-scan:{i}".encode() for i in range(60)]
        assert {client.node_of(k) for k in keys} == {0, 1, 2}  # spread over the three nodes
        client.execute([("SET", k, b"v") for k in keys])
        client.call("SET", b"other:1", b"v")
        assert sorted(client.scan("engram-scan:*")) == sorted(keys)


def test_a_node_that_died_fails_each_node_naming_it(fresh_pool):  # noqa: F811
    pool = fresh_pool(1)
    with PoolClient(pool.url) as client:
        assert client.each_node("PING") == [b"PONG"]
        broken = client._conns[f"127.0.0.1:{pool.nodes[0].port}"]
        pool.nodes[0].kill()
        with pytest.raises(PoolError, match=f"^pool node 127.0.0.1:{pool.nodes[0].port} failed: "):
            client.each_node("PING")
        assert not client._conns and broken.sock.fileno() == -1  # the broken connection is dropped and closed
        with pytest.raises(PoolError, match=f"^cannot connect to 127.0.0.1:{pool.nodes[0].port}: "):
            client.each_node("PING")  # no connection to be had now


def test_a_node_that_died_fails_a_command_naming_it(fresh_pool):  # noqa: F811
    pool = fresh_pool(1)
    with PoolClient(pool.url) as client:
        assert client.call("SET", "engram-test:k", b"v") == b"OK"
        broken = client._conns[f"127.0.0.1:{pool.nodes[0].port}"]
        pool.nodes[0].kill()
        with pytest.raises(PoolError, match=f"^pool node 127.0.0.1:{pool.nodes[0].port} failed: "):
            client.call("GET", "engram-test:k")
        assert not client._conns and broken.sock.fileno() == -1


def test_a_stopped_node_times_out_within_the_bound(fresh_pool):  # noqa: F811
    """A node that accepts connections but never answers (a stopped process): each wait ends
    after the client's timeout with an error naming the node, never hangs."""
    pool = fresh_pool(1)
    with PoolClient(pool.url, timeout=0.5) as client:
        pool.nodes[0].process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(PoolError, match=f"^pool node 127.0.0.1:{pool.nodes[0].port} failed: "):
                client.call("GET", "engram-test:k")
        finally:
            pool.nodes[0].process.send_signal(signal.SIGCONT)


def test_the_slot_map_comes_from_the_first_seed_that_answers(redis_cluster):  # noqa: F811
    """A seed that refuses and one that accepts but never answers (within the client's
    timeout) are passed over; with no seed answering, the message lists why for each."""
    refusing = socket.socket()  # bound, not listening: connections are refused
    refusing.bind(("127.0.0.1", 0))
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    try:
        r, s = refusing.getsockname()[1], silent.getsockname()[1]
        with pytest.raises(PoolError, match=(rf"^no pool node answers \(cannot connect to 127.0.0.1:{r}: [^;]*refused; "
                                             rf"127.0.0.1:{s}: timed out\): is the pool running\?$")):
            PoolClient(f"redis://127.0.0.1:{r},127.0.0.1:{s}", timeout=0.5)
        with PoolClient(f"redis://127.0.0.1:{r},127.0.0.1:{s},127.0.0.1:{redis_cluster.nodes[0].port}",
                        timeout=0.5) as client:
            assert client.cluster is True and sorted(client.nodes) == [("127.0.0.1", n.port) for n in redis_cluster.nodes]
    finally:
        refusing.close()
        silent.close()


def test_a_peer_that_is_no_redis_server_or_hangs_up_is_a_connection_error_naming_it():
    """A listener that answers like an HTTP server, then one that reads the command and hangs
    up: each is a ``ConnectionError`` saying so, and a connection that got garbage fails again
    as one (its reader reset), never with an error of another kind."""
    http = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for reply in (http, b""):
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(reply)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        garbled = NodeConnection("127.0.0.1", port, 5.0)
        with pytest.raises(ConnectionError) as caught:
            garbled.call("PING")
        assert str(caught.value) == (f"127.0.0.1:{port} does not speak the Redis protocol (it sent {http[:40]!r}): "
                                     "is that port a Redis server's?")
        with pytest.raises(ConnectionError):
            garbled.call("PING")  # the peer is gone: a reset, or nothing read
        garbled.close()
        silent = NodeConnection("127.0.0.1", port, 5.0)
        with pytest.raises(ConnectionError, match=rf"^127.0.0.1:{port} closed the connection$"):
            silent.call("PING")
        silent.close()
        server.join(5.0)
        assert not server.is_alive()
    finally:
        listener.close()


# ---------------------------------------------------------------------- a slot being migrated (ASK)
def _owner_port(node, slot: int) -> int | None:
    """The port of the node that ``node`` says owns ``slot``."""
    conn = node.connect(5.0)
    try:
        entries = conn.call("CLUSTER", "SLOTS")
    finally:
        conn.close()
    return next((int(e[2][1]) for e in entries if int(e[0]) <= slot <= int(e[1])), None)


def _clients(node) -> int:
    """How many clients are connected to ``node`` (besides the one asking)."""
    conn = node.connect(5.0)
    try:
        return len(conn.call("CLIENT", "LIST").splitlines()) - 1
    finally:
        conn.close()


def _wait_until(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_keys_of_a_slot_being_migrated_are_read_where_they_are(fresh_pool):  # noqa: F811
    """Mid-reshard the slot's owner answers ``ASK`` for a key it has handed over: the client
    asks the importing node (after ``ASKING``), for reads, writes and pipelines alike."""
    pool = fresh_pool(3)
    moved, stays, new = b"{engram-ask}:moved", b"{engram-ask}:stays", b"{engram-ask}:new"
    slot = key_slot(moved)
    with PoolClient(pool.url) as client:
        client.call("SET", moved, b"handed over")
        client.call("SET", stays, b"still at the source")
        source, target, _, dst_id = migrate_slot(pool, slot)
        src = source.connect(5.0)
        try:
            assert src.call("MIGRATE", "127.0.0.1", target.port, moved, 0, 5000) == b"OK"
            assert str(src.call("GET", moved)).startswith("ASK")  # the source no longer has it
        finally:
            src.close()
        assert client.call("GET", moved) == b"handed over"
        assert client.call("GET", stays) == b"still at the source"
        assert client.call("SET", new, b"written mid-migration") == b"OK"  # a new key goes to the target
        assert client.execute([("GET", moved), ("GET", stays), ("STRLEN", new)]) == [
            b"handed over", b"still at the source", len(b"written mid-migration")]
        clients = _clients(target)
        for _ in range(5):  # the connection to the importing node is kept and used again
            assert client.call("GET", moved) == b"handed over"
        assert _clients(target) == clients
        tgt = target.connect(5.0)
        try:
            assert tgt.call("ASKING") == b"OK" and tgt.call("GET", new) == b"written mid-migration"
        finally:
            tgt.close()
        src = source.connect(5.0)
        try:  # the rest of the slot's keys move too
            assert src.call("MIGRATE", "127.0.0.1", target.port, stays, 0, 5000) == b"OK"
        finally:
            src.close()
        # the migration ends: the new owner first, then the old, then the others (as redis-cli
        # does); once every node says so, the old owner answers MOVED and the map is re-read
        for node in [target, source, *(n for n in pool.nodes if n not in (source, target))]:
            conn = node.connect(5.0)
            try:
                assert conn.call("CLUSTER", "SETSLOT", slot, "NODE", dst_id) == b"OK"
            finally:
                conn.close()
        assert _wait_until(lambda: all(_owner_port(node, slot) == target.port for node in pool.nodes))
        assert client.execute([("GET", moved), ("GET", stays), ("GET", new)]) == [
            b"handed over", b"still at the source", b"written mid-migration"]
        assert client.address(client.node_of(moved)) == f"127.0.0.1:{target.port}"


def test_a_plain_server_is_one_node_and_never_one_of_several(redis_single):  # noqa: F811
    with PoolClient(redis_single.url) as client:
        assert client.cluster is False and client.nodes == [("127.0.0.1", redis_single.nodes[0].port)]
        assert client.timeout == 5.0  # the default
        assert client.owner.min() == client.owner.max() == 0
        assert client.owner.dtype == np.int32 and client.owner.shape == (16384,)  # the remote tier indexes by it
    port = redis_single.nodes[0].port
    with pytest.raises(PoolError, match=(rf"^127.0.0.1:{port} is a plain Redis server, not a cluster node: give one "
                                         r"plain server, or the nodes of a Redis Cluster$")):
        PoolClient(f"{redis_single.url},127.0.0.1:{port}")


def test_a_cluster_missing_a_slot_is_refused(fresh_pool):  # noqa: F811
    pool = fresh_pool(3)
    conn = pool.nodes[0].connect(5.0)
    try:
        assert conn.call("CLUSTER", "DELSLOTS", 0, 1) == b"OK"
    finally:
        conn.close()
    with pytest.raises(PoolError, match=(rf"^the cluster at 127.0.0.1:{pool.nodes[0].port} does not cover all 16384 "
                                         r"slots \(2 unassigned\): fix the cluster \(redis-cli --cluster fix\)$")):
        PoolClient(f"redis://127.0.0.1:{pool.nodes[0].port}")


def test_without_the_redis_packages_the_message_says_what_to_install(monkeypatch):
    import sys

    from engram_offload.pool import client as client_module

    monkeypatch.setitem(sys.modules, "redis.crc", None)
    with pytest.raises(ImportError, match=r"^the pooled tier needs the 'redis' package: pip install "
                                          r"'engram-offload\[pool\]'$"):
        key_slot("k")
    monkeypatch.setitem(sys.modules, "hiredis", None)
    with pytest.raises(ImportError, match=r"^the pooled tier needs the 'hiredis' and 'redis' packages: pip install "
                                          r"'engram-offload\[pool\]'$"):
        client_module._import_hiredis()


# ---------------------------------------------------------------------- pool URLs
A, B = ("127.0.0.1", 7001), ("127.0.0.1", 7002)


@pytest.mark.parametrize("url, seeds, fp, auth", [
    ("redis://127.0.0.1:7001", [A], None, None),
    (["redis://127.0.0.1:7001", "127.0.0.1:7002"], [A, B], None, None),
    ("redis://127.0.0.1:7001, ,127.0.0.1:7002", [A, B], None, None),
    (",127.0.0.1:7001", [A], None, None),  # an empty first part: the scheme is asked of the first address
    ("redis://127.0.0.1:7001,127.0.0.1:7002/0123456789abcdef", [A, B], "0123456789abcdef", None),
    ("redis://alice:s3cret@127.0.0.1:7001", [A], None, ("alice", "s3cret")),
    ("redis://:s3cret@127.0.0.1:7001", [A], None, (None, "s3cret")),
    ("redis://127.0.0.1:1,127.0.0.1:65535", [("127.0.0.1", 1), ("127.0.0.1", 65535)], None, None),
    ("redis://[::1]:7001,[::1]:7002", [("::1", 7001), ("::1", 7002)], None, None),  # the port after the last colon
])
def test_pool_urls_name_their_seeds_table_and_credentials(monkeypatch, no_key_file, url, seeds, fp, auth):
    monkeypatch.delenv("ENGRAM_OFFLOAD_POOL_PASSWORD", raising=False)
    assert parse_pool_url(url) == (seeds, fp, auth)


@pytest.mark.parametrize("url, said", [
    ("", "no pool address in '': use redis://host:port[,host:port...]"),
    (" , ", "no pool address in ' , ': use redis://host:port[,host:port...]"),
    ("redis://u:pw@127.0.0.1", "pool address 'redis://u:***@127.0.0.1' lacks a host and port: use redis://host:port"),
    ("redis://127.0.0.1:7x1", "pool address 'redis://127.0.0.1:7x1' lacks a port number: use redis://host:port (a "
                              "password with '/', '@' or ':' is written percent-encoded)"),
    ("redis://127.0.0.1:70 01", "pool address 'redis://127.0.0.1:70 01' lacks a port number: use redis://host:port (a "
                                "password with '/', '@' or ':' is written percent-encoded)"),
    # a password with an unencoded '@' and ':': the address is what follows the last '@'
    ("redis://u:a@b:c@127.0.0.1", "pool address 'redis://u:***@127.0.0.1' lacks a host and port: use redis://host:port"),
    ("redis://127.0.0.1:0", "pool address 'redis://127.0.0.1:0': port 0 is out of range (1-65535)"),
    ("redis://127.0.0.1:65536", "pool address 'redis://127.0.0.1:65536': port 65536 is out of range (1-65535)"),
    ("http://127.0.0.1:7001", "pool address 'http://127.0.0.1:7001' is not a redis:// URL "
                              "(redis://host:port[,host:port...])"),
])
def test_bad_pool_urls_say_exactly_what_is_wrong(url, said):
    with pytest.raises(ValueError) as caught:
        parse_pool_url(url)
    assert str(caught.value) == said


def test_the_password_comes_from_the_url_else_the_environment_else_the_key_file(monkeypatch, tmp_path):
    key = tmp_path / "pool.key"
    key.write_text(f"password from-file\nkey {'ab' * 32}\n")
    key.chmod(0o600)
    monkeypatch.setenv(KEY_ENV, str(key))
    monkeypatch.delenv("ENGRAM_OFFLOAD_POOL_PASSWORD", raising=False)
    assert parse_pool_url("redis://127.0.0.1:7001")[2] == (None, "from-file")
    monkeypatch.setenv("ENGRAM_OFFLOAD_POOL_PASSWORD", "from-env")
    assert parse_pool_url("redis://127.0.0.1:7001")[2] == (None, "from-env")
    assert parse_pool_url("redis://bob:in-url@127.0.0.1:7001")[2] == ("bob", "in-url")
    key.chmod(0o644)  # a key file others may read is never believed, not even for the password
    monkeypatch.delenv("ENGRAM_OFFLOAD_POOL_PASSWORD")
    with pytest.raises(PoolKeyError, match=f"^the pool key file {key} must be yours and closed to other users"):
        parse_pool_url("redis://127.0.0.1:7001")


@pytest.mark.parametrize("url, shown", [
    ("redis://u:pw@127.0.0.1:7001", "redis://u:***@127.0.0.1:7001"),
    ("redis://u:p:w@127.0.0.1:7001", "redis://u:***@127.0.0.1:7001"),
    ("redis://u:a@b@127.0.0.1:7001", "redis://u:***@127.0.0.1:7001"),  # an '@' in the password
    ("redis://user@127.0.0.1:7001", "redis://user@127.0.0.1:7001"),  # no password
    ("redis://127.0.0.1:7001", "redis://127.0.0.1:7001"),
    (["redis://:pw@127.0.0.1:7001", "127.0.0.1:7002"], "redis://:***@127.0.0.1:7001,127.0.0.1:7002"),
    ("redis://:x@127.0.0.1:7001,redis://:y@127.0.0.1:7002", "redis://:***@127.0.0.1:7001,redis://:***@127.0.0.1:7002"),
    ("redis://127.0.0.1:7001,u:pw@127.0.0.1:7002", "redis://127.0.0.1:7001,u:***@127.0.0.1:7002"),  # no scheme
    ("redis://u:p://w@127.0.0.1:7001", "redis://u:***@127.0.0.1:7001"),  # a '://' in the password
])
def test_redact_hides_every_password(url, shown):
    assert redact(url) == shown


def test_a_bad_url_with_a_scheme_in_its_password_never_shows_the_password(monkeypatch, no_key_file):
    monkeypatch.delenv("ENGRAM_OFFLOAD_POOL_PASSWORD", raising=False)
    with pytest.raises(ValueError) as caught:
        parse_pool_url("redis://u:p://w@127.0.0.1:7001")
    assert str(caught.value) == "pool address 'redis://u:***@127.0.0.1:7001' lacks a host and port: use redis://host:port"


# ---------------------------------------------------------------------- redirections, scripted
# Each plain server answers this script with the reply stored under engram-test:reply; one
# that starts with '!' comes back as an error reply ('!ASK 1 127.0.0.1:port': an ASK).
SCRIPTED = ("local r = redis.call('GET', 'engram-test:reply') "
            "if string.sub(r, 1, 1) == '!' then return redis.error_reply(string.sub(r, 2)) end return r")


def _set_reply(node, reply: str) -> None:
    """Store ``reply`` for ``SCRIPTED`` on ``node`` and zero its command counts."""
    conn = node.connect(5.0)
    try:
        assert conn.call("SET", "engram-test:reply", reply) == b"OK"
        assert conn.call("CONFIG", "RESETSTAT") == b"OK"
    finally:
        conn.close()


def _evals(node) -> int:
    """How many scripts ``node`` ran since its last ``_set_reply``."""
    conn = node.connect(5.0)
    try:
        stats = conn.call("INFO", "commandstats").decode()
    finally:
        conn.close()
    line = next((s for s in stats.splitlines() if s.startswith("cmdstat_eval:")), "cmdstat_eval:calls=0,")
    return int(line.split("calls=")[1].split(",")[0])


def test_an_ask_goes_to_the_node_named_with_the_clients_credentials_and_timeout(fresh_pool):  # noqa: F811
    """Two password-protected servers; the first answers ASK naming the second. The client asks
    the second (a connection of its own, authenticated, kept for the next ASK); when that one
    answers MOVED, the map is re-read and the command retried, three times in all."""
    first, second = fresh_pool(1), fresh_pool(1)
    a, b = first.nodes[0], second.nodes[0]
    for node in (a, b):
        with PoolClient(node.url) as plain:
            plain.call("CONFIG", "SET", "requirepass", "pw")
        node.password = "pw"
    _set_reply(a, f"!ASK 1 127.0.0.1:{b.port}")
    _set_reply(b, "served by the importing node")
    with PoolClient(f"redis://:pw@127.0.0.1:{a.port}", timeout=0.5) as client:
        assert client.call("EVAL", SCRIPTED, 0) == b"served by the importing node"
        asked = client._conns[f"127.0.0.1:{b.port}"]
        assert client.execute([("EVAL", SCRIPTED, 0), ("EVAL", SCRIPTED, "0")]) == [
            b"served by the importing node"] * 2
        assert client._conns[f"127.0.0.1:{b.port}"] is asked and len(client._conns) == 2
        assert (_evals(a), _evals(b)) == (3, 3)

        _set_reply(a, f"!ASK 1 127.0.0.1:{b.port}")
        _set_reply(b, f"!MOVED 1 127.0.0.1:{a.port}")
        with pytest.raises(PoolError, match=(r"^keys keep moving between nodes \(last: local r = .* end return r\): "
                                             r"is the cluster resharding\?$")):
            client.call("EVAL", SCRIPTED, 0)
        assert (_evals(a), _evals(b)) == (3, 3)  # three tries, each asked on

        _set_reply(a, f"!ASK 1 127.0.0.1:{b.port}")
        _set_reply(b, f"!ASK 1 127.0.0.1:{a.port}")  # the importing node hands the slot on: the map is re-read
        with pytest.raises(PoolError, match=r"^keys keep moving between nodes \(last: local r = "):
            client.call("EVAL", SCRIPTED, 0)
        assert (_evals(a), _evals(b)) == (3, 3)

        _set_reply(b, "served by the importing node")
        b.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(PoolError, match=(rf"^pool node 127.0.0.1:{b.port} \(asked to serve a migrating "
                                                 r"slot\) failed: ")):
                client.call("EVAL", SCRIPTED, 0)
            assert time.monotonic() - started < 4.0  # the client's timeout, not a hang
            assert f"127.0.0.1:{b.port}" not in client._conns  # the connection is dropped
        finally:
            b.process.send_signal(signal.SIGCONT)
        assert client.call("EVAL", SCRIPTED, 0) == b"served by the importing node"  # a new connection
        b.kill()
        for said in ("", f"cannot connect to 127.0.0.1:{b.port}: "):  # the kept connection fails, then a new one
            with pytest.raises(PoolError, match=(rf"^pool node 127.0.0.1:{b.port} \(asked to serve a migrating "
                                                 rf"slot\) failed: {said}")):
                client.call("EVAL", SCRIPTED, 0)
            assert list(client._conns) == [f"127.0.0.1:{a.port}"]


@pytest.mark.parametrize("reply", ["FOO 1 127.0.0.1:7001", "ASK 1", "ASK 1 127.0.0.1:7001 x", "MOVEDX 1 2"])
def test_an_error_that_is_no_redirection_is_the_reply(redis_single, reply):  # noqa: F811
    _set_reply(redis_single.nodes[0], "!" + reply)
    with PoolClient(redis_single.url) as client:
        assert str(client.execute([("EVAL", SCRIPTED, 0)])[0]) == reply
        with pytest.raises(PoolError, match=f"^EVAL local r = .*: {reply}$"):
            client.call("EVAL", SCRIPTED, 0)
        assert len(client._conns) == 1
    _set_reply(redis_single.nodes[0], "")


def test_an_ask_naming_no_port_fails_naming_it(redis_single):  # noqa: F811
    _set_reply(redis_single.nodes[0], "!ASK 1 nowhere")
    with PoolClient(redis_single.url) as client:
        with pytest.raises(PoolError, match=r"^pool node nowhere \(asked to serve a migrating slot\) failed: "):
            client.call("EVAL", SCRIPTED, 0)
    _set_reply(redis_single.nodes[0], "")


def test_an_ask_naming_an_ipv6_address_takes_the_port_after_its_last_colon(redis_single):  # noqa: F811
    """The server binds 127.0.0.1 only: its port on ::1 refuses, and the message names the
    address the ASK gave, parsed as host ::1 and that port."""
    port = redis_single.nodes[0].port
    _set_reply(redis_single.nodes[0], f"!ASK 1 ::1:{port}")
    with PoolClient(redis_single.url) as client:
        with pytest.raises(PoolError, match=(rf"^pool node ::1:{port} \(asked to serve a migrating slot\) failed: "
                                             rf"cannot connect to ::1:{port}: ")):
            client.call("EVAL", SCRIPTED, 0)
    _set_reply(redis_single.nodes[0], "")


def test_a_cluster_slots_refused_names_the_node_and_the_reply(redis_single, monkeypatch):  # noqa: F811
    monkeypatch.delenv("ENGRAM_OFFLOAD_POOL_PASSWORD", raising=False)
    port = redis_single.nodes[0].port
    with PoolClient(redis_single.url) as client:
        assert client.call("ACL", "SETUSER", "carol", "on", ">pw3", "~*", "+@all", "-cluster") == b"OK"
    with pytest.raises(PoolError, match=(rf"^127.0.0.1:{port}: CLUSTER SLOTS failed: NOPERM .*no permissions "
                                         r"to run the 'cluster\|slots' command$")):
        PoolClient(f"redis://carol:pw3@127.0.0.1:{port}")


def test_keys_of_every_argument_type_go_to_the_node_that_owns_them(redis_cluster):  # noqa: F811
    """A key is hashed as Redis receives it: an integer as its digits, a bytes-like one as its bytes."""
    ints = list(range(1000, 1012))
    arrays = [bytearray(b"engram-type:%d" % i) for i in range(12)]
    views = [memoryview(b"engram-type-view:%d" % i) for i in range(12)]
    with PoolClient(redis_cluster.url) as client:
        assert {client.node_of(str(k)) for k in ints} == {client.node_of(bytes(k)) for k in arrays + views} == {0, 1, 2}
        keys = [*ints, *arrays, *views]
        values = [b"v%d" % n for n in range(len(keys))]
        assert client.execute([("SET", k, v) for k, v in zip(keys, values)]) == [b"OK"] * len(keys)
        assert client.execute([("GET", k) for k in keys]) == values
        assert client.execute([("GET", str(k)) for k in ints]) == values[:12]
        assert client.execute([("GET", bytes(k)) for k in arrays + views]) == values[12:]
        assert client.call("GET", 1000) == b"v0" and client.call("GET", bytearray(b"engram-type:0")) == b"v12"
        client.execute([("DEL", k) for k in keys])


def test_credentials_name_their_user_and_a_refusal_says_so(fresh_pool, monkeypatch, no_key_file):  # noqa: F811
    monkeypatch.delenv("ENGRAM_OFFLOAD_POOL_PASSWORD", raising=False)
    pool = fresh_pool(1)
    port = pool.nodes[0].port
    with PoolClient(pool.url) as client:
        assert client.call("ACL", "SETUSER", "alice", "on", ">pw2", "~*", "+@all") == b"OK"
        client.call("CONFIG", "SET", "requirepass", "pw")
    with PoolClient(f"redis://alice:pw2@127.0.0.1:{port}") as client:
        assert client.call("ACL", "WHOAMI") == b"alice"
    with PoolClient(f"redis://:pw@127.0.0.1:{port}") as client:
        assert client.call("ACL", "WHOAMI") == b"default"
    monkeypatch.setenv("ENGRAM_OFFLOAD_POOL_PASSWORD", "pw")
    with PoolClient(f"redis://127.0.0.1:{port}") as client:
        assert client.call("ACL", "WHOAMI") == b"default"
    for url in (f"redis://:pw2@127.0.0.1:{port}", f"redis://bob:pw@127.0.0.1:{port}"):
        with pytest.raises(PoolError, match=(rf"^127.0.0.1:{port} refused the credentials \(the pool URL's, else "
                                             r"\$ENGRAM_OFFLOAD_POOL_PASSWORD's, else the pool key file's\): "
                                             "WRONGPASS invalid username-password pair")):
            PoolClient(url)


def test_the_key_files_password_opens_a_pool_that_asks_for_it_and_one_that_does_not(fresh_pool, monkeypatch,  # noqa: F811
                                                                                    pool_key):
    monkeypatch.delenv("ENGRAM_OFFLOAD_POOL_PASSWORD", raising=False)
    pool = fresh_pool(1)
    with PoolClient(pool.url) as client:  # AUTH with the file's password: this server has none, and says so
        assert client.call("ACL", "WHOAMI") == b"default"
        client.call("CONFIG", "SET", "requirepass", pool_key.password)
    with PoolClient(pool.url) as client:
        assert client.call("ACL", "WHOAMI") == b"default"
    monkeypatch.setenv(KEY_ENV, "/nonexistent/pool.key")
    with pytest.raises(PoolError, match="NOAUTH"):
        PoolClient(pool.url)


def test_commands_whose_key_is_not_the_first_argument_name_it(fresh_pool):  # noqa: F811
    """``keys=`` routes each command; a seed named ``localhost`` still lists the nodes by the
    address the cluster gives; a node that forgot a slot right after a range leaves it unassigned."""
    pool = fresh_pool(3)
    keys = [f"engram-keys:{i}".encode() for i in range(12)]
    with PoolClient(pool.url) as client:
        assert {client.node_of(k) for k in keys} == {0, 1, 2}
        client.execute([("SET", k, k + b"!") for k in keys])
        script = "return redis.call('GET', KEYS[1])"
        assert client.execute([("EVAL", script, 1, k) for k in keys], keys=keys) == [k + b"!" for k in keys]
    with PoolClient(f"redis://localhost:{pool.nodes[1].port}") as client:
        assert sorted(client.nodes) == [("127.0.0.1", n.port) for n in pool.nodes]
    node = pool.nodes[1]
    conn = node.connect(5.0)
    try:
        first = min(int(e[0]) for e in conn.call("CLUSTER", "SLOTS") if int(e[2][1]) == node.port)
        assert first > 0 and conn.call("CLUSTER", "DELSLOTS", first) == b"OK"  # the slot after another node's range
        held = sum(int(e[1]) - int(e[0]) + 1 for e in conn.call("CLUSTER", "SLOTS"))
    finally:
        conn.close()
    with pytest.raises(PoolError, match=rf"does not cover all 16384 slots \({16384 - held} unassigned\)"):
        PoolClient(f"redis://127.0.0.1:{node.port}")
