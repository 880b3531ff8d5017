"""``RowClient`` against a row server in a thread of this process: the store's interface
(gather, decode, read_raw, fetch, stats) value for value, and rows checked against a
damaged copy of the table file."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import threading

import numpy as np
import pytest
import torch

from engram_offload.cli import main
from engram_offload.errors import ChecksumError, EngramError, TierError
from engram_offload.serving.rowserver import RowClient, start_row_server
from engram_offload.serving.rowserver import protocol as p
from engram_offload.serving.rowserver import server as server_module
from engram_offload.serving.rowserver.client import VERIFY_AT_CONNECT
from engram_offload.serving.store import open_table
from engram_offload.table import make_random_table, read_header

from row_servers import ROW_BYTES, serving
from tiny_tables import tiny_config


def damaged_copy(path, tmp_path):
    """A copy of the table whose every data byte is flipped (its header and checksum trailer kept)."""
    copy = tmp_path / "copy.table"
    shutil.copyfile(path, copy)
    layout = read_header(path).layout
    start, end = layout.data_offset, layout.trailer_offset
    data = bytearray(copy.read_bytes())
    data[start:end] = bytes(b ^ 0xFF for b in data[start:end])
    copy.write_bytes(bytes(data))
    return copy


def test_gather_and_decode_are_the_stores(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    ids = np.array([[5, 9, 5], [690, 3, 9]])
    with serving(path, sock, max_rows=100), RowClient(sock) as client, open_table(path, "memory") as local:
        for dtype in (torch.float32, torch.bfloat16):
            got, want = client.gather(ids, dtype), local.gather(ids, dtype)
            assert got.dtype == dtype and got.shape == (2, 3, local.config.head_dim)
            assert torch.equal(got, want)
        assert torch.equal(client.gather(ids), local.gather(ids, torch.float32))
        assert client.gather(7).shape == local.gather(7).shape == (1, local.config.head_dim)  # a single id
        assert torch.equal(client.gather(7), local.gather(7))
        before = client.stats()["store"]
        client.gather(ids)
        after = client.stats()["store"]
        assert (after["rows_requested"] - before["rows_requested"], after["rows_unique"] - before["rows_unique"]) \
            == (6, 4)  # the lookups before deduplication are counted, not the distinct ids
        raw = client.read_raw([3, 5, 9])
        index = np.array([12, 10, 11, 10])
        for dtype in (torch.float32, torch.float16):
            assert torch.equal(client.decode(raw, dtype, index=index, index_base=10),
                               local.decode(raw, dtype, index=index, index_base=10))
        assert torch.equal(client.decode(raw, index=np.array([2, 0])), local.decode(raw, index=np.array([2, 0])))
        assert torch.equal(client.decode(raw), local.decode(raw))
        assert client.decode(raw).dtype == torch.float32
        assert torch.equal(client.decode(raw, shape=(3, 1)), local.decode(raw, shape=(3, 1)))


def test_rows_are_checked_against_the_table_files_page_checksums(table, socket_dir, tmp_path):
    path, expected = table
    sock = socket_dir / "rows.sock"
    copy = damaged_copy(path, tmp_path)
    with serving(path, sock, max_rows=100):
        with pytest.raises(ChecksumError, match=rf"^{copy}: data page \d+ \(rows \d+\.\.\d+\) does not match its "
                                                r"checksum after a re-read; the table is damaged"):
            RowClient(sock, table=copy, verify="all")
        with RowClient(sock, table=path, verify="all") as client:
            fd = client._file._fd
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # not inherited by the engine's children
            assert np.array_equal(client.read_raw([0, 690]).numpy(), expected[[0, 690]])


class Tampered:
    """A store lease whose rows at ``positions`` (of the fetch) are flipped, as a faulty server sends them."""

    in_place = None  # its rows are its own copy

    def __init__(self, lease, positions: list[int]) -> None:
        self._lease = lease
        self.host_raw = lease.host_raw.copy()
        self.host_raw[[p for p in positions if p < len(self.host_raw)]] ^= 0xFF  # read when the lease is made

    def release(self) -> None:
        self._lease.release()


def tampering(path, positions: list[int]):
    """A store whose every fetch comes back with the rows at ``positions`` flipped."""
    store = open_table(path, "direct")
    fetch = store.fetch
    store.fetch = lambda ids, **options: Tampered(fetch(ids, **options), positions)  # type: ignore[method-assign]
    return store


def test_a_wrong_row_is_named_with_how_many_of_those_checked_were_wrong(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock, store=tampering(path, [1, 2]), max_rows=100):
        client = RowClient(sock, table=path, verify="none")  # connects without a check
        client.close()
        with pytest.raises(TierError, match=rf"^the row server at {sock} sent row (\d+) different from {path} "
                                            r"\(2 of (\d+) rows checked\): it serves wrong rows; stop it and start a "
                                            r"server for this table$") as err:
            RowClient(sock, table=path, verify="all")  # the connect's probe: every row compared
        assert int(err.value.args[0].split("(2 of ")[1].split(" ")[0]) >= 3


def test_the_connect_check_compares_sixteen_distinct_rows_whatever_the_draw(table, socket_dir, monkeypatch):
    """Whatever the generator draws (a draw of 16 ids with repeats among them), the connect check
    compares 16 distinct rows, so the sampled check starts with the first fetch after it."""
    path, _ = table
    sock = socket_dir / "rows.sock"
    generator = np.random.default_rng
    with serving(path, sock, max_rows=100):
        for seed in range(40):
            monkeypatch.setattr(np.random, "default_rng", lambda *args, seed=seed: generator(seed))
            with RowClient(sock, table=path) as client:
                assert client.rows_verified == VERIFY_AT_CONNECT, seed
                client.read_raw(np.arange(100))
                assert client.rows_verified <= VERIFY_AT_CONNECT + 2, seed


def test_a_sampled_fetch_checks_two_draws_of_its_rows_including_the_first(table, socket_dir):
    """After the connect's check, a fetch of more than two rows has two random draws of them
    compared, the first row among those that can be drawn; a fetch of two rows, both."""
    path, expected = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock, max_rows=100), RowClient(sock, table=path) as client:
        assert client.verify == "sample"
        client.read_raw(np.arange(16))  # checked in full: 16 rows and more verified since the connect
        client._rng = np.random.default_rng(5)  # the draws, made repeatable
        for _ in range(10):
            before = client.rows_verified
            client.read_raw([8, 9])
            assert client.rows_verified - before == 2
        counts = []
        for _ in range(20):
            before = client.rows_verified
            assert np.array_equal(client.read_raw([20, 21, 22]).numpy(), expected[[20, 21, 22]])
            counts.append(client.rows_verified - before)
        assert set(counts) == {1, 2}  # two draws, at times the same row twice
    wrong: list[int] = []
    with serving(path, sock, store=tampering(path, wrong), max_rows=100):
        client = RowClient(sock, table=path)
        client.read_raw(np.arange(16))
        client._rng = np.random.default_rng(6)
        wrong.append(0)  # from now on the first row of every fetch is wrong, and only it
        with pytest.raises(TierError, match="sent row 40 different"):
            for _ in range(40):
                client.read_raw([40, 41, 42])
        client.close()


def test_fetch_takes_sorted_distinct_ids_holds_them_by_default_and_checks_requested(table, socket_dir):
    path, expected = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock, max_rows=100), RowClient(sock) as client:
        trips = client.stats()["client"]["round_trips"]
        with pytest.raises(ValueError, match="sorted"):
            client.fetch(np.array([5, 3]))
        with pytest.raises(ValueError, match=r"^a fetch of 3 ids stands for 3 to more lookups, not 2: pass requested= "
                                             r"as the lookups before deduplication$"):
            client.fetch(np.array([1, 2, 3]), requested=2)
        assert client.stats()["client"]["round_trips"] == trips + 1  # refused here, before any request
        ids = np.array([3, 5, 9])
        with client.fetch(ids) as lease:
            assert np.array_equal(lease.ids, ids) and sum(client.stats()["server"]["pinned_slots"]) == 3
            assert np.array_equal(lease.host_raw, expected[ids])
            assert client.stats()["server"]["leases_held"] == 1
        assert client.stats()["server"]["leases_held"] == 0
        with client.fetch(ids, hold=False) as lease:
            assert sum(client.stats()["server"]["pinned_slots"]) == 0 and client.stats()["server"]["leases_held"] == 0


def test_start_row_server_hands_its_options_to_the_server_process(table, socket_dir):
    path, expected = table
    sock = socket_dir / "rows.sock"
    server = start_row_server(path, sock, cache_bytes=100 * ROW_BYTES, max_rows=50, max_connections=3)
    try:
        with RowClient(sock) as client:
            stats = client.stats()
            assert (stats["server"]["max_rows"], stats["server"]["max_connections"]) == (50, 3)
            assert stats["levels"][0]["policy"] == "lfu" and stats["levels"][0]["capacity_rows"] == 100
            assert client.tier == "direct" and client.max_rows == 50
            assert np.array_equal(client.read_raw(np.arange(120)).numpy(), expected[:120])  # in 3 round trips
            assert client.stats()["client"]["round_trips"] == 2 + 3
    finally:
        server.terminate()
        server.wait(timeout=30)


# ---------------------------------------------------------------------- what a peer says at connect and after
class Peer:
    """A peer on a Unix socket of this process that speaks as a row server would, or would not:
    it accepts one connection, sends ``hello`` (a message and the descriptors to pass with it),
    then answers each request with the next of ``replies`` (then it closes the connection).
    The descriptors are its own: it closes them once sent. A ``hello`` or reply of None is
    never said: the peer goes on to wait for the client's next request or its close."""

    def __init__(self, sock, hello: bytes | None, fds: list[int] = (), replies: list[bytes | None] = ()) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(sock))
        self.listener.listen(1)
        self.requests: list[bytes] = []
        self.thread = threading.Thread(target=self._speak, args=(hello, list(fds), list(replies)), daemon=True)
        self.thread.start()

    def _speak(self, hello: bytes | None, fds: list[int], replies: list[bytes | None]) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(30)
            if hello is not None:
                socket.send_fds(conn, [hello], fds)
            for fd in fds:
                os.close(fd)
            for reply in replies:
                self.requests.append(conn.recv(p.MAX_MESSAGE))
                if reply is not None:
                    conn.send(reply)
            self.requests.append(conn.recv(p.MAX_MESSAGE))  # the client's next request, or its close (b"")

    def close(self) -> None:
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        self.listener.close()


