"""``RowServer`` served from a thread of the test process, spoken to byte by byte: its hello,
its answers to every request (good, malformed, unknown, out of bounds), its leases, its
refusals and its log. The server process (``start_row_server``) has its own tests in
``test_rowserver.py`` and ``test_rowserver_trust.py``, the command that runs it in
``tests/commands/test_rowserver_command.py``."""

from __future__ import annotations

import errno
import io
import mmap
import os
import re
import resource
import select
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from engram_offload.errors import EngramError, TierError
from engram_offload.serving.rowserver import RowClient, RowServer
from engram_offload.serving.rowserver import protocol as p
from engram_offload.serving.rowserver import server as server_module
from engram_offload.serving.store import open_table
from engram_offload.table import read_header

from row_servers import ROW_BYTES, serving


class Raw:
    """A connection that speaks the protocol by hand: the hello, its buffer, one request at a time."""

    def __init__(self, sock: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(30)
        self.sock.connect(str(sock))
        message, fds, _, _ = socket.recv_fds(self.sock, p.MAX_MESSAGE, 1)
        self.op, _, _, _, self.hello = p.decode(message)
        self.fds = fds
        self.buffer = mmap.mmap(fds[0], self.hello["buffer_bytes"]) if self.op == p.HELLO else None

    def ask(self, message: bytes) -> tuple[bytes, int, int, int, object]:
        self.sock.send(message)
        return p.decode(self.sock.recv(p.MAX_MESSAGE))

    def fetch(self, ids: list[int], hold: bool = False, requested: int = 0) -> tuple[bytes, int, object]:
        assert self.buffer is not None
        self.buffer[: 8 * len(ids)] = np.asarray(ids, np.int64).tobytes()
        op, _, value, _, payload = self.ask(p.encode(p.FETCH, p.HOLD if hold else 0, len(ids), requested))
        return op, value, payload

    def rows(self, n: int) -> np.ndarray:
        assert self.buffer is not None
        offset, rb = self.hello["rows_offset"], self.hello["row_bytes"]
        return np.frombuffer(self.buffer, np.uint8, n * rb, offset).reshape(n, rb).copy()

    def stats(self) -> dict:
        op, _, _, _, payload = self.ask(p.encode(p.STATS))
        assert op == p.OK
        return payload["server"]

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
        for fd in self.fds:
            os.close(fd)
        self.sock.close()


def test_the_hello_names_the_table_the_tier_and_the_buffers_layout(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    header = read_header(path)
    with serving(path, sock, max_rows=100):
        raw = Raw(sock)
        try:
            assert raw.op == p.HELLO and len(raw.fds) == 1
            rows_offset, nbytes = p.buffer_layout(100, ROW_BYTES)
            assert raw.hello == {"config": header.config.to_dict(), "num_rows": header.layout.num_rows,
                                 "row_bytes": ROW_BYTES, "max_rows": 100, "rows_offset": rows_offset,
                                 "buffer_bytes": nbytes, "tier": "direct", "table": str(path),
                                 "fingerprint": header.fingerprint()}
            assert os.fstat(raw.fds[0]).st_size == nbytes
        finally:
            raw.close()


def test_each_connection_is_served_by_a_daemon_thread_named_for_the_server(table, socket_dir):
    """A connection's thread never keeps the server's process alive, and shows in a thread list;
    served from a thread that is no daemon, as the command serves from the main thread."""
    path, _ = table
    sock = socket_dir / "rows.sock"
    server = RowServer(open_table(path, "direct", cache_bytes=100 * ROW_BYTES), sock)
    thread = threading.Thread(target=server.serve_forever, daemon=False)
    thread.start()
    try:
        before = set(threading.enumerate())
        raws = [Raw(sock), Raw(sock)]
        try:
            assert raws[0].ask(p.encode(p.STATS))[0] == p.OK and raws[1].ask(p.encode(p.STATS))[0] == p.OK
            new = set(threading.enumerate()) - before  # both connections are served by now
            assert [(t.name, t.daemon) for t in new] == [("engram-rowserver", True)] * 2
        finally:
            for raw in raws:
                raw.close()
    finally:
        server.close()
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_every_request_is_answered_and_a_bad_one_leaves_the_connection_serving(table, socket_dir):
    path, expected = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock, max_rows=100):
        raw = Raw(sock)
        try:
            def error(message: bytes) -> tuple[str, str]:
                op, _, _, _, payload = raw.ask(message)
                assert op == p.ERROR
                return payload["type"], payload["message"]

            assert error(b"x") == ("ValueError", "malformed request: a row-server message is at least 24 bytes, got 1")
            assert error(p.encode(b"NOPE")) == ("ValueError", "unknown request b'NOPE'")
            assert error(p.encode(p.FETCH, 0, 101)) == ("ValueError", "a fetch holds at most 100 ids, got 101")
            assert error(p.encode(p.FETCH, 0, 1 << 63)) == ("ValueError", f"a fetch holds at most 100 ids, got {1 << 63}")
            stands_for = "pass requested= as the lookups before deduplication"
            raw.buffer[:16] = np.array([3, 5], np.int64).tobytes()
            assert error(p.encode(p.FETCH, 0, 2, 1)) == (
                "ValueError", f"a fetch of 2 ids stands for 2 to {server_module.MAX_REQUESTED:,} requested ids, "
                f"not 1: {stands_for}")
            assert error(p.encode(p.FETCH, 0, 2, server_module.MAX_REQUESTED + 1)) == (
                "ValueError", f"a fetch of 2 ids stands for 2 to {server_module.MAX_REQUESTED:,} requested ids, "
                f"not {server_module.MAX_REQUESTED + 1:,}: {stands_for}")
            raw.buffer[:16] = np.array([5, 3], np.int64).tobytes()
            kind, message = error(p.encode(p.FETCH, 0, 2))
            assert kind == "ValueError" and "sorted" in message  # the store's own check, its type kept
            assert raw.stats()["rows_served"] == 0

            assert raw.fetch([3, 5], requested=2) == (p.OK, 0, None)  # no hold: no lease number
            assert np.array_equal(raw.rows(2), expected[[3, 5]])
            assert raw.fetch([7], requested=server_module.MAX_REQUESTED) == (p.OK, 0, None)  # the bound itself
            assert raw.fetch([], requested=0) == (p.OK, 0, None)
            assert raw.fetch(list(range(100)), hold=True) == (p.OK, 1, None)  # leases count from 1
            assert np.array_equal(raw.rows(100), expected[:100])
            assert raw.fetch([200, 300], hold=True) == (p.OK, 2, None)
            stats = raw.stats()
            assert (stats["rows_served"], stats["leases_held"], sum(stats["pinned_slots"])) == (105, 2, 102)
            raw.sock.send(p.encode(p.RELEASE, value=1))  # no reply to a release
            raw.sock.send(p.encode(p.RELEASE, value=1))  # once only
            raw.sock.send(p.encode(p.RELEASE, value=99))  # a number it never gave: nothing happens
            stats = raw.stats()
            assert (stats["leases_held"], sum(stats["pinned_slots"])) == (1, 2)
            assert stats["connections"] == 1 and stats["refused"] == 0
            assert stats["max_rows"] == 100 and stats["max_connections"] == server_module.DEFAULT_MAX_CONNECTIONS
        finally:
            raw.close()


def test_connections_past_the_cap_are_told_so_logged_and_the_others_served(table, socket_dir, capfd):
    path, expected = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock, max_connections=1) as server:
        with RowClient(sock) as first:
            for _ in range(2):
                with pytest.raises(TierError, match=rf"^the row server at {sock} refused the connection: the row "
                                                    rf"server at {sock} serves at most 1 connections and has them "
                                                    r"all: close idle clients, or start it with a larger "
                                                    r"max_connections$"):
                    RowClient(sock)
            assert np.array_equal(first.read_raw([4]).numpy(), expected[[4]])
            assert first.stats()["server"]["refused"] == 2
            assert server.stats()["server"]["connections"] == 1
            raw = Raw(sock)  # what is said on the wire: an error in place of the hello, no buffer
            try:
                assert (raw.op, raw.fds) == (p.ERROR, [])
                assert raw.hello == {"type": "TierError", "message": f"the row server at {sock} serves at most 1 "
                                     "connections and has them all: close idle clients, or start it with a larger "
                                     "max_connections"}
            finally:
                raw.close()
        said = capfd.readouterr().err.splitlines()[:2]
        assert said == [f"engram-offload row server: refused a connection: the row server at {sock} serves at "
                        "most 1 connections and has them all: close idle clients, or start it with a larger "
                        "max_connections"] * 2


