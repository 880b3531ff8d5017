"""Local Redis servers for trying the pool out (and for the tests): loopback by default, no persistence.

``start_local_pool(nodes, port, directory)`` starts ``nodes`` ``redis-server`` processes
on ``127.0.0.1:port..port+nodes-1`` (or ``host``, another address of this machine): one
plain server for ``nodes=1``, else a Redis Cluster (slots split evenly, nodes introduced
with ``CLUSTER MEET``). Production pools are existing Redis Clusters with replicas; see
docs/pool.md.

A node counts as started only when the server answering its port is the process started
for it (``INFO server``'s ``process_id``): a port taken by another server is an error
(``PortTakenError``), never a success. Without ``port``, free ports are picked outside the
kernel's ephemeral range (``ip_local_port_range``, where outgoing connections take theirs)
and the start is retried on other ports when one is taken meanwhile. With ``password``
the servers require it (given on their stdin, never on a command line other users can
read). With ``die_with_parent`` the servers are killed when the process that started them
dies, even by SIGKILL (``PR_SET_PDEATHSIG``), and a temporary folder of theirs is removed
then by a watcher process (it waits for the end of its standard input, held by the
starting process, then for the servers' exit).
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .client import NUM_SLOTS, NodeConnection, PoolError

__all__ = ["RedisNode", "LocalPool", "start_local_pool", "free_port_base", "redis_server_missing", "PortTakenError",
           "ephemeral_ports"]

CLUSTER_BUS_OFFSET = 10000
PORT_TRIES = 20  # starts on other free ports when one is taken between the pick and the bind
PR_SET_PDEATHSIG = 1
# The watcher: on the end of its stdin (the starting process ended), waits up to 30 s for
# the servers (pids in argv) to exit, then removes their folder (argv[1]).
_WATCHER = """import os, select, shutil, signal, sys, time
for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
fds = []
for pid in sys.argv[2:]:
    try:
        fds.append(os.pidfd_open(int(pid)))
    except OSError:
        pass
sys.stdin.buffer.read()
deadline = time.monotonic() + 30
for fd in fds:
    select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


class PortTakenError(PoolError):
    """A port of a local node is taken by another process."""


