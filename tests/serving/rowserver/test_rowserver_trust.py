"""The row server on a shared host: who may serve and read rows, bounded waits, refusals
that leave the server serving the others."""

from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_offload.engram.hashing import NgramHasher
from engram_offload.errors import EngramError, TierError
from engram_offload.serving.prefetch import Prefetcher
from engram_offload.serving.rowserver import RowClient, RowServer, start_row_server
from engram_offload.serving.rowserver import protocol as p
from engram_offload.serving.store import open_table
from engram_offload.table import read_header

from tiny_tables import tiny_config

OTHER_UID = 65534  # nobody

# A squatter's row server, standard library only (the other uid cannot import this package):
# it binds the socket path first and hands out buffers of 0x55 bytes under the hello it is given.
FAKE_SERVER = r"""
import json, mmap, os, socket, struct, sys
path, hello = sys.argv[1], json.loads(sys.argv[2])
head = struct.Struct("<4sIQQ")
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
os.umask(0)
listener.bind(path)
listener.listen(8)
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    fd = os.memfd_create("rows")
    os.ftruncate(fd, hello["buffer_bytes"])
    buf = mmap.mmap(fd, hello["buffer_bytes"])
    buf[hello["rows_offset"]:] = b"\x55" * (hello["buffer_bytes"] - hello["rows_offset"])
    socket.send_fds(conn, [head.pack(b"HELO", 0, 0, 0) + json.dumps(hello).encode()], [fd])
    os.close(fd)
    try:
        while True:
            m = conn.recv(1 << 20)
            if not m:
                break
            conn.send(head.pack(b"OK__", 0, 0, 0) + (b"{}" if m[:4] == b"STAT" else b""))
    except OSError:
        pass
    conn.close()
"""

# A client of another uid, standard library only: what the server says at connect.
RAW_CLIENT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    s.connect(sys.argv[1])
except OSError as exc:
    print("connect failed:", exc.strerror)
    sys.exit(0)
message, fds, _, _ = socket.recv_fds(s, 1 << 20, 1)
print(message[:4].decode(), len(fds), message[24:].decode())
"""


def system_python_for_other_uid() -> str:
    """A Python the other uid can run (this one may sit in a folder it cannot enter); skip if none."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a second uid (a child dropping to 65534)")
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and subprocess.run([candidate, "-c", "pass"], user=OTHER_UID,
                                                        group=OTHER_UID, timeout=30).returncode == 0:
            return candidate
    pytest.skip("no Python that uid 65534 may run")


def fake_server(python: str, sock: Path, hello: dict, uid: int | None) -> subprocess.Popen:
    """Start ``FAKE_SERVER`` on ``sock`` (as ``uid``, or this process's); wait until it listens."""
    as_user = {} if uid is None else {"user": uid, "group": uid}
    server = subprocess.Popen([python, "-c", FAKE_SERVER, str(sock), json.dumps(hello)], stdout=subprocess.PIPE,
                              text=True, **as_user)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    return server


def hello_for(path: Path) -> dict:
    """The hello the real server would send for ``path``."""
    header = read_header(path)
    rb = header.layout.row_bytes
    rows_offset, nbytes = p.buffer_layout(64, rb)
    return {"config": header.config.to_dict(), "num_rows": header.layout.num_rows, "row_bytes": rb, "max_rows": 64,
            "rows_offset": rows_offset, "buffer_bytes": nbytes, "tier": "direct", "table": str(path),
            "fingerprint": header.fingerprint()}


def pause(process: subprocess.Popen) -> None:
    """SIGSTOP ``process`` and wait until every thread of it has stopped: the kernel stops the
    other threads only once the one it woke for the signal runs, and on a loaded machine a
    thread already woken by a request could answer it meanwhile."""
    process.send_signal(signal.SIGSTOP)
    tasks = Path(f"/proc/{process.pid}/task")

    def stopped() -> bool:
        states = []
        for task in tasks.iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        return all(state in "tT" for state in states)

    deadline = time.monotonic() + 30
    while not stopped():
        assert time.monotonic() < deadline, f"pid {process.pid} did not stop within 30 s of SIGSTOP"
        time.sleep(0.01)


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGCONT)
    process.kill()
    process.wait(timeout=30)