def test_a_connection_without_a_thread_is_refused_and_not_counted(table, socket_dir, monkeypatch):
    path, _ = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock, max_connections=1) as server:
        class NoThread(threading.Thread):
            def start(self) -> None:
                raise RuntimeError("can't start new thread")

        monkeypatch.setattr(server_module.threading, "Thread", NoThread)
        with pytest.raises(TierError, match=r"refused the connection: the row server cannot start a thread for a "
                                            r"connection \(can't start new thread\): retry later$"):
            RowClient(sock)
        monkeypatch.undo()
        with RowClient(sock) as client:  # the refused one does not hold the only place
            assert client.stats()["server"]["refused"] == 1
        assert server.stats()["server"]["connections"] in (0, 1)


BIG_BUFFER_MIB = p.buffer_layout(100_000, ROW_BYTES)[1] / 2**20


@pytest.mark.parametrize("call,code,words", [
    ("memfd", errno.EMFILE, r"is out of file descriptors \(ulimit -n \d+, 64 connections allowed\): close idle "
                            r"clients, or raise its limit$"),
    ("memfd", errno.ENOMEM, rf"cannot make this connection's {BIG_BUFFER_MIB:.0f} MiB buffer \(Cannot allocate "
                            r"memory\): close idle clients, or start it with fewer max_rows$"),
    ("mmap", errno.ENOMEM, rf"cannot make this connection's {BIG_BUFFER_MIB:.0f} MiB buffer \(Cannot allocate "
                           r"memory\): close idle clients, or start it with fewer max_rows$")])