def redis_server_missing() -> str | None:
    """Why local servers cannot start (no ``redis-server`` on PATH), or None."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)"
    return None


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range (``ip_local_port_range``), where outgoing
    connections take their local ports."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return low, high


def free_port_base(nodes: int, low: int = 10000, high: int = 65535, rng: random.Random | None = None) -> int:
    """A port p with p..p+nodes-1 and their cluster bus ports (p+10000...) free on 127.0.0.1
    and outside the kernel's ephemeral range (so no outgoing connection takes one between
    this check and the server's bind). Free now, not reserved: ``start_local_pool`` without
    a port retries on a taken one."""
    rng = rng or random.Random()
    eph_low, eph_high = ephemeral_ports()

    def usable(base: int) -> bool:
        ports = [q + off for q in range(base, base + nodes) for off in (0, CLUSTER_BUS_OFFSET)]
        return all(1024 <= q <= 65535 and not eph_low <= q <= eph_high for q in ports)

    for _ in range(400):
        base = rng.randrange(low, max(low + 1, high - nodes - CLUSTER_BUS_OFFSET))
        if usable(base) and all(_port_free(q + off) for q in range(base, base + nodes)
                                for off in (0, CLUSTER_BUS_OFFSET)):
            return base
    raise PoolError(f"found no {nodes} free ports (and their bus ports) between {low} and {high} outside the "
                    f"ephemeral range {eph_low}-{eph_high}: give --port")


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind ``port`` on ``host`` now (as redis-server does, with
    ``SO_REUSEADDR``: connections of a server just stopped do not hold it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class RedisNode:
    """One ``redis-server`` process; ``kill`` and ``start`` again keep its cluster identity."""

    port: int
    directory: Path
    cluster: bool
    process: subprocess.Popen | None = None
    password: str | None = field(default=None, repr=False)
    die_with_parent: bool = False
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def connect(self, timeout: float) -> NodeConnection:
        """A connection to this node, authenticated when it has a password."""
        return NodeConnection(self.host, self.port, timeout, (None, self.password) if self.password else None)

    def start(self, timeout: float = 30.0) -> None:
        """Start the server; ``PortTakenError`` when its port (or bus port) is taken."""
        for port in (self.port, self.port + CLUSTER_BUS_OFFSET) if self.cluster else (self.port,):
            if not _port_free(port, self.host):
                raise PortTakenError(f"port {port} on {self.host} is taken by another process: choose another --port")
        args = ["redis-server", "-", "--port", str(self.port), "--bind", self.host, "--protected-mode", "yes",
                "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                "--logfile", f"redis-{self.port}.log", "--daemonize", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--cluster-node-timeout", "3000"]
        self.directory.mkdir(parents=True, exist_ok=True)
        config = f"requirepass {self.password}\n" if self.password else ""  # on stdin: no other user reads it
        self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE,
                                        preexec_fn=_die_with_parent if self.die_with_parent else None)
        assert self.process.stdin is not None
        self.process.stdin.write(config.encode())
        self.process.stdin.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                said = err.strip() or self.log_tail()
                kind = PortTakenError if "Address already in use" in said else PoolError
                raise kind(f"redis-server on port {self.port} exited at start: {said[-2000:]}")
            try:
                conn = self.connect(1.0)
                try:
                    info = conn.call("INFO", "server")
                finally:
                    conn.close()
            except OSError:
                info = None
            if isinstance(info, bytes):
                pid = _info_pid(info)
                if pid == self.process.pid:
                    return
                self.stop()
                raise PortTakenError(f"port {self.port} on {self.host} is served by another redis-server (pid {pid}), "
                                     "not the one started: choose another --port")
            if time.monotonic() > deadline:
                self.stop()
                raise PoolError(f"redis-server on port {self.port} did not answer within {timeout:g} s")
            time.sleep(0.02)

    def log_tail(self) -> str:
        """The end of the server's log file."""
        log = self.directory / f"redis-{self.port}.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def kill(self) -> None:
        """SIGKILL the server (its data is gone: nothing is persisted)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()


@dataclass
class LocalPool:
    """Servers started by ``start_local_pool``; ``url`` lists them all."""

    nodes: list[RedisNode]
    cluster: bool
    directory: Path
    own_directory: bool = field(default=False, repr=False)
    watcher: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until every node reports the cluster healthy (a plain server is ready at once);
        the bound leaves room for a machine whose cores are busy (a cluster's gossip takes seconds there)."""
        if not self.cluster:
            return
        deadline = time.monotonic() + timeout
        while True:
            if all(_cluster_ok(n, len(self.nodes)) for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise PoolError(f"the local cluster did not become healthy within {timeout:g} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self.own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self.watcher is not None:
            assert self.watcher.stdin is not None
            self.watcher.stdin.close()  # the servers are gone: it ends at once
            try:
                self.watcher.wait(10)
            except subprocess.TimeoutExpired:
                self.watcher.kill()
                self.watcher.wait()
            self.watcher = None

    def watch(self) -> None:
        """Start the watcher that removes the folder once this process and the servers are gone."""
        pids = [str(n.process.pid) for n in self.nodes if n.process is not None]
        self.watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(self.directory), *pids],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> "LocalPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _info_pid(info: bytes) -> int | None:
    for line in info.decode(errors="replace").splitlines():
        if line.startswith("process_id:"):
            return int(line.split(":", 1)[1])
    return None


def _cluster_ok(node: RedisNode, nodes: int) -> bool:
    try:
        conn = node.connect(1.0)
    except OSError:
        return False
    try:
        info = conn.call("CLUSTER", "INFO")
        slots = conn.call("CLUSTER", "SLOTS")
    except OSError:
        return False
    finally:
        conn.close()
    return (isinstance(info, bytes) and b"cluster_state:ok" in info
            and isinstance(slots, list) and len(slots) == nodes)


def start_local_pool(nodes: int = 1, port: int | None = 7001, directory: str | os.PathLike | None = None, *,
                     password: str | None = None, die_with_parent: bool = False, host: str = "127.0.0.1") -> LocalPool:
    """Start ``nodes`` servers on ``host`` from ``port`` on (a cluster when ``nodes > 1``); with
    ``port=None`` on free ports outside the ephemeral range, retried when one is taken."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    missing = redis_server_missing()
    if missing:
        raise PoolError(missing)
    for attempt in range(PORT_TRIES):
        base = port if port is not None else free_port_base(nodes)
        try:
            return _start(nodes, base, directory, password, die_with_parent, host)
        except PortTakenError:
            if port is not None or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _start(nodes: int, port: int, directory: str | os.PathLike | None, password: str | None,
           die_with_parent: bool, host: str) -> LocalPool:
    own = directory is None
    root = Path(directory) if directory is not None else Path(_mkdtemp())
    cluster = nodes > 1
    pool = LocalPool([RedisNode(port + i, root / f"node-{port + i}", cluster, password=password,
                                die_with_parent=die_with_parent, host=host) for i in range(nodes)], cluster, root, own)
    try:
        for node in pool.nodes:
            node.start()
        if own and die_with_parent:
            pool.watch()
        if cluster:
            _form_cluster(pool)
            pool.wait_ready()
    except BaseException:
        pool.stop()
        raise
    return pool


def _mkdtemp() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="engram-pool-")


def _form_cluster(pool: LocalPool) -> None:
    """Split the slots evenly over the nodes and introduce them to each other."""
    n = len(pool.nodes)
    bounds = [NUM_SLOTS * i // n for i in range(n + 1)]
    first = pool.nodes[0].connect(5.0)
    try:
        for i, node in enumerate(pool.nodes):
            conn = node.connect(5.0)
            try:
                reply = conn.call("CLUSTER", "ADDSLOTSRANGE", bounds[i], bounds[i + 1] - 1)
            finally:
                conn.close()
            if isinstance(reply, Exception):
                raise PoolError(f"{node.host}:{node.port}: CLUSTER ADDSLOTSRANGE failed: {reply}")
            if i:
                reply = first.call("CLUSTER", "MEET", node.host, node.port)
                if isinstance(reply, Exception):
                    raise PoolError(f"CLUSTER MEET {node.host}:{node.port} failed: {reply}")
    finally:
        first.close()