# ---------------------------------------------------------------------- case 3: a squatted socket
def test_a_socket_squatted_by_another_uid_is_refused(table, socket_dir):
    path, _ = table
    python = system_python_for_other_uid()
    socket_dir.chmod(0o1777)  # a world-writable folder, like /tmp
    sock = socket_dir / "rows.sock"
    squatter = fake_server(python, sock, hello_for(path), OTHER_UID)
    try:
        for table_file in (path, None):
            with pytest.raises(TierError, match=f"runs as uid {OTHER_UID}, neither yours"):
                RowClient(sock, table=table_file)
    finally:
        stop(squatter)


def test_rows_that_differ_from_the_table_file_are_refused(table, socket_dir):
    """A server of a trusted uid serving other rows under the table's fingerprint: the client
    compares what it receives with the file it opened itself."""
    path, expected = table
    python = system_python_for_other_uid() if os.geteuid() == 0 else shutil.which("python3")
    sock = socket_dir / "rows.sock"
    liar = fake_server(str(python), sock, hello_for(path), None)
    try:
        with pytest.raises(TierError, match="sent row .* different from .*t.table"):
            RowClient(sock, table=path)
        with RowClient(sock, table=path, verify="none") as trusting:  # asked for: no check
            assert not np.array_equal(trusting.read_raw([0]).numpy(), expected[[0]])
    finally:
        stop(liar)