def hello_of(path, max_rows: int = 8, **changes) -> tuple[dict, int]:
    """The hello a server of ``path`` says, changed by ``changes``, and a memfd of its buffer."""
    header = read_header(path)
    rows_offset, nbytes = p.buffer_layout(max_rows, header.layout.row_bytes)
    hello = {"config": header.config.to_dict(), "num_rows": header.layout.num_rows,
             "row_bytes": header.layout.row_bytes, "max_rows": max_rows, "rows_offset": rows_offset,
             "buffer_bytes": nbytes, "tier": "direct", "table": str(path), "fingerprint": header.fingerprint()}
    hello.update(changes)
    fd = os.memfd_create("test-rows")
    os.ftruncate(fd, nbytes)
    return hello, fd


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_bad_options_and_no_server_are_refused_before_any_request(table, socket_dir):
    sock = socket_dir / "rows.sock"
    for timeout in (0, -1.5):
        with pytest.raises(ValueError, match=rf"^timeout_s must be > 0, got {timeout}$"):
            RowClient(sock, timeout_s=timeout)
    with pytest.raises(ValueError, match=r"^verify must be one of sample, all, none, got 'some'$"):
        RowClient(sock, verify="some")
    before = open_descriptors()
    with pytest.raises(TierError, match=rf"^no row server answers at {sock} \(No such file or directory\): start one "
                                        r"with start_row_server\(table, socket\)$"):
        RowClient(sock)
    assert open_descriptors() == before  # the client's socket closed again
    with serving(table[0], sock), RowClient(sock, timeout_s=0.5, verify="all") as client:  # any wait above 0
        assert client.timeout_s == 0.5 and client._sock.gettimeout() == 0.5
        assert client.verify == "none"  # nothing to check against without the table file
        assert client.stats()["client"] == {"round_trips": 1, "max_rows": server_module.DEFAULT_MAX_ROWS,
                                            "verify": "none", "rows_verified": 0}