def test_a_connection_without_a_buffer_is_told_why_and_the_server_goes_on(table, socket_dir, monkeypatch, capfd,
                                                                          call, code, words):
    path, expected = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock, max_rows=100_000) as server:
        def fail(*args: object) -> int:
            raise OSError(code, os.strerror(code))

        failed: list[BaseException] = []
        monkeypatch.setattr(threading, "excepthook", lambda args: failed.append(args.exc_value))
        if call == "memfd":
            monkeypatch.setattr(server_module.os, "memfd_create", fail)
        else:  # the buffer made, its mapping refused: the buffer's descriptor is closed again
            monkeypatch.setattr(server_module, "mmap", types.SimpleNamespace(mmap=fail))
        stdout = os.fstat(1)
        with pytest.raises(TierError, match=f"refused the connection: the row server {words}"):
            RowClient(sock)
        raw = Raw(sock)  # on the wire: an error in place of the hello
        try:
            assert raw.op == p.ERROR and raw.fds == [] and raw.hello["type"] == "TierError"
            assert re.match(f"the row server {words}", raw.hello["message"])
        finally:
            raw.close()
        monkeypatch.undo()
        with RowClient(sock) as client:
            assert np.array_equal(client.read_raw([6]).numpy(), expected[[6]])
            assert client.stats()["server"]["refused"] == 2
        assert failed == []  # the connections' threads ended cleanly, no descriptor closed that was not theirs
        assert os.fstat(1) == stdout
        assert f"engram-offload row server: no buffer for a connection: [Errno {code}]" in capfd.readouterr().err
        assert server.stats()["server"]["connections"] in (0, 1)


def test_the_log_says_the_first_lines_then_one_in_a_thousand(table, socket_dir, capfd):
    path, _ = table
    with serving(path, socket_dir / "rows.sock") as server:
        capfd.readouterr()
        for i in range(2000):
            server._log(f"line {i + 1}")
        said = capfd.readouterr().err.splitlines()
    assert said == [*(f"engram-offload row server: line {i}" for i in range(1, 101)),
                    "engram-offload row server: line 1000 (1,000 such lines)",
                    "engram-offload row server: line 2000 (2,000 such lines)"]


def test_close_stops_serving_removes_the_socket_and_closes_the_store(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock) as server:
        client = RowClient(sock)
        server.close()
        assert not sock.exists()
        assert server.store.closed
        with pytest.raises(TierError, match="closed the connection"):
            client.read_raw([1])
        client.close()
        server.close()  # twice: nothing more to do
    with serving(path, sock) as server:
        sock.unlink()  # removed by hand meanwhile: closing still works
        server.close()
    with serving(path, sock):  # the lock was let go: a new server takes the socket
        with RowClient(sock) as client:
            assert client.num_rows == read_header(path).layout.num_rows


