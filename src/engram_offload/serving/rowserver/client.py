"""``RowClient``: a rank's view of the machine's row server, with the store's interface.

A ``RowStore`` (``fetch``, ``read_raw``, ``gather``, ``decode`` and ``stats`` as a
``TableStore``'s), so a Prefetcher or a benchmark can use one in place of a store.
The ids go into the connection's shared buffer, one small message asks for them, and the
server's reply means the rows are in the buffer; the client copies them out before its next
request. ``start_row_server`` starts the server process and waits until it answers.

``open_table(path, tier, row_server=socket)`` opens one. With ``columns`` the client asks only
for the rows of that column shard (others raise ``IndexError`` before any round trip); the
server's one cache serves every rank, so TP ranks' disjoint rows are cached once anyway.

The client believes nothing the server says about itself: the server must run as this
process's uid or root (``SO_PEERCRED``), and with ``table`` (the file this rank opened
itself) the header is the file's, and rows it receives are compared with the file's own
rows, read and checked against the file's page (or block) checksums: a sample of rows at
connect and of every fetch (``verify="sample"``), or every row (``verify="all"``). Every
wait on the server is bounded by ``timeout_s``; a server that does not answer in time (a
stopped or wedged process) raises ``TierError`` naming what was waited for, and the
connection is dropped.
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...cache.lease import RowsInPlace
from ...engram.config import EngramConfig
from ...errors import ChecksumError, EngramError, TableFormatError, TierError
from ...table.format import read_header
from ...tiers.mmap import MmapTier
from ..rowstore import RowStore
from ..sharding import Columns, ShardRows, check_columns, require_in_shard, shard_rows
from . import protocol as p

__all__ = ["RemoteLease", "RowClient", "start_row_server", "DEFAULT_TIMEOUT_S", "VERIFY_MODES"]

DEFAULT_TIMEOUT_S = 30.0  # the longest wait for one reply of the server
VERIFY_MODES = ("sample", "all", "none")
VERIFY_AT_CONNECT = 16  # rows compared with the table file when connecting
VERIFY_PER_FETCH = 2  # rows compared per fetch with verify="sample"

_RAISED_AS = {cls.__name__: cls for cls in (IndexError, ValueError, TypeError, ChecksumError, TierError,
                                             TableFormatError)}


class RemoteLease:
    """Rows of distinct ids (``raw: uint8 [u, row_bytes]``, the client's own copy) and the
    server-side leases that keep them pinned in the shared cache until ``release``."""

    ready: object = None  # rows are in ``raw`` (on the host) when fetch returns
    in_place: RowsInPlace | None = None  # always None: the rows are the client's own copy, never left in a cache

    def __init__(self, ids: np.ndarray, raw: torch.Tensor, client: "RowClient", numbers: list[int]) -> None:
        self.ids = ids
        self.raw = raw
        self._client = client
        self._numbers = numbers
        self._lock = threading.Lock()

    @property
    def host_raw(self) -> np.ndarray:
        return self.raw.numpy()

    def release(self) -> None:
        with self._lock:
            numbers, self._numbers = self._numbers, []
        if numbers:
            self._client._release(numbers)

    def __enter__(self) -> "RemoteLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a forgotten lease must not pin rows for the connection's life
        try:
            self.release()
        except Exception:
            pass


class RowClient(RowStore):
    """A connection to the row server at ``socket_path``; thread-safe (one request at a time).

    ``table``: the table file this rank expects; a server serving another table (another
    fingerprint) is refused with a ``TierError``, and the rows received are verified against
    it (``verify``: ``"sample"``, ``"all"`` or ``"none"``; see the module doc). ``columns``:
    this rank's column shard, the only rows it may fetch (None: every row). ``timeout_s``:
    the longest wait for the server's reply to one request (and for its hello).
    """

    def __init__(self, socket_path: str | os.PathLike[str], table: str | os.PathLike[str] | None = None, *,
                 columns: Columns | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 verify: str = "sample") -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        self.socket_path = str(socket_path)
        self.timeout_s = float(timeout_s)
        self._broken: str | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(self.timeout_s)
        header = read_header(table) if table is not None else None
        try:
            hello, fd = self._handshake()
        except BaseException:
            self._sock.close()
            raise
        try:
            self._buffer = _map_buffer(fd, hello, self.socket_path)
        except BaseException:
            self._sock.close()
            raise
        finally:
            os.close(fd)
        if header is not None and (header.fingerprint() != hello["fingerprint"]
                                   or header.layout.row_bytes != hello["row_bytes"]):
            self._buffer.close()
            self._sock.close()
            raise TierError(f"the row server at {self.socket_path} serves {hello['table']}, not {table} (their "
                            "headers or checksums differ): start a server for this table on another socket")
        super().__init__(header.config if header is not None else EngramConfig(**hello["config"]),
                         header.layout.num_rows if header is not None else int(hello["num_rows"]))
        self._rb = int(hello["row_bytes"])  # the buffer's rows (the table's, when it is given)
        self.max_rows = int(hello["max_rows"])
        self.table = hello["table"]
        self.tier = str(hello.get("tier", "direct"))  # the server's tier
        self._shard: ShardRows | None = None
        self._ids = np.frombuffer(self._buffer, np.int64, count=self.max_rows)  # [max_rows]
        self._rows = np.frombuffer(self._buffer, np.uint8, count=self.max_rows * self._rb,
                                   offset=hello["rows_offset"]).reshape(-1, self._rb)  # [max_rows, row_bytes]
        self._lock = threading.RLock()  # a lease collected during a request may release from within it
        self._round_trips = 0
        self.verify = verify if header is not None else "none"
        self._rng = np.random.default_rng()
        self._file: MmapTier | None = None
        self.rows_verified = 0
        if self.verify != "none":
            assert header is not None
            try:
                self._file = MmapTier(header)  # each row from a page that passed its checksum
                count = min(VERIFY_AT_CONNECT, self._num_rows)  # distinct rows: a repeat would leave the count short
                probe = np.sort(self._rng.choice(self._num_rows, count, replace=False))
                self._fetch(probe, False, None)  # compared with the file in full
            except BaseException:
                self.close()
                raise
        self.columns = None if columns is None else check_columns(columns, self._config.cols_per_layer)
        self._shard = None if self.columns is None else shard_rows(self._config, self.columns)

    def _handshake(self) -> tuple[dict[str, Any], int]:
        """Connect, check the server's uid, read its hello -> (hello, the buffer's memfd)."""
        try:
            self._sock.connect(self.socket_path)
        except OSError as exc:
            raise TierError(f"no row server answers at {self.socket_path} ({exc.strerror or exc}): "
                            "start one with start_row_server(table, socket)") from None
        pid, uid, _ = p.peer_credentials(self._sock)
        if not p.trusted_uid(uid):
            raise TierError(f"the row server at {self.socket_path} (pid {pid}) runs as uid {uid}, neither yours "
                            f"({os.geteuid()}) nor root: another user holds the socket path; put the socket in a "
                            "folder only you can write")
        try:
            # room for two: a hello passing more than its one buffer is refused, not cut to one
            message, fds, _, _ = socket.recv_fds(self._sock, p.MAX_MESSAGE, 2)
        except TimeoutError:
            raise TierError(f"the row server at {self.socket_path} (pid {pid}) did not say hello within "
                            f"{self.timeout_s:g} s: is it stopped or wedged? restart it (RowClient timeout_s= sets "
                            "the wait)") from None
        except OSError as exc:
            raise TierError(f"the row server at {self.socket_path} failed at connect ({exc})") from None
        try:
            op, _, _, _, hello = p.decode(message) if message else (b"", 0, 0, 0, None)
        except ValueError:
            op, hello = b"?", None
        if op == p.ERROR and isinstance(hello, dict):
            for fd in fds:
                os.close(fd)
            raise TierError(f"the row server at {self.socket_path} refused the connection: {hello.get('message')}")
        if op != p.HELLO or len(fds) != 1 or not isinstance(hello, dict):
            for fd in fds:
                os.close(fd)
            raise TierError(f"{self.socket_path} is not an engram-offload row server (it said {op!r})")
        return hello, fds[0]

    # ------------------------------------------------------------------ reading rows
    def _lease(self, ids: np.ndarray, hold: bool, requested: int | None, in_place: bool) -> RemoteLease:
        """With ``hold`` the rows stay pinned in the server's cache until the lease is released
        (or this client's connection ends); ``in_place`` has no effect: the rows always come as
        this client's copy."""
        raw, numbers = self._fetch(ids, hold, requested)
        return RemoteLease(ids, raw, self, numbers)

    def _fetch(self, ids: np.ndarray, hold: bool, requested: int | None) -> tuple[torch.Tensor, list[int]]:
        """Rows ``[u, row_bytes]`` of checked distinct ids, in pieces of ``max_rows``; the
        server's lease numbers (empty unless ``hold``)."""
        if self._shard is not None and self.columns is not None:
            require_in_shard(self._shard, self.columns, ids)
        out = np.empty((ids.size, self._rb), np.uint8)  # [u, row_bytes]
        numbers: list[int] = []
        requested = ids.size if requested is None else int(requested)
        if requested < ids.size:
            raise ValueError(f"a fetch of {ids.size} ids stands for {ids.size} to more lookups, not {requested:,}: "
                             "pass requested= as the lookups before deduplication")
        with self._lock:
            try:
                for start in range(0, ids.size, self.max_rows):
                    piece = ids[start: start + self.max_rows]
                    self._ids[: piece.size] = piece
                    flags = p.HOLD if hold else 0
                    # the lookups this piece stands for: the first takes the duplicates, so the
                    # pieces add up to ``requested`` (the server counts each piece's)
                    lookups = requested - (ids.size - piece.size) if start == 0 else piece.size
                    value, _, _ = self._ask(p.encode(p.FETCH, flags, piece.size, lookups),
                                            f"a fetch of {piece.size} rows")
                    out[start: start + piece.size] = self._rows[: piece.size]
                    if value:
                        numbers.append(value)
                self._verify_rows(ids, out)
            except BaseException:
                self._release_locked(numbers)
                raise
        return torch.from_numpy(out), numbers

    def _verify_rows(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Compare received rows ``[u, row_bytes]`` of ``ids`` (a sample, or all) with the table
        file's, read and checked against its checksums; ``TierError`` on any difference."""
        if self._file is None or not ids.size:
            return
        pick = np.arange(ids.size)
        if self.verify == "sample" and ids.size > VERIFY_PER_FETCH and self.rows_verified >= VERIFY_AT_CONNECT:
            pick = np.unique(self._rng.integers(0, ids.size, VERIFY_PER_FETCH))
        want = self._file.read_rows(ids[pick], torch.empty((pick.size, self._rb), dtype=torch.uint8)).numpy()
        wrong = np.flatnonzero((want != rows[pick]).any(axis=1))
        self.rows_verified += int(pick.size)
        if wrong.size:
            row = int(ids[pick[wrong[0]]])
            raise TierError(f"the row server at {self.socket_path} sent row {row} different from "
                            f"{self._file.header.path} ({wrong.size} of {pick.size} rows checked): it serves wrong "
                            "rows; stop it and start a server for this table")

    def _ask(self, message: bytes, what: str) -> tuple[int, int, Any]:
        """Send a request, wait at most ``timeout_s`` for its reply -> (value, extra, payload);
        raise a server error. ``what``: the request, for messages."""
        if self.closed:
            raise ValueError("this row client is closed: connect again")
        if self._broken is not None:
            raise TierError(self._broken)
        cause: OSError | None = None
        try:
            self._sock.send(message)
            reply = self._sock.recv(p.MAX_MESSAGE)
        except TimeoutError:
            self._broken = (f"the row server at {self.socket_path} did not answer {what} within {self.timeout_s:g} s "
                            "(stopped or wedged?): the connection was dropped; restart the server and reconnect "
                            "(timeout_s= sets the wait)")
            self._sock.close()  # a late reply must not be taken for the next request's
            raise TierError(self._broken) from None
        except OSError as exc:
            reply, cause = b"", exc
        if not reply:
            raise TierError(f"the row server at {self.socket_path} closed the connection"
                            f"{f' ({cause})' if cause else ''}: restart it and reconnect") from cause
        self._round_trips += 1
        op, _, value, extra, payload = p.decode(reply)
        if op == p.ERROR:
            kind = _RAISED_AS.get(payload["type"])
            if kind is None:
                raise TierError(f"the row server failed: {payload['type']}: {payload['message']}")
            raise kind(payload["message"])
        return value, extra, payload

    def _release(self, numbers: list[int]) -> None:
        with self._lock:
            self._release_locked(numbers)

    def _release_locked(self, numbers: list[int]) -> None:
        if self.closed or self._broken is not None:
            return  # the server released them when the connection ended
        try:
            for number in numbers:
                self._sock.send(p.encode(p.RELEASE, value=number))
        except OSError:
            pass  # the server is gone, and its leases with it

    # ------------------------------------------------------------------ statistics, life cycle
    def stats(self) -> dict[str, Any]:
        """The server's stats (``store``, ``levels``, ``tier``, ``server``: every rank's
        fetches together) plus ``client``: this connection's round trips."""
        with self._lock:
            _, _, payload = self._ask(p.encode(p.STATS), "a stats request")
            return {**payload, "client": {"round_trips": self._round_trips, "max_rows": self.max_rows,
                                          "verify": self.verify, "rows_verified": self.rows_verified}}

    def close(self) -> None:
        """Close the connection: the server releases whatever it still holds for it."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._sock.close()
        self._ids = self._rows = None  # type: ignore[assignment]
        try:
            self._buffer.close()
        except BufferError:
            pass
        if self._file is not None:
            self._file.close()

    def __repr__(self) -> str:
        return f"RowClient({self.socket_path!r}, table={self.table!r}, rows={self._num_rows:,})"


def _map_buffer(fd: int, hello: dict[str, Any], socket_path: str) -> mmap.mmap:
    """Map the connection's exchange buffer, once its size holds what the hello says."""
    try:
        nbytes, rows_offset = int(hello["buffer_bytes"]), int(hello["rows_offset"])
        needed = max(int(hello["max_rows"]) * 8, rows_offset + int(hello["max_rows"]) * int(hello["row_bytes"]))
    except (KeyError, TypeError, ValueError):
        raise TierError(f"{socket_path} is not an engram-offload row server (its hello lacks the buffer's layout)") from None
    size = os.fstat(fd).st_size
    if size < nbytes or nbytes < needed:
        raise TierError(f"the row server at {socket_path} sent a {size:,}-byte buffer (its hello says {nbytes:,}) for "
                        f"a layout of {needed:,} bytes: restart it (an older or foreign server?)")
    return mmap.mmap(fd, nbytes)


def start_row_server(table: str | os.PathLike[str], socket_path: str | os.PathLike[str], *, tier: str = "direct",
                     cache_bytes: int = 0, policy: str | None = None, max_rows: int | None = None,
                     max_connections: int | None = None, timeout: float = 60.0) -> subprocess.Popen:
    """Start ``engram-offload row-server`` (its default ``policy``: ``lfu``) and wait until it
    answers at ``socket_path``; ``EngramError`` with its message when it exits first. The
    server's stderr goes to an unnamed temporary file (a pipe nobody reads would block it once full)."""
    command = [sys.executable, "-m", "engram_offload.cli", "row-server", "--table", str(table),
               "--socket", str(socket_path), "--tier", tier, "--cache-bytes", str(int(cache_bytes))]
    for option, value in (("--policy", policy), ("--max-rows", max_rows), ("--max-connections", max_connections)):
        if value is not None:
            command += [option, str(value)]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server.poll() is not None:
                log.seek(0)
                said = log.read()[-4000:].decode(errors="replace").strip()
                raise EngramError(f"the row server exited ({server.returncode}): {said}")
            if Path(socket_path).exists():
                try:
                    RowClient(socket_path, timeout_s=max(1.0, deadline - time.monotonic()), verify="none").close()
                    return server
                except TierError:
                    pass
            time.sleep(0.05)
    server.kill()
    server.wait()
    raise EngramError(f"the row server did not answer at {socket_path} within {timeout:.0f} s")