@pytest.mark.parametrize("said,fds,words", [
    (p.encode(p.ERROR, payload={"type": "TierError", "message": "busy"}), 1, "refused the connection: busy$"),
    (p.encode(p.ERROR, payload=["busy"]), 1, r"is not an engram-offload row server \(it said b'EROR'\)$"),
    (b"", 0, r"is not an engram-offload row server \(it said b''\)$"),
    (b"nonsense", 1, r"is not an engram-offload row server \(it said b'\?'\)$"),
    (p.encode(p.HELLO, payload={"max_rows": 8}), 0, r"is not an engram-offload row server \(it said b'HELO'\)$"),
    (p.encode(p.HELLO, payload={"max_rows": 8}), 2, r"is not an engram-offload row server \(it said b'HELO'\)$"),
    (p.encode(p.HELLO, payload={"max_rows": 8}), 3, r"is not an engram-offload row server \(it said b'HELO'\)$"),
    (p.encode(p.HELLO, payload=[8]), 1, r"is not an engram-offload row server \(it said b'HELO'\)$"),
    (p.encode(p.HELLO, payload={"max_rows": 8}), 1, r"is not an engram-offload row server \(its hello lacks the "
                                                    r"buffer's layout\)$")])
def test_a_peer_that_is_no_row_server_is_named_and_its_descriptors_closed(table, socket_dir, said, fds, words):
    sock = socket_dir / "rows.sock"
    before = open_descriptors()
    sent = [os.memfd_create("test-rows") for _ in range(fds)]
    peer = Peer(sock, said, sent)
    try:
        with pytest.raises(TierError, match=rf"^(the row server at )?{sock} {words}" if "refused" not in words else
                           rf"^the row server at {sock} {words}"):
            RowClient(sock)
    finally:
        peer.close()
    assert open_descriptors() == before  # the client's socket and every descriptor passed to it closed