def test_bad_limits_and_a_file_in_the_sockets_place_are_refused_and_let_the_lock_go(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    with open_table(path, "direct") as store:
        for rows, connections in ((0, 1), (1, 0), (-1, 5)):
            with pytest.raises(ValueError, match=rf"^max_rows and max_connections must be >= 1, got {rows} and "
                                                 rf"{connections}$"):
                RowServer(store, sock, max_rows=rows, max_connections=connections)
        RowServer(store, sock, max_rows=1, max_connections=1).close()
    sock.write_text("not a socket")
    with open_table(path, "direct") as store:
        for _ in range(2):  # the first refusal let the lock go: the second is the same refusal, not "held"
            with pytest.raises(EngramError, match=rf"^{sock} exists and is not a socket: choose another socket path$"):
                RowServer(store, sock)
    assert sock.read_text() == "not a socket"
    sock.unlink()
    with serving(path, sock, max_rows=1, max_connections=1) as server:
        assert (server.max_rows, server.max_connections) == (1, 1)
        assert sock.stat().st_mode & 0o777 == 0o600
        assert Path(f"{sock}.lock").stat().st_mode & 0o777 == 0o600


def test_a_lock_file_that_is_a_symlink_or_another_users_is_refused_word_for_word(table, socket_dir, tmp_path):
    path, _ = table
    sock = socket_dir / "rows.sock"
    lock = Path(f"{sock}.lock")
    lock.symlink_to(tmp_path / "elsewhere")
    with open_table(path, "direct") as store:
        with pytest.raises(EngramError) as refused:
            RowServer(store, sock)
        assert str(refused.value) == (f"cannot open {lock}: it is a symlink (someone put it there); remove it, or "
                                      "put the socket in a folder only you can write")
        assert not (tmp_path / "elsewhere").exists()
        lock.unlink()
        if os.geteuid() != 0:
            return  # giving the lock to another uid takes root
        lock.write_text("")
        os.chown(lock, 12345, 12345)
        with pytest.raises(EngramError) as refused:
            RowServer(store, sock)
        assert str(refused.value) == (f"{lock} belongs to uid 12345, not to you or root: another user put it there; "
                                      "remove it, or put the socket in a folder only you can write")


HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()  # until the test closes stdin
"""


def test_a_held_lock_names_the_holders_pid_uid_and_command_line(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    padding = "x" * 150  # the command line is cut at 120 characters
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, f"{sock}.lock", padding, b"\xff"],  # not UTF-8
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        command = f"{sys.executable} -c {HOLDER} {sock}.lock {padding}".strip()[:120]
        with open_table(path, "direct") as store:
            with pytest.raises(EngramError) as err:
                RowServer(store, sock)
        assert str(err.value) == (f"{sock}.lock is held by pid {holder.pid} (uid {os.geteuid()}: {command}): a row "
                                  f"server already serves {sock}; connect to it, or stop that process first")
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_lock_holder_not_in_proc_locks_is_another_process(table, socket_dir, monkeypatch):
    lock = socket_dir / "rows.sock.lock"
    lock.write_bytes(b"")

    def no_locks(*args, **kwargs):
        raise OSError("no /proc/locks here")

    monkeypatch.setattr(server_module, "open", no_locks, raising=False)
    assert server_module._lock_holder(os.stat(lock)) == "another process"


def test_a_peer_of_an_untrusted_uid_is_refused_naming_it(table, socket_dir, monkeypatch):
    path, _ = table
    with serving(path, socket_dir / "rows.sock") as server:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with a, b:
            monkeypatch.setattr(server_module.p, "trusted_uid", lambda uid: False)  # as if this uid were another's
            assert server._why_refused(a) == (f"uid {os.geteuid()} may not read rows from this row server (it "
                                              f"serves its own uid {os.geteuid()} and root): run the ranks as that "
                                              "user")
            monkeypatch.undo()
            assert server._why_refused(a) is None  # served: it counts as a connection now
            assert server.stats()["server"]["connections"] == 1
        # the connection is closed while still counted, as when its thread ends during close():
        # close() still removes the socket file, closes the store and lets the lock go
        server.close()
        assert not (socket_dir / "rows.sock").exists() and server.store.closed
    with serving(path, socket_dir / "rows.sock"):
        pass


def test_a_connection_that_fails_is_logged_in_one_line_and_closed(table, socket_dir, capfd):
    path, expected = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock) as server:
        def broken() -> dict:
            raise RuntimeError("the stats are broken")

        raw = Raw(sock)
        try:
            server.store.stats = broken  # type: ignore[method-assign]
            raw.sock.send(p.encode(p.STATS))
            assert raw.sock.recv(p.MAX_MESSAGE) == b""  # the server closed this connection
        finally:
            raw.close()
        del server.store.stats
        with RowClient(sock) as client:  # the others go on
            assert np.array_equal(client.read_raw([1]).numpy(), expected[[1]])
    assert "engram-offload row server: a connection failed: RuntimeError: the stats are broken\n" in \
        capfd.readouterr().err


def test_the_descriptor_limit_named_is_the_soft_one(monkeypatch):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
    try:
        assert server_module._descriptor_limit() == soft - 1
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---------------------------------------------------------------------- accept() failing, in this process
NOW = "now"  # a scripted failure raised at once, with no connection waiting


class ScriptedListener:
    """The server's listening socket with ``accept`` failures scripted: each call takes the next
    entry of ``script``: an errno to raise (a blocking call first waits until a connection is
    waiting, as a real accept that fails for want of a descriptor still has one in its backlog),
    ``(NOW, errno)`` to raise at once, or None for the real accept; past the script every call is
    real. ``calls`` records each call as (the listener blocking?, the server's spare descriptor)."""

    def __init__(self, server: RowServer, script: list) -> None:
        self.server, self.real, self.script = server, server._listener, list(script)
        self.calls: list[tuple[bool, int]] = []
        self.called = threading.Condition()
        server._listener = self  # type: ignore[assignment]

    def wait_calls(self, n: int) -> None:
        """Return once accept has been called ``n`` times."""
        with self.called:
            assert self.called.wait_for(lambda: len(self.calls) >= n, timeout=30)

    def accept(self) -> tuple[socket.socket, object]:
        blocking = self.real.getblocking()
        with self.called:
            self.calls.append((blocking, self.server._spare))
            self.called.notify_all()
        entry = self.script.pop(0) if self.script else None
        if isinstance(entry, tuple):
            entry = entry[1]
        elif entry is not None and blocking:
            select.select([self.real], [], [])
        if entry is not None:
            raise OSError(entry, os.strerror(entry))
        return self.real.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def _scripted(table, sock: Path, script: list):
    box: list[ScriptedListener] = []
    return serving(table[0], sock, before=lambda server: box.append(ScriptedListener(server, script))), box


def test_accept_short_of_descriptors_refuses_with_the_spare_or_serves_when_one_was_freed(table, socket_dir):
    """accept() fails for want of a descriptor: the spare is given up (-1 while the connection
    is accepted), the connection refused naming the limit, the spare taken again; a descriptor
    freed meanwhile serves the connection; one gone meanwhile, or whose second accept fails,
    is left for the next accept, which serves it. (``calls`` past those checked may still grow:
    the server goes back to accept once a connection is served.)"""
    path, expected = table
    sock = socket_dir / "rows.sock"
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    E = errno.EMFILE
    runs = [([E, E, None], "refused"), ([errno.ENFILE, None], "served"), ([errno.ENOBUFS, errno.ECONNABORTED], "left"),
            ([errno.ENOMEM, E, errno.ECONNABORTED], "second accept failed")]
    for script, outcome in runs:
        server_context, box = _scripted(table, sock, script)
        with server_context as server:
            listener = box[0]
            spare = server._spare
            assert spare >= 0
            if outcome == "refused":
                with pytest.raises(TierError, match=rf"refused the connection: the row server is out of file "
                                                    rf"descriptors \(ulimit -n {limit}, 64 connections allowed\): "
                                                    r"close idle clients, or raise its limit$"):
                    RowClient(sock)
                with RowClient(sock) as client:  # the spare taken again: the next one is served
                    assert client.stats()["server"]["refused"] == 1
                assert listener.calls[:3] == [(True, spare), (False, spare), (False, -1)]
                assert listener.calls[3][0] and listener.calls[3][1] >= 0
            else:
                with RowClient(sock) as client:
                    assert np.array_equal(client.read_raw([5, 7]).numpy(), expected[[5, 7]])
                    assert client.stats()["server"]["refused"] == 0
                want = {"served": [(True, spare), (False, spare)],
                        "left": [(True, spare), (False, spare), (True, spare)],
                        "second accept failed": [(True, spare), (False, spare), (False, -1)]}[outcome]
                assert listener.calls[:len(want)] == want
                if outcome == "second accept failed":  # the spare taken again, then the real accept
                    assert listener.calls[3][0] and listener.calls[3][1] >= 0
            assert listener.real.getblocking()
            assert os.fstat(server._spare).st_rdev == os.stat(os.devnull).st_rdev


def test_without_a_spare_descriptor_the_server_waits_for_one_and_goes_on(table, socket_dir, monkeypatch):
    """The spare cannot be taken again after a refusal (-1), nor at the next failed accept (the
    server waits and goes back to accept); the one after takes it and serves the connection. A
    failure with no connection waiting goes back to accept."""
    path, expected = table
    sock = socket_dir / "rows.sock"
    E = errno.EMFILE
    opened = os.open
    refusals = [2]

    def open_short(name: str, flags: int, *args: int) -> int:
        if name == os.devnull and refusals[0] > 0:
            refusals[0] -= 1
            raise OSError(E, os.strerror(E))
        return opened(name, flags, *args)

    server_context, box = _scripted(table, sock, [(NOW, E), E, E, None, E, E, None])
    with server_context as server:
        listener = box[0]
        spare = server._spare
        monkeypatch.setattr(server_module.os, "open", open_short)
        listener.wait_calls(2)  # the failure with no connection waiting is over: select() found none
        with pytest.raises(TierError, match="refused the connection: the row server is out of file descriptors"):
            RowClient(sock)
        with RowClient(sock) as client:
            assert np.array_equal(client.read_raw([3]).numpy(), expected[[3]])
            assert client.stats()["server"]["refused"] == 1
        monkeypatch.undo()
        assert refusals == [0]
        # no connection at the first failure: select() found none and accept was not tried again
        assert listener.calls[:7] == [(True, spare), (True, spare), (False, spare), (False, -1),
                                      (True, -1), (True, -1), (False, listener.calls[6][1])]
        assert listener.calls[6][1] >= 0
        assert os.fstat(server._spare).st_rdev == os.stat(os.devnull).st_rdev


def test_accept_errors_the_server_goes_past_and_those_it_raises(table, socket_dir):
    path, expected = table
    sock = socket_dir / "rows.sock"
    server_context, box = _scripted(table, sock, [errno.ECONNABORTED, errno.EINTR, errno.EPROTO])
    with server_context:
        with RowClient(sock) as client:
            assert np.array_equal(client.read_raw([2]).numpy(), expected[[2]])
        assert len(box[0].calls) >= 4
    with open_table(path, "direct") as store:
        server = RowServer(store, sock)
        ScriptedListener(server, [(NOW, errno.EBADF)])
        with pytest.raises(OSError, match=r"^\[Errno 9\] Bad file descriptor$"):
            server.serve_forever()
        server.close()


def test_the_lock_holder_is_the_flock_of_that_file_whatever_is_listed_before_it(socket_dir, monkeypatch):
    """``/proc/locks`` lists every lock of the machine: a POSIX lock of the same file, an flock of
    another file and a short line come before the holder's; a pid that has gone is named alone."""
    lock = socket_dir / "rows.sock.lock"
    lock.write_bytes(b"")
    info = os.stat(lock)
    where = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    other = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino + 1}"
    gone = 1 << 22  # above any pid_max: no such process

    def listing(pid: int):
        lines = [f"1: POSIX  ADVISORY  WRITE 7 {where} 0 EOF", f"2: FLOCK  ADVISORY  WRITE 8 {other} 0 EOF",
                 "3: FLOCK  ADVISORY  WRITE", f"4: FLOCK  ADVISORY  WRITE {pid} {where} 0 EOF",
                 f"5: FLOCK  ADVISORY  WRITE 9 {where} 0 EOF"]
        return lambda *args, **kwargs: io.StringIO("".join(line + "\n" for line in lines))

    command = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    monkeypatch.setattr(server_module, "open", listing(os.getpid()), raising=False)
    assert server_module._lock_holder(info) == f"pid {os.getpid()} (uid {os.geteuid()}: {command[:120]})"
    monkeypatch.setattr(server_module, "open", listing(gone), raising=False)
    assert server_module._lock_holder(info) == f"pid {gone}"
