"""``RowServer``: one process per machine that owns a table's tier, its row cache and its
reads, and serves every rank's fetches through shared memory.

Each connection gets its own exchange buffer (a memfd the client maps; see ``protocol``)
and its own thread. A fetch is the store's ``fetch``: the rows go through the one
``TableStore`` (so every rank shares one cache and one hit rate) and are copied into the
connection's buffer; with ``HOLD`` the lease stays with the connection until the client
releases it. A connection that ends, for whatever reason (the client closed it, or the
kernel did when the client was killed), releases every lease it still held: no pin
outlives its rank, and no other rank's rows are touched.

One server per socket: the server holds ``flock`` on ``<socket>.lock`` while it runs (the
kernel drops it if the server dies), so a second one refuses to start and a new one
replaces the socket file a dead one left.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import mmap
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import EngramError
from ...units import size_arg
from ..store import TableStore, open_table
from . import protocol as p

__all__ = ["RowServer", "DEFAULT_MAX_ROWS", "main"]

DEFAULT_MAX_ROWS = 1 << 16  # ids per round trip; a larger fetch takes several


class RowServer:
    """Serve ``store`` on the Unix socket ``socket_path`` (see the module docstring)."""

    def __init__(self, store: TableStore, socket_path: str | os.PathLike[str], *,
                 max_rows: int = DEFAULT_MAX_ROWS) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.store = store
        self.socket_path = Path(socket_path)
        self.max_rows = int(max_rows)
        self._lock_fd = os.open(f"{self.socket_path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise EngramError(f"a row server already serves {self.socket_path}: connect to it, or stop it first") from None
        self.socket_path.unlink(missing_ok=True)  # left by a server that died
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(str(self.socket_path))
        self._listener.listen(64)
        self._state = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._leases_held = 0
        self._lease_numbers = itertools.count(1)
        self._served = 0
        self._closed = threading.Event()

    # ------------------------------------------------------------------ life cycle
    def serve_forever(self) -> None:
        """Accept connections until ``close``; each is served by its own thread."""
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                raise
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="engram-rowserver").start()

    def close(self) -> None:
        """Stop accepting, drop the connections (their leases are released), close the store."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._state:
            connections = list(self._connections)
        for conn in connections:
            conn.shutdown(socket.SHUT_RDWR)
        self.socket_path.unlink(missing_ok=True)
        self.store.close()
        os.close(self._lock_fd)

    # ------------------------------------------------------------------ one connection
    def _serve(self, conn: socket.socket) -> None:
        rb = self.store.row_bytes
        rows_offset, nbytes = p.buffer_layout(self.max_rows, rb)
        fd = os.memfd_create("engram-rows")
        leases: dict[int, Any] = {}
        with self._state:
            self._connections.add(conn)
        try:
            os.ftruncate(fd, nbytes)
            buffer = mmap.mmap(fd, nbytes)
            ids_view = np.frombuffer(buffer, np.int64, count=self.max_rows)  # [max_rows]
            rows_view = np.frombuffer(buffer, np.uint8, count=self.max_rows * rb, offset=rows_offset).reshape(-1, rb)
            hello = {"config": self.store.config.to_dict(), "num_rows": self.store.num_rows, "row_bytes": rb,
                     "max_rows": self.max_rows, "rows_offset": rows_offset, "buffer_bytes": nbytes,
                     "tier": getattr(self.store.tier, "name", type(self.store.tier).__name__),
                     "table": str(self.store.header.path) if self.store.header is not None else None,
                     "fingerprint": self.store.header.fingerprint() if self.store.header is not None else None}
            socket.send_fds(conn, [p.encode(p.HELLO, payload=hello)], [fd])
            os.close(fd)
            fd = -1
            while True:
                message = conn.recv(p.MAX_MESSAGE)
                if not message:
                    return  # closed by the client, or by the kernel when it died
                op, flags, value, extra, _ = p.decode(message)
                if op == p.FETCH:
                    conn.send(self._fetch(ids_view, rows_view, value, extra, bool(flags & p.HOLD), leases))
                elif op == p.RELEASE:
                    lease = leases.pop(value, None)
                    if lease is not None:
                        lease.release()
                        self._count_leases(-1)
                elif op == p.STATS:
                    conn.send(p.encode(p.OK, payload=self.stats()))
                else:
                    conn.send(p.encode(p.ERROR, payload={"type": "ValueError", "message": f"unknown request {op!r}"}))
        except OSError:
            return  # the client vanished mid-reply: same as a close
        finally:
            for lease in leases.values():
                lease.release()
            self._count_leases(-len(leases))
            with self._state:
                self._connections.discard(conn)
            conn.close()
            if fd >= 0:
                os.close(fd)

    def _fetch(self, ids_view: np.ndarray, rows_view: np.ndarray, n: int, requested: int, hold: bool,
               leases: dict[int, Any]) -> bytes:
        """Rows of the ``n`` ids in the buffer into the buffer; the reply message."""
        if not 0 <= n <= self.max_rows:
            return p.encode(p.ERROR, payload={"type": "ValueError",
                                              "message": f"a fetch holds at most {self.max_rows} ids, got {n}"})
        ids = ids_view[:n].copy()  # [n]; the store checks them (sorted, distinct, in range)
        try:
            lease = self.store.fetch(ids, hold=hold, requested=requested or n)
        except Exception as exc:  # the client raises it; this connection and the others go on
            return p.encode(p.ERROR, payload={"type": type(exc).__name__, "message": str(exc)})
        try:
            rows_view[:n] = lease.host_raw
        except BaseException:
            lease.release()
            raise
        with self._state:
            self._served += n
        if not hold:
            return p.encode(p.OK)
        number = next(self._lease_numbers)
        leases[number] = lease
        self._count_leases(1)
        return p.encode(p.OK, value=number)

    def _count_leases(self, delta: int) -> None:
        with self._state:
            self._leases_held += delta

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, Any]:
        """The store's stats (every rank's fetches together) plus ``server``: connections,
        leases held, rows served, pinned slots per cache level."""
        with self._state:
            server: dict[str, Any] = {"connections": len(self._connections), "leases_held": self._leases_held,
                      "rows_served": self._served, "max_rows": self.max_rows}
        server["pinned_slots"] = [level.pinned() for level in self.store.levels]
        return {**self.store.stats(), "server": server}


def main(argv: list[str] | None = None) -> int:
    """``python -m engram_offload.serving.rowserver.server TABLE SOCKET [--tier direct] [--cache 4GiB]``."""
    parser = argparse.ArgumentParser(prog="engram-offload-rowserver", description=main.__doc__)
    parser.add_argument("table")
    parser.add_argument("socket")
    parser.add_argument("--tier", default="direct")
    parser.add_argument("--cache", type=size_arg, default=0, help="DRAM row cache size, e.g. 4GiB")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--max-rows", type=int, default=DEFAULT_MAX_ROWS)
    args = parser.parse_args(argv)
    try:
        store = open_table(args.table, args.tier, cache_bytes=args.cache, policy=args.policy)
        server = RowServer(store, args.socket, max_rows=args.max_rows)
    except (EngramError, ValueError, OSError) as exc:
        print(f"engram-offload row server: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    signal.signal(signal.SIGINT, lambda *_: server.close())
    print(f"serving {args.table} on {args.socket}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