@pytest.mark.parametrize("change,size", [({"buffer_bytes": 4096}, None), ({}, 4096),
                                         ({"rows_offset": 4096, "buffer_bytes": 4096}, None),
                                         ({"rows_offset": 0, "row_bytes": 1, "buffer_bytes": 63}, 63)])
def test_a_buffer_short_of_its_layout_is_refused(table, socket_dir, change, size):
    """A buffer smaller than the hello says, or a hello whose buffer is smaller than its
    layout: both sizes are named (the second was named as the buffer's own size only)."""
    path, _ = table
    sock = socket_dir / "rows.sock"
    before = open_descriptors()
    hello, fd = hello_of(path, **change)
    sent = os.fstat(fd).st_size
    if size is not None:
        os.ftruncate(fd, size)
    needed = max(8 * 8, hello["rows_offset"] + 8 * hello["row_bytes"])  # the ids, or the rows past them
    peer = Peer(sock, p.encode(p.HELLO, payload=hello), [fd])
    try:
        with pytest.raises(TierError, match=rf"^the row server at {sock} sent a {size or sent:,}-byte buffer \(its "
                                            rf"hello says {hello['buffer_bytes']:,}\) for a layout of {needed:,} "
                                            r"bytes: restart it \(an older or foreign server\?\)$"):
            RowClient(sock)
    finally:
        peer.close()
    assert open_descriptors() == before