def test_a_real_server_passes_the_checks_and_every_row_can_be_verified(table, socket_dir):
    path, expected = table
    server = start_row_server(path, socket_dir / "rows.sock", max_rows=100)
    try:
        with RowClient(socket_dir / "rows.sock", table=path, verify="all") as client:
            ids = np.arange(0, len(expected), 7)
            assert np.array_equal(client.read_raw(ids).numpy(), expected[ids])
            assert client.stats()["client"]["rows_verified"] >= ids.size
        with RowClient(socket_dir / "rows.sock", table=path) as sampled:  # the default: a sample
            assert np.array_equal(sampled.read_raw(ids).numpy(), expected[ids])
            assert 0 < sampled.rows_verified < ids.size
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_socket_is_0600_whatever_the_umask_and_other_uids_are_refused(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    previous = os.umask(0)
    try:
        server = start_row_server(path, sock)
    finally:
        os.umask(previous)
    try:
        assert sock.stat().st_mode & 0o777 == 0o600
        if os.geteuid() != 0:
            return
        python = system_python_for_other_uid()
        socket_dir.chmod(0o755)
        said = subprocess.run([python, "-c", RAW_CLIENT, str(sock)], user=OTHER_UID, group=OTHER_UID,
                              capture_output=True, text=True, timeout=60).stdout
        assert said.startswith("connect failed: Permission denied"), said
        sock.chmod(0o666)  # opened up by hand: the server checks the uid itself
        said = subprocess.run([python, "-c", RAW_CLIENT, str(sock)], user=OTHER_UID, group=OTHER_UID,
                              capture_output=True, text=True, timeout=60).stdout
        assert said.startswith("EROR 0") and f"uid {OTHER_UID} may not read rows" in said, said
        with RowClient(sock) as client:  # the operator is still served
            assert client.stats()["server"]["refused"] == 1
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_held_lock_names_its_holder_and_a_planted_lock_is_refused(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    with open_table(path, "direct") as store:
        fd = os.open(f"{sock}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with pytest.raises(EngramError, match=rf"rows.sock.lock is held by pid {os.getpid()} \(uid"):
                RowServer(store, sock)
        finally:
            os.close(fd)
        os.unlink(f"{sock}.lock")
        target = socket_dir / "elsewhere"
        os.symlink(target, f"{sock}.lock")
        with pytest.raises(EngramError, match="symlink"):
            RowServer(store, sock)
        assert not target.exists()
        os.unlink(f"{sock}.lock")
        if os.geteuid() == 0:
            Path(f"{sock}.lock").touch()
            os.chown(f"{sock}.lock", OTHER_UID, OTHER_UID)
            with pytest.raises(EngramError, match=f"belongs to uid {OTHER_UID}"):
                RowServer(store, sock)


# ---------------------------------------------------------------------- case 7: connections capped
def test_connections_past_the_cap_are_refused_and_the_server_goes_on(table, socket_dir):
    path, expected = table
    sock = socket_dir / "rows.sock"
    server = start_row_server(path, sock, max_connections=2)
    try:
        first = RowClient(sock)
        deadline = time.monotonic() + 30  # start_row_server's probe connection is gone
        while first.stats()["server"]["connections"] > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        second = RowClient(sock)
        with pytest.raises(TierError, match="refused the connection: .* at most 2 connections"):
            RowClient(sock)
        second.close()
        deadline = time.monotonic() + 30
        while first.stats()["server"]["connections"] > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with RowClient(sock) as third:
            assert np.array_equal(third.read_raw([5]).numpy(), expected[[5]])
        first.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


def _settled_descriptors(pid: int, timeout: float = 30.0) -> int:
    """The number of ``pid``'s open descriptors once it has stayed the same for 0.2 s (a
    server that just served a connection closes its socket and buffer on its own thread)."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = len(os.listdir(f"/proc/{pid}/fd"))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.2:
            return now
        time.sleep(0.02)
    raise AssertionError(f"process {pid}'s descriptors did not settle within {timeout} s")


def test_a_server_out_of_file_descriptors_refuses_and_goes_on(table, socket_dir):
    path, expected = table
    sock = socket_dir / "rows.sock"
    server = start_row_server(path, sock)
    try:
        with RowClient(sock) as client:  # the server is wholly up: every lazy import and file opened
            client.read_raw([0])
        in_use = _settled_descriptors(server.pid)  # the warm-up connection's descriptors closed again
        limits = resource.prlimit(server.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, (in_use, limits[1]))  # accept() fails: EMFILE
        for _ in range(3):
            with pytest.raises(TierError, match=f"out of file descriptors \\(ulimit -n {in_use}"):
                RowClient(sock)
        assert server.poll() is None
        resource.prlimit(server.pid, resource.RLIMIT_NOFILE, limits)
        with RowClient(sock) as client:
            assert np.array_equal(client.read_raw([9]).numpy(), expected[[9]])
            assert client.stats()["server"]["refused"] == 3
    finally:
        server.terminate()
        server.wait(timeout=30)


# ---------------------------------------------------------------------- case 12: nothing piles up
def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_malformed_connections_leave_no_blocked_threads(table, socket_dir):
    """Hundreds of junk requests (each a traceback on stderr before): every one is answered,
    and the server's threads go back to what they were."""
    path, _ = table
    sock = socket_dir / "rows.sock"
    server = start_row_server(path, sock)
    try:
        with RowClient(sock) as client:
            before = _threads(server.pid)
            for _ in range(300):
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as junk:
                    junk.settimeout(30)
                    junk.connect(str(sock))
                    _, fds, _, _ = socket.recv_fds(junk, p.MAX_MESSAGE, 1)
                    for fd in fds:
                        os.close(fd)
                    junk.send(b"x")
                    op, _, _, _, payload = p.decode(junk.recv(p.MAX_MESSAGE))
                    assert op == p.ERROR and "malformed request" in payload["message"]
            # the junk connections' threads end on their own time: wait (bounded) for both the
            # threads and the count, since a thread of the server's start-up may end meanwhile
            deadline = time.monotonic() + 30
            while ((_threads(server.pid) > before or client.stats()["server"]["connections"] > 1)
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            assert _threads(server.pid) <= before
            assert client.stats()["server"]["connections"] == 1
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_server_that_exits_at_start_says_why(table, socket_dir):
    with pytest.raises(EngramError, match=r"exited \(2\): .*argument --max-connections: '0' is not an integer >= 1"):
        start_row_server(table[0], socket_dir / "rows.sock", max_connections=0)


# ---------------------------------------------------------------------- case 14: counts checked
def test_requested_counts_from_a_client_are_checked(table, socket_dir):
    path, _ = table
    server = start_row_server(path, socket_dir / "rows.sock")
    try:
        with RowClient(socket_dir / "rows.sock") as client:
            ids = np.arange(5)
            for requested in ((1 << 64) - 1, 4):
                with pytest.raises(ValueError, match=f"a fetch of 5 ids stands for 5 to .*, not {requested:,}"):
                    client.fetch(ids, hold=False, requested=requested)
            client.fetch(ids, hold=False, requested=12).release()
            assert client.stats()["store"]["rows_requested"] == 12
    finally:
        server.terminate()
        server.wait(timeout=30)


# ---------------------------------------------------------------------- case 10: a stopped server
def test_a_stopped_server_times_out_every_wait(table, socket_dir):
    path, expected = table
    sock = socket_dir / "rows.sock"
    server = start_row_server(path, sock)
    try:
        client = RowClient(sock, timeout_s=1)
        pause(server)
        with pytest.raises(TierError, match=r"did not answer a fetch of 1 rows within 1 s \(stopped or wedged"):
            client.read_raw([3])
        with pytest.raises(TierError, match="did not answer"):  # the connection is gone, it says why
            client.read_raw([3])
        client.close()
        with pytest.raises(TierError, match="did not say hello within 1 s"):
            RowClient(sock, timeout_s=1)
        server.send_signal(signal.SIGCONT)
        with RowClient(sock) as again:
            assert np.array_equal(again.read_raw([3]).numpy(), expected[[3]])
    finally:
        stop(server)


def test_the_prefetcher_bounds_its_waits_on_a_stopped_server(table, socket_dir):
    """rows() and close() give up after wait_s, naming the store, however long the store's own wait."""
    path, expected = table
    sock = socket_dir / "rows.sock"
    server = start_row_server(path, sock)
    config = tiny_config("fp8_e4m3_ue8m0", 64)
    token_map = np.arange(1000, dtype=np.int64) % 700
    outcome: dict[str, BaseException | None] = {}
    try:
        client = RowClient(sock, timeout_s=4)
        pf = Prefetcher(client, NgramHasher(config, token_map), wait_s=1)
        pause(server)
        pf.begin_step([1], [np.arange(6)])

        def wait_rows() -> None:  # in a thread: the old code waits forever
            try:
                pf.rows(config.layer_ids[0])
                outcome["rows"] = None
            except BaseException as exc:
                outcome["rows"] = exc

        waiter = threading.Thread(target=wait_rows, daemon=True)
        waiter.start()
        waiter.join(timeout=30)
        assert isinstance(outcome.get("rows"), TimeoutError), outcome
        assert "not delivered after 1 s: RowClient(" in str(outcome["rows"])
        with pytest.raises(TimeoutError, match="still inside a fetch from RowClient"):
            pf.close()
        server.send_signal(signal.SIGCONT)  # the worker's fetch returns: the client goes on
        assert np.array_equal(client.read_raw([0]).numpy(), expected[[0]])
        for worker in pf._workers:
            worker.join(timeout=30)
            assert not worker.is_alive()
        client.close()
    finally:
        stop(server)


def test_rows_through_a_row_client_are_exact(table, socket_dir):
    path, expected = table
    server = start_row_server(path, socket_dir / "rows.sock")
    try:
        with open_table(path, "direct", row_server=socket_dir / "rows.sock") as client:
            assert client.verify == "sample"
            assert torch.equal(client.read_raw([1, 2]), torch.from_numpy(expected[[1, 2]]))
    finally:
        server.terminate()
        server.wait(timeout=30)
