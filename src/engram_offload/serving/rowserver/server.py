"""``RowServer``: one process per machine that owns a table's tier, its row cache and its
reads, and serves every rank's fetches through shared memory. ``engram-offload row-server``
(``commands/rowserver.py``) runs one.

Each connection gets its own exchange buffer (a memfd the client maps; see ``protocol``)
and its own thread. A fetch is the store's ``fetch``: the rows go through the one
``TableStore`` (so every rank shares one cache and one hit rate) and are copied into the
connection's buffer; with ``HOLD`` the lease stays with the connection until the client
releases it. A connection that ends, for whatever reason (the client closed it, or the
kernel did when the client was killed), releases every lease it still held: no pin
outlives its rank, and no other rank's rows are touched.

One server per socket: the server holds ``flock`` on ``<socket>.lock`` while it runs (the
kernel drops it if the server dies), so a second one refuses to start (naming the process
that holds the lock) and a new one replaces the socket file a dead one left.

Only the server's own uid and root may connect: the socket is created with mode 0600
whatever the umask, and each connection's uid (``SO_PEERCRED``) is checked before it gets
a buffer. At most ``max_connections`` connections are served at once (each holds an
exchange buffer of ``max_rows`` rows: 17 MiB at the defaults); one more is told so and
closed, and so is one that arrives when the process is out of file descriptors (a spare
descriptor is kept for that): the server goes on serving the others.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import resource
import select
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import EngramError
from . import protocol as p

if TYPE_CHECKING:
    from ..store import TableStore

__all__ = ["RowServer", "check_socket_path", "DEFAULT_MAX_ROWS", "DEFAULT_MAX_CONNECTIONS", "MAX_REQUESTED"]

DEFAULT_MAX_ROWS = 1 << 16  # ids per round trip; a larger fetch takes several
DEFAULT_MAX_CONNECTIONS = 64  # ranks of one machine, with room to spare
MAX_REQUESTED = 1 << 40  # the most lookups one fetch may stand for (a client's count is checked, not believed)
MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sun_path less its NUL)
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_LOG_LINES = 100  # one line per refused or broken connection up to this many, then one in 1,000


class RowServer:
    """Serve ``store`` on the Unix socket ``socket_path`` (see the module docstring)."""

    def __init__(self, store: TableStore, socket_path: str | os.PathLike[str], *,
                 max_rows: int = DEFAULT_MAX_ROWS, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if max_rows < 1 or max_connections < 1:
            raise ValueError(f"max_rows and max_connections must be >= 1, got {max_rows} and {max_connections}")
        self.store = store
        self.socket_path = Path(socket_path)
        self.max_rows = int(max_rows)
        self.max_connections = int(max_connections)
        check_socket_path(self.socket_path)  # before the lock file is made
        self._lock_fd = _take_lock(self.socket_path)
        try:
            _remove_stale_socket(self.socket_path)
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            previous = os.umask(0o177)  # the socket file is created 0600, whatever the caller's umask
            try:
                self._listener.bind(str(self.socket_path))
            finally:
                os.umask(previous)
            self._listener.listen(64)
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # given up to refuse a connection
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._state = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._leases_held = 0
        self._lease_numbers = itertools.count(1)
        self._served = 0
        self._refused = 0
        self._logged = 0
        self._closed = threading.Event()

    # ------------------------------------------------------------------ life cycle
    def serve_forever(self) -> None:
        """Accept connections until ``close``; each is served by its own thread. A connection
        from another uid, one past ``max_connections``, or one that finds the process out of
        file descriptors is told why and closed; the server goes on."""
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                if exc.errno not in _OUT_OF_DESCRIPTORS:
                    if exc.errno in (errno.ECONNABORTED, errno.EINTR, errno.EPROTO):
                        continue
                    raise
                accepted = self._accept_short_of_descriptors()
                if accepted is None:
                    continue
                conn = accepted
            why = self._why_refused(conn)
            if why is not None:
                self._refuse(conn, why)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True, name="engram-rowserver").start()
            except RuntimeError as exc:  # no thread to be had
                with self._state:
                    self._connections.discard(conn)
                self._refuse(conn, f"the row server cannot start a thread for a connection ({exc}): retry later")

    def _why_refused(self, conn: socket.socket) -> str | None:
        """Why ``conn`` is not served (None: it is, and it now counts as a connection)."""
        _, uid, _ = p.peer_credentials(conn)
        if not p.trusted_uid(uid):
            return (f"uid {uid} may not read rows from this row server (it serves its own uid {os.geteuid()} "
                    "and root): run the ranks as that user")
        with self._state:
            if len(self._connections) >= self.max_connections:
                return (f"the row server at {self.socket_path} serves at most {self.max_connections} connections "
                        "and has them all: close idle clients, or start it with a larger max_connections")
            self._connections.add(conn)
        return None

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """Tell ``conn`` why it is not served (an ``ERROR`` in place of the hello) and close it."""
        with self._state:
            self._refused += 1
        self._log(f"refused a connection: {why}")
        try:
            conn.settimeout(1.0)
            conn.send(p.encode(p.ERROR, payload={"type": "TierError", "message": why}))
        except OSError:
            pass
        finally:
            conn.close()

    def _accept_short_of_descriptors(self) -> socket.socket | None:
        """``accept`` failed for want of a file descriptor (it fails at once then, connection
        or not). Once a connection waits: accept it if a descriptor was freed meanwhile (the
        caller serves it), else give up the spare descriptor to accept it and refuse it (it
        would wait in the backlog with no answer)."""
        if self._spare < 0:
            try:
                self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                time.sleep(0.05)  # not even one: wait for a connection to close
                return None
        ready, _, _ = select.select([self._listener], [], [], 0.5)
        if not ready or self._closed.is_set():
            return None
        conn = None
        self._listener.setblocking(False)
        try:
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if exc.errno not in _OUT_OF_DESCRIPTORS:
                    return None  # gone meanwhile
            else:
                conn.setblocking(True)
                return conn
            os.close(self._spare)
            self._spare = -1
            try:
                conn, _ = self._listener.accept()
            except OSError:
                conn = None
        finally:
            self._listener.setblocking(True)
        if conn is not None:
            conn.setblocking(True)
            self._refuse(conn, self._out_of_descriptors())
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._spare = -1
        return None

    def _out_of_descriptors(self) -> str:
        return (f"the row server is out of file descriptors (ulimit -n {_descriptor_limit()}, "
                f"{self.max_connections} connections allowed): close idle clients, or raise its limit")

    def _log(self, line: str) -> None:
        """One line on stderr, for the first ``_LOG_LINES`` events and then one in 1,000."""
        with self._state:
            self._logged += 1
            n = self._logged
        if n <= _LOG_LINES or n % 1000 == 0:
            print(f"engram-offload row server: {line}" + (f" ({n:,} such lines)" if n > _LOG_LINES else ""),
                  file=sys.stderr, flush=True)

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
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:  # it ended meanwhile (its thread closed it): nothing to stop
                pass
        self.socket_path.unlink(missing_ok=True)
        self.store.close()
        if self._spare >= 0:
            os.close(self._spare)
        os.close(self._lock_fd)

    # ------------------------------------------------------------------ one connection
    def _serve(self, conn: socket.socket) -> None:
        rb = self.store.row_bytes
        rows_offset, nbytes = p.buffer_layout(self.max_rows, rb)
        fd = -1
        leases: dict[int, Any] = {}
        try:
            try:
                fd = os.memfd_create("engram-rows", os.MFD_CLOEXEC)
                os.ftruncate(fd, nbytes)
                buffer = mmap.mmap(fd, nbytes)
            except OSError as exc:
                why = (self._out_of_descriptors() if exc.errno in (errno.EMFILE, errno.ENFILE) else
                       f"the row server cannot make this connection's {nbytes / 2**20:.0f} MiB buffer "
                       f"({exc.strerror}): close idle clients, or start it with fewer max_rows")
                conn.send(p.encode(p.ERROR, payload={"type": "TierError", "message": why}))
                with self._state:
                    self._refused += 1
                self._log(f"no buffer for a connection: {exc}")
                return
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
                try:
                    op, flags, value, extra, _ = p.decode(message)
                except ValueError as exc:  # not a request of ours: say so, keep the connection
                    conn.send(p.encode(p.ERROR, payload={"type": "ValueError",
                                                         "message": f"malformed request: {exc}"}))
                    continue
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
        except Exception as exc:  # one line, never a traceback per connection; the others go on
            self._log(f"a connection failed: {type(exc).__name__}: {exc}")
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
        if requested and not n <= requested <= MAX_REQUESTED:
            return p.encode(p.ERROR, payload={"type": "ValueError", "message": (
                f"a fetch of {n} ids stands for {n} to {MAX_REQUESTED:,} requested ids, not {requested:,}: "
                "pass requested= as the lookups before deduplication")})
        ids = ids_view[:n].copy()  # [n]; the store checks them (sorted, distinct, in range)
        try:
            # a held fetch the cache serves whole leaves its rows there: one copy, into the buffer
            lease = self.store.fetch(ids, hold=hold, requested=requested or n, in_place=hold)
        except Exception as exc:  # the client raises it; this connection and the others go on
            return p.encode(p.ERROR, payload={"type": type(exc).__name__, "message": str(exc)})
        try:
            if lease.in_place is not None:
                lease.in_place.copy(out=rows_view[:n])
            else:
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
                                      "rows_served": self._served, "max_rows": self.max_rows,
                                      "max_connections": self.max_connections, "refused": self._refused}
        server["pinned_slots"] = [level.pinned() for level in self.store.levels]
        return {**self.store.stats(), "server": server}


def check_socket_path(socket_path: str | os.PathLike[str]) -> None:
    """``EngramError`` (one line) for a socket path no server can bind: too long for a Unix
    socket, or in a folder that does not exist."""
    path = Path(socket_path)
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH:
        raise EngramError(f"the socket path {path} is {size} bytes, over the {MAX_SOCKET_PATH} a Unix socket's path "
                          "may have: give a shorter path (such as /run/engram/rows.sock)")
    if not path.absolute().parent.is_dir():
        raise EngramError(f"the socket's folder {path.absolute().parent} does not exist: create it (mode 0700, "
                          "yours only) or give a socket path in a folder that exists")


def _take_lock(socket_path: Path) -> int:
    """Open and ``flock`` ``<socket>.lock`` (created 0600, never through a symlink, refused when
    another uid owns it); ``EngramError`` naming the process that holds it."""
    lock = f"{socket_path}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise EngramError(_cannot_open(lock, socket_path.parent, exc)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or not p.trusted_uid(info.st_uid):
        os.close(fd)
        raise EngramError(f"{lock} belongs to uid {info.st_uid}, not to you or root: another user put it there; "
                          "remove it, or put the socket in a folder only you can write")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise EngramError(f"{lock} is held by {_lock_holder(info)}: a row server already serves {socket_path}; "
                          "connect to it, or stop that process first") from None
    return fd


def _cannot_open(lock: str, folder: Path, exc: OSError) -> str:
    """Why ``lock`` could not be opened (``exc``), and what to do."""
    try:
        info: os.stat_result | None = os.lstat(lock)
    except OSError:
        info = None
    if exc.errno == errno.ELOOP or (info is not None and stat.S_ISLNK(info.st_mode)):
        return (f"cannot open {lock}: it is a symlink (someone put it there); remove it, or put the socket in a "
                "folder only you can write")
    if info is not None:
        return (f"cannot open {lock} ({exc.strerror}): it belongs to uid {info.st_uid}, who put it there; remove it, "
                "or put the socket in a folder only you can write")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return (f"cannot create {lock}: the folder {folder} does not exist; create it (mode 0700, yours only) or "
                "give a socket path in a folder that exists")
    return f"cannot create {lock} in {folder} ({exc.strerror}): give a socket path in a folder only you can write"


def _lock_holder(info: os.stat_result) -> str:
    """The process holding an ``flock`` on the file ``info`` describes, from ``/proc/locks``."""
    where = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open("/proc/locks") as f:
            pids = [int(fields[4]) for fields in (line.split() for line in f)
                    if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == where]
    except (OSError, ValueError):
        pids = []
    if not pids:
        return "another process"
    pid = pids[0]
    try:
        uid = Path(f"/proc/{pid}").stat().st_uid
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"pid {pid}"
    return f"pid {pid} (uid {uid}: {command[:120]})"


def _remove_stale_socket(socket_path: Path) -> None:
    """Remove the socket file a dead server left (the caller holds the lock); refuse anything else."""
    try:
        info = socket_path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise EngramError(f"{socket_path} exists and is not a socket: choose another socket path")
    try:
        socket_path.unlink()
    except PermissionError:
        raise EngramError(f"{socket_path} belongs to uid {info.st_uid}, who bound it first: put the socket in "
                          "a folder only you can write") from None


def _descriptor_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