def test_a_server_of_another_table_is_refused_by_name(table, socket_dir, tmp_path):
    path, _ = table
    sock = socket_dir / "rows.sock"
    other = make_random_table(tmp_path / "other.table", tiny_config("fp8_e4m3_ue8m0", 64), seed=9)
    for table_file, change in ((other, {}), (path, {"row_bytes": read_header(path).layout.row_bytes - 1})):
        before = open_descriptors()
        hello, fd = hello_of(path, **change)
        peer = Peer(sock, p.encode(p.HELLO, payload=hello), [fd])
        try:
            with pytest.raises(TierError, match=rf"^the row server at {sock} serves {path}, not {table_file} \(their "
                                                r"headers or checksums differ\): start a server for this table on "
                                                r"another socket$"):
                RowClient(sock, table=table_file)
        finally:
            peer.close()
            sock.unlink()
        assert open_descriptors() == before


def test_the_hello_and_the_replies_are_taken_as_the_server_says(table, socket_dir):
    """A peer that says hello as a server would, then answers: its tier, an error of a type the
    client does not raise as such, an error of one it does, then it closes the connection."""
    path, expected = table
    sock = socket_dir / "rows.sock"
    hello, fd = hello_of(path, tier="mmap", table="elsewhere.table")
    replies = [p.encode(p.ERROR, payload={"type": "KeyError", "message": "no such key"}),
               p.encode(p.ERROR, payload={"type": "IndexError", "message": "row 9 is out of range"}),
               p.encode(p.OK, payload={"store": {}})]
    peer = Peer(sock, p.encode(p.HELLO, payload=hello), [fd], replies)
    try:
        client = RowClient(sock)
        assert (client.tier, client.table, client.max_rows, client.num_rows) == \
            ("mmap", "elsewhere.table", 8, read_header(path).layout.num_rows)
        assert repr(client) == f"RowClient({str(sock)!r}, table='elsewhere.table', rows={client.num_rows:,})"
        with pytest.raises(TierError, match=r"^the row server failed: KeyError: no such key$"):
            client.read_raw([1])
        with pytest.raises(IndexError, match=r"^row 9 is out of range$"):
            client.read_raw([9])
        assert client.stats() == {"store": {}, "client": {"round_trips": 3, "max_rows": 8, "verify": "none",
                                                          "rows_verified": 0}}
        with pytest.raises(TierError, match=rf"^the row server at {sock} closed the connection: restart it and "
                                            r"reconnect$"):
            client.stats()
        client.close()
        assert client.closed and client._buffer.closed
        client.close()  # twice: nothing more to do
        with pytest.raises(ValueError, match=r"^this row client is closed: connect again$"):
            client.stats()
    finally:
        peer.close()
    assert [r[:4] for r in peer.requests] == [p.FETCH, p.FETCH, p.STATS, p.STATS]


def test_a_peer_that_does_not_answer_in_time_is_named_and_dropped(table, socket_dir):
    """No hello within ``timeout_s``, and no answer to a request: each is named with what was
    waited for; the unanswered connection is dropped, and every request after says so."""
    path, _ = table
    sock = socket_dir / "rows.sock"
    peer = Peer(sock, None)
    try:
        with pytest.raises(TierError, match=rf"^the row server at {sock} \(pid {os.getpid()}\) did not say hello "
                                            r"within 0.25 s: is it stopped or wedged\? restart it \(RowClient "
                                            r"timeout_s= sets the wait\)$"):
            RowClient(sock, timeout_s=0.25)
    finally:
        peer.close()
    sock.unlink()
    hello, fd = hello_of(path)
    peer = Peer(sock, p.encode(p.HELLO, payload=hello), [fd], [None])
    try:
        client = RowClient(sock, timeout_s=0.25)
        said = (rf"^the row server at {sock} did not answer a stats request within 0.25 s \(stopped or wedged\?\): "
                r"the connection was dropped; restart the server and reconnect \(timeout_s= sets the wait\)$")
        with pytest.raises(TierError, match=said):
            client.stats()
        assert client._sock.fileno() == -1  # a late reply cannot be taken for the next request's
        with pytest.raises(TierError, match=said):
            client.read_raw([1])
        client.close()
    finally:
        peer.close()


