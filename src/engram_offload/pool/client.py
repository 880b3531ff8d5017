"""A small Redis (Cluster) client: RESP encoded by hand, replies parsed by ``hiredis``.

``PoolClient`` knows the pool's nodes and which node serves each of the 16,384 slots
(from ``CLUSTER SLOTS``; a plain Redis server serves them all), sends each node one
pipeline, follows ``MOVED`` by re-reading the slot map and ``ASK`` (a slot being migrated)
by asking the node named once, after ``ASKING``. The remote tier uses
``NodeConnection`` and the slot map directly for its hot path.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Iterable, Sequence
from urllib.parse import urlsplit

import numpy as np

from ..errors import TierError
from .key import read_key_password

__all__ = ["PoolError", "NodeConnection", "PoolClient", "encode_command", "parse_pool_url", "redact",
           "key_slot"]

NUM_SLOTS = 16384
RECV_BYTES = 1 << 20
PASSWORD_ENV = "ENGRAM_OFFLOAD_POOL_PASSWORD"  # the password when the URL has none (kept off command lines)


class PoolError(TierError):
    """The pool cannot be reached, or holds no complete copy of the table asked for."""


def _import_hiredis():
    try:
        import hiredis
    except ImportError:
        raise ImportError(
            "the pooled tier needs the 'hiredis' and 'redis' packages: pip install 'engram-offload[pool]'"
        ) from None
    return hiredis


def key_slot(key: str | bytes) -> int:
    """The Redis Cluster slot of ``key`` (CRC16 of its hash tag, or of the whole key)."""
    try:
        from redis.crc import key_slot as slot
    except ImportError:
        raise ImportError("the pooled tier needs the 'redis' package: pip install 'engram-offload[pool]'") from None
    return slot(key.encode() if isinstance(key, str) else key)


Arg = str | bytes | bytearray | memoryview | int  # a command argument; bytes-like ones are sent as they are


def _shown(arg: Arg) -> str:
    """A command argument or key as text for a message (bytes decoded, not ``b'...'``)."""
    if isinstance(arg, (bytes, bytearray, memoryview)):
        return bytes(arg).decode(errors="backslashreplace")
    return str(arg)


def _key(arg: Arg) -> str | bytes:
    """A command's key as Redis receives it, for ``key_slot``: bytes-like ones as their bytes,
    others (``str``, ``int``) as their text."""
    return bytes(arg) if isinstance(arg, (bytes, bytearray, memoryview)) else str(arg)


def encode_command(*args: Arg) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, (bytes, bytearray, memoryview)) else str(arg).encode()
        parts.append(b"$%d\r\n" % len(data))
        parts.append(bytes(data))
        parts.append(b"\r\n")
    return b"".join(parts)


Auth = tuple[str | None, str]  # (ACL user or None, password)


def parse_pool_url(url: str | Sequence[str]) -> tuple[list[tuple[str, int]], str | None, Auth | None]:
    """``redis://[[user]:password@]host:port[,host:port...][/FINGERPRINT]`` -> (seed
    addresses, fingerprint or None, credentials or None). Without a password in the URL,
    ``$ENGRAM_OFFLOAD_POOL_PASSWORD`` is used when set, else the pool key file's
    (``key.key_path``) when there is one. Messages never show a password."""
    text = url if isinstance(url, str) else ",".join(url)
    seeds: list[tuple[str, int]] = []
    fp: str | None = None
    auth: Auth | None = None
    for i, part in enumerate(text.split(",")):
        part = part.strip()
        if not part:
            continue
        shown = redact(part)
        if "://" not in part:
            if not seeds and i == 0:
                raise ValueError(f"pool address {shown!r} lacks its scheme: use redis://{shown}")
            part = "redis://" + part
        split = urlsplit(part)
        if split.scheme != "redis":
            raise ValueError(f"pool address {shown!r} is not a redis:// URL (redis://host:port[,host:port...])")
        host = split.hostname
        port_text = split.netloc.rsplit("@", 1)[-1].rpartition(":")[2] if ":" in split.netloc.rsplit("@", 1)[-1] else ""
        if not host or not port_text:
            raise ValueError(f"pool address {shown!r} lacks a host and port: use redis://host:port")
        if not port_text.isdigit():
            raise ValueError(f"pool address {shown!r} lacks a port number: use redis://host:port (a password "
                             "with '/', '@' or ':' is written percent-encoded)")
        if not 1 <= int(port_text) <= 65535:
            raise ValueError(f"pool address {shown!r}: port {int(port_text)} is out of range (1-65535)")
        seeds.append((host, int(port_text)))
        if split.password is not None:
            auth = (split.username or None, split.password)
        path = split.path.strip("/")
        if path:
            fp = path
    if not seeds:
        raise ValueError(f"no pool address in {redact(text)!r}: use redis://host:port[,host:port...]")
    if auth is None and os.environ.get(PASSWORD_ENV):
        auth = (None, os.environ[PASSWORD_ENV])
    if auth is None:
        password = read_key_password()
        auth = (None, password) if password else None
    return seeds, fp, auth


def redact(url: str | Sequence[str]) -> str:
    """``url`` with any password replaced by ``***`` (for messages)."""
    text = url if isinstance(url, str) else ",".join(url)
    return ",".join(_redact_part(part) for part in text.split(","))


def _redact_part(part: str) -> str:
    # the scheme ends at the first "://" (a password may hold one, unencoded)
    scheme, sep, rest = part.partition("://") if "://" in part else ("", "", part)
    userinfo, at, hostpart = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return part
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{hostpart}"


class _Unanswered(ConnectionError):
    """A node that took the connection and did not answer its first command (AUTH)."""


class NodeConnection:
    """One socket to one Redis node, with its own ``hiredis.Reader``."""

    def __init__(self, host: str, port: int, timeout: float, auth: Auth | None = None) -> None:
        self.address = f"{host}:{port}"
        self._reader = _import_hiredis().Reader()
        self._buf = bytearray(RECV_BYTES)
        self._view = memoryview(self._buf)
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ConnectionError(f"cannot connect to {self.address}: {exc}") from exc
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if auth is not None:
            user, password = auth
            try:
                reply = self.call("AUTH", *([user] if user else []), password)
            except OSError as exc:
                self.close()
                raise _Unanswered(f"{self.address}: {exc}") from exc  # as a silent node's first command
            if isinstance(reply, Exception) and "without any password configured" not in str(reply):
                self.close()
                raise PoolError(f"{self.address} refused the credentials (the pool URL's, else ${PASSWORD_ENV}'s, "
                                f"else the pool key file's): {reply}")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_replies(self, n: int) -> list:
        """The next ``n`` replies; error replies come back as ``hiredis.ReplyError`` objects.

        The reader is first fed an array header of ``n`` elements, so hiredis parses the
        ``n`` replies as one array in C (a Python call per reply costs more than the parse).
        """
        reader, recv = self._reader, self.sock.recv_into
        reader.feed(b"*%d\r\n" % n)
        got = 0
        while True:
            try:
                replies = reader.gets()
            except _import_hiredis().ProtocolError:
                self._reader = _import_hiredis().Reader()  # its state is lost; the caller drops the socket
                sent = bytes(self._view[: min(got, 40)])
                raise ConnectionError(f"{self.address} does not speak the Redis protocol (it sent {sent!r}): "
                                      "is that port a Redis server's?") from None
            if replies is not False:
                return replies
            got = recv(self._buf)
            if not got:
                raise ConnectionError(f"{self.address} closed the connection")
            reader.feed(self._view, 0, got)

    def call(self, *args: Arg):
        self.send(encode_command(*args))
        return self.read_replies(1)[0]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class PoolClient:
    """The pool's nodes and slot map; pipelines commands to the nodes owning their keys.

    ``urls``: ``redis://host:port[,host:port...]`` (any node of a cluster will do, several
    give a fallback for discovery). Not thread-safe, except ``slot_owners``/``refresh``.
    """

    def __init__(self, urls: str | Sequence[str], timeout: float = 5.0) -> None:
        self.seeds, self.url_fingerprint, self.auth = parse_pool_url(urls)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._conns: dict[str, NodeConnection] = {}
        self.nodes: list[tuple[str, int]] = []
        self.cluster = False
        self.owner = np.zeros(NUM_SLOTS, np.int32)  # slot -> index in self.nodes
        self.refresh()

    # -- topology -----------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the slot map from the first reachable seed or known node."""
        with self._lock:
            errors = []
            for host, port in dict.fromkeys([*self.seeds, *self.nodes]):
                try:
                    conn = NodeConnection(host, port, self.timeout, self.auth)
                except ConnectionError as exc:
                    errors.append(str(exc))
                    continue
                try:
                    reply = conn.call("CLUSTER", "SLOTS")
                except OSError as exc:
                    errors.append(f"{host}:{port}: {exc}")
                    continue
                finally:
                    conn.close()
                self._set_slots(host, port, reply)
                return
            raise PoolError(f"no pool node answers ({'; '.join(errors)}): is the pool running?")

    def _set_slots(self, host: str, port: int, reply) -> None:
        if isinstance(reply, Exception):
            if "cluster support disabled" not in str(reply):
                raise PoolError(f"{host}:{port}: CLUSTER SLOTS failed: {reply}")
            if len(self.seeds) > 1:
                raise PoolError(
                    f"{host}:{port} is a plain Redis server, not a cluster node: give one plain server, "
                    "or the nodes of a Redis Cluster"
                )
            self.cluster, self.nodes = False, [(host, port)]
            self.owner = np.zeros(NUM_SLOTS, np.int32)
            return
        nodes: dict[tuple[str, int], int] = {}
        owner = np.full(NUM_SLOTS, -1, np.int32)
        for entry in reply:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            address = ((master[0].decode() or host), int(master[1]))  # "" means: the node asked
            owner[start: end + 1] = nodes.setdefault(address, len(nodes))
        if (owner < 0).any():
            raise PoolError(
                f"the cluster at {host}:{port} does not cover all {NUM_SLOTS} slots "
                f"({int((owner < 0).sum())} unassigned): fix the cluster (redis-cli --cluster fix)"
            )
        self.cluster, self.nodes, self.owner = True, list(nodes), owner

    def address(self, node: int) -> str:
        host, port = self.nodes[node]
        return f"{host}:{port}"

    def node_of(self, key: str | bytes) -> int:
        return int(self.owner[key_slot(key)])

    # -- commands -----------------------------------------------------------------------
    def connection(self, node: int) -> NodeConnection:
        address = self.address(node)
        conn = self._conns.get(address)
        if conn is None:
            try:
                conn = self._conns[address] = NodeConnection(*self.nodes[node], self.timeout, self.auth)
            except _Unanswered as exc:  # as a command it did not answer
                raise PoolError(f"pool node {address} failed: {exc.__cause__}") from exc
            except ConnectionError as exc:
                raise PoolError(str(exc)) from exc
        return conn

    def execute(self, commands: Sequence[tuple], keys: Sequence[str | bytes] | None = None) -> list:
        """Run ``commands`` (argument tuples, first key at position 1 unless ``keys`` says)
        pipelined per node; replies in order. ``MOVED`` re-reads the slot map and retries;
        ``ASK`` (the key's slot is migrating and the key has moved) sends the command to the
        node named, after ``ASKING``."""
        keys = [_key(c[1]) for c in commands] if keys is None else keys
        replies: list = [None] * len(commands)
        todo = list(range(len(commands)))
        for _attempt in range(3):
            by_node: dict[int, list[int]] = {}
            for i in todo:
                by_node.setdefault(self.node_of(keys[i]), []).append(i)
            moved: list[int] = []
            asked: dict[str, list[int]] = {}  # node address -> commands it takes for a migrating slot
            for node, idx in by_node.items():
                try:
                    conn = self.connection(node)  # a new one authenticates: it can time out too
                    conn.send(b"".join(encode_command(*commands[i]) for i in idx))
                    got = conn.read_replies(len(idx))
                except OSError as exc:
                    self._drop(node)
                    raise PoolError(f"pool node {self.address(node)} failed: {exc}") from exc
                for i, reply in zip(idx, got):
                    replies[i] = reply
                    if isinstance(reply, Exception):
                        redirect = str(reply).split()  # MOVED|ASK <slot> <host:port>
                        if redirect[:1] == ["MOVED"]:
                            moved.append(i)
                        elif redirect[:1] == ["ASK"] and len(redirect) == 3:
                            asked.setdefault(redirect[2], []).append(i)
            for address, idx in asked.items():
                for i, reply in zip(idx, self._asking(address, [commands[i] for i in idx])):
                    replies[i] = reply
                    if isinstance(reply, Exception) and str(reply).startswith(("MOVED", "ASK")):
                        moved.append(i)  # the migration ended (or was undone) meanwhile: re-read the map
            if not moved:
                return replies
            self.refresh()
            todo = moved
        raise PoolError(f"keys keep moving between nodes (last: {_shown(keys[todo[0]])}): is the cluster resharding?")

    def _asking(self, address: str, commands: list[tuple]) -> list:
        """``commands`` on the node at ``address`` (``host:port``), each after ``ASKING``: the
        node imports their keys' slot, and answers for a key the owner has handed over."""
        host, _, port = address.rpartition(":")
        conn = self._conns.get(address)
        try:
            if conn is None:
                conn = self._conns[address] = NodeConnection(host, int(port), self.timeout, self.auth)
            conn.send(b"".join(encode_command("ASKING") + encode_command(*c) for c in commands))
            got = conn.read_replies(2 * len(commands))
        except (OSError, ValueError) as exc:
            dropped = self._conns.pop(address, None)
            if dropped is not None:
                dropped.close()
            raise PoolError(f"pool node {address} (asked to serve a migrating slot) failed: {exc}") from exc
        return got[1::2]  # each command's reply; the even ones are ASKING's OK

    def call(self, *args: Arg):
        """One command on the node owning its key (``args[1]``); raises on an error reply."""
        reply = self.execute([args])[0]
        if isinstance(reply, Exception):
            raise PoolError(f"{_shown(args[0])} {_shown(args[1])}: {reply}")
        return reply

    def each_node(self, *args: Arg) -> list:
        """Run one command on every node; replies in ``self.nodes`` order."""
        out = []
        for node in range(len(self.nodes)):
            try:
                out.append(self.connection(node).call(*args))
            except OSError as exc:
                self._drop(node)
                raise PoolError(f"pool node {self.address(node)} failed: {exc}") from exc
        return out

    def scan(self, pattern: str) -> Iterable[bytes]:
        """Every key matching ``pattern`` on every node."""
        for node in range(len(self.nodes)):
            conn, cursor = self.connection(node), b"0"
            while True:
                cursor, keys = conn.call("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
                yield from keys
                if cursor == b"0":
                    break

    def _drop(self, node: int) -> None:
        conn = self._conns.pop(self.address(node), None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def __enter__(self) -> "PoolClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
