"""Local Redis servers for trying the pool out (and for the tests): loopback only, no persistence.

``start_local_pool(nodes, port, directory)`` starts ``nodes`` ``redis-server`` processes
on ``127.0.0.1:port..port+nodes-1``: one plain server for ``nodes=1``, else a Redis
Cluster (slots split evenly, nodes introduced with ``CLUSTER MEET``). Production pools
are existing Redis Clusters with replicas; see docs/pool.md.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .client import NUM_SLOTS, NodeConnection, PoolError

__all__ = ["RedisNode", "LocalPool", "start_local_pool", "free_port_base", "redis_server_missing"]

CLUSTER_BUS_OFFSET = 10000


def redis_server_missing() -> str | None:
    """Why local servers cannot start (no ``redis-server`` on PATH), or None."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)"
    return None


def free_port_base(nodes: int, low: int = 20000, high: int = 40000) -> int:
    """A port p with p..p+nodes-1 and their cluster bus ports (p+10000...) free on 127.0.0.1."""
    for _ in range(200):
        base = random.randrange(low, high - nodes)
        ports = [p + off for p in range(base, base + nodes) for off in (0, CLUSTER_BUS_OFFSET)]
        if all(_port_free(p) for p in ports):
            return base
    raise RuntimeError(f"found no {nodes} free ports between {low} and {high}")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class RedisNode:
    """One ``redis-server`` process; ``kill`` and ``start`` again keep its cluster identity."""

    port: int
    directory: Path
    cluster: bool
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
                "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                "--logfile", f"redis-{self.port}.log", "--daemonize", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--cluster-node-timeout", "3000"]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                raise PoolError(f"redis-server on port {self.port} exited at start: {err.strip() or self.log_tail()}")
            try:
                conn = NodeConnection("127.0.0.1", self.port, 1.0)
                try:
                    if conn.call("PING") == b"PONG":
                        return
                finally:
                    conn.close()
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise PoolError(f"redis-server on port {self.port} did not answer within {timeout:g} s")
            time.sleep(0.02)

    def log_tail(self) -> str:
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

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Wait until every node reports the cluster healthy (a plain server is ready at once)."""
        if not self.cluster:
            return
        deadline = time.monotonic() + timeout
        while True:
            if all(_cluster_ok(n.port, len(self.nodes)) for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise PoolError(f"the local cluster did not become healthy within {timeout:g} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self.own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "LocalPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cluster_ok(port: int, nodes: int) -> bool:
    try:
        conn = NodeConnection("127.0.0.1", port, 1.0)
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


def start_local_pool(nodes: int = 1, port: int = 7001, directory: str | os.PathLike | None = None) -> LocalPool:
    """Start ``nodes`` loopback servers from ``port`` on (a cluster when ``nodes > 1``)."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    missing = redis_server_missing()
    if missing:
        raise PoolError(missing)
    own = directory is None
    root = Path(directory) if directory is not None else Path(_mkdtemp())
    cluster = nodes > 1
    pool = LocalPool([RedisNode(port + i, root / f"node-{port + i}", cluster) for i in range(nodes)],
                     cluster, root, own)
    try:
        for node in pool.nodes:
            node.start()
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
    first = NodeConnection("127.0.0.1", pool.nodes[0].port, 5.0)
    try:
        for i, node in enumerate(pool.nodes):
            conn = NodeConnection("127.0.0.1", node.port, 5.0)
            try:
                reply = conn.call("CLUSTER", "ADDSLOTSRANGE", bounds[i], bounds[i + 1] - 1)
            finally:
                conn.close()
            if isinstance(reply, Exception):
                raise PoolError(f"127.0.0.1:{node.port}: CLUSTER ADDSLOTSRANGE failed: {reply}")
            if i:
                reply = first.call("CLUSTER", "MEET", "127.0.0.1", node.port)
                if isinstance(reply, Exception):
                    raise PoolError(f"CLUSTER MEET 127.0.0.1:{node.port} failed: {reply}")
    finally:
        first.close()