def test_start_row_server_says_why_its_server_exits_and_gives_it_no_terminal(table, socket_dir, capfd):
    """The server's stderr comes back in the error (its last 4,000 characters); its stdin is
    /dev/null and its stdout goes nowhere; a server not answering in time is named."""
    path, _ = table
    sock = socket_dir / "rows.sock"
    with pytest.raises(EngramError, match=r"^the row server exited \(2\): engram-offload row-server: error: argument "
                                          r"--max-connections: '0' is not an integer >= 1 \(see engram-offload "
                                          r"row-server --help\)$"):
        start_row_server(path, sock, max_connections=0)
    missing = socket_dir / ("x" * 250) / ("y" * 250) / ("z" * 4000)  # a message longer than 4,000 characters
    assert main(["row-server", "--table", str(missing), "--socket", str(sock)]) == 1
    said = capfd.readouterr().err
    assert len(said) > 4000
    with pytest.raises(EngramError) as err:
        start_row_server(missing, sock)
    assert str(err.value) == f"the row server exited (1): {said[-4000:].strip()}"
    with pytest.raises(EngramError, match=rf"^the row server did not answer at {sock} within 0 s$"):
        start_row_server(path, sock, timeout=0)
    server = start_row_server(path, sock)
    try:
        assert os.readlink(f"/proc/{server.pid}/fd/0") == os.devnull
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert capfd.readouterr().out == ""  # it said "serving ..." before its hello, to /dev/null


def test_a_connection_the_server_ended_is_named_with_its_error_on_the_next_request(table, socket_dir):
    path, _ = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock) as server:
        client = RowClient(sock)
        server.close()  # it shuts down every connection: the client's next send fails
        with pytest.raises(TierError, match=rf"^the row server at {sock} closed the connection \(\[Errno 32\] Broken "
                                            r"pipe\): restart it and reconnect$"):
            client.read_raw([1])
        client.close()


def test_a_buffer_of_exactly_its_layout_is_taken(table, socket_dir):
    """8 ids of 8 bytes and 8 rows of 1 byte from offset 0: 64 bytes are enough (the ids)."""
    path, _ = table
    sock = socket_dir / "rows.sock"
    hello, fd = hello_of(path, rows_offset=0, row_bytes=1, buffer_bytes=64)
    os.ftruncate(fd, 64)
    peer = Peer(sock, p.encode(p.HELLO, payload=hello), [fd])
    try:
        with RowClient(sock) as client:
            assert (client.row_bytes, client.max_rows, len(client._buffer)) == (1, 8, 64)
    finally:
        peer.close()


def test_the_table_file_describes_the_rows_and_a_hello_without_a_tier_is_direct(table, socket_dir):
    """With the table file given, its header (not the hello) gives the config and the row count;
    a buffer longer than its layout (by a part of a row) is taken, its rows view ``max_rows`` long."""
    path, _ = table
    header = read_header(path)
    sock = socket_dir / "rows.sock"
    hello, fd = hello_of(path, num_rows=header.layout.num_rows + 5,
                         config={**header.config.to_dict(), "seed": header.config.seed + 1})
    del hello["tier"]
    hello["buffer_bytes"] += 3
    os.ftruncate(fd, hello["buffer_bytes"])
    peer = Peer(sock, p.encode(p.HELLO, payload=hello), [fd])
    try:
        with RowClient(sock, path, verify="none") as client:
            assert (client.config, client.num_rows) == (header.config, header.layout.num_rows)
            assert (client.tier, client.device, client.closed, client.columns) == ("direct", torch.device("cpu"),
                                                                                  False, None)
            assert client.closed is False
            assert client._rows.shape == (8, header.layout.row_bytes)
    finally:
        peer.close()


def test_a_server_of_an_untrusted_uid_is_named_with_its_pid_and_uid(table, socket_dir, monkeypatch):
    path, _ = table
    sock = socket_dir / "rows.sock"
    with serving(path, sock):
        monkeypatch.setattr(p, "trusted_uid", lambda uid: False)  # as if this uid were another's
        with pytest.raises(TierError, match=rf"^the row server at {sock} \(pid {os.getpid()}\) runs as uid "
                                            rf"{os.geteuid()}, neither yours \({os.geteuid()}\) nor root: another "
                                            r"user holds the socket path; put the socket in a folder only you can "
                                            r"write$"):
            RowClient(sock)
