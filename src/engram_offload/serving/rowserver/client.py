"""``RowClient``: a rank's view of the machine's row server, with the store's interface.

``fetch``, ``read_raw``, ``gather``, ``decode`` and ``stats`` behave as ``TableStore``'s
(the ``RowStore`` protocol), so a Prefetcher or a benchmark can use one in place of a store.
The ids go into the connection's shared buffer, one small message asks for them, and the
server's reply means the rows are in the buffer; the client copies them out before its next
request. ``start_row_server`` starts the server process and waits until it answers.

``open_table(path, tier, row_server=socket)`` opens one. With ``columns`` the client asks only
for the rows of that column shard (others raise ``IndexError`` before any round trip); the
server's one cache serves every rank, so TP ranks' disjoint rows are cached once anyway.
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...buffers.recycle import RecycledArrays
from ...engram.config import EngramConfig
from ...engram.rows import decode_rows
from ...errors import ChecksumError, EngramError, TableFormatError, TierError
from ...table.format import read_header
from ...tiers import as_row_ids
from ..dedup import dedup
from ..sharding import Columns, ShardRows, check_columns, require_in_shard, shard_rows
from . import protocol as p

__all__ = ["RemoteLease", "RowClient", "start_row_server"]

_RAISED_AS = {cls.__name__: cls for cls in (IndexError, ValueError, TypeError, ChecksumError, TierError,
                                             TableFormatError)}


class RemoteLease:
    """Rows of distinct ids (``raw: uint8 [u, row_bytes]``, the client's own copy) and the
    server-side leases that keep them pinned in the shared cache until ``release``."""

    ready: object = None  # rows are in ``raw`` (on the host) when fetch returns

    def __init__(self, ids: np.ndarray, raw: torch.Tensor, client: "RowClient", numbers: list[int]) -> None:
        self.ids = ids
        self.raw = raw
        self._client = client
        self._numbers = numbers
        self._lock = threading.Lock()

    @property
    def host_raw(self) -> np.ndarray:
        return self.raw.numpy()

    @property
    def pinned_rows(self) -> int:
        return int(self.ids.size) if self._numbers else 0

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


class RowClient:
    """A connection to the row server at ``socket_path``; thread-safe (one request at a time).

    ``table``: the table file this rank expects; a server serving another table (another
    fingerprint) is refused with a ``TierError``. ``columns``: this rank's column shard, the
    only rows it may fetch (None: every row).
    """

    def __init__(self, socket_path: str | os.PathLike[str], table: str | os.PathLike[str] | None = None, *,
                 columns: Columns | None = None) -> None:
        self.socket_path = str(socket_path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.connect(self.socket_path)
            message, fds, _, _ = socket.recv_fds(self._sock, p.MAX_MESSAGE, 1)
        except OSError as exc:
            self._sock.close()
            raise TierError(f"no row server answers at {self.socket_path} ({exc.strerror or exc}): "
                            "start one with start_row_server(table, socket)") from None
        op, _, _, _, hello = p.decode(message)
        if op != p.HELLO or len(fds) != 1:
            self._sock.close()
            raise TierError(f"{self.socket_path} is not an engram-offload row server (it said {op!r})")
        try:
            self._buffer = mmap.mmap(fds[0], hello["buffer_bytes"])
        finally:
            os.close(fds[0])
        if table is not None and read_header(table).fingerprint() != hello["fingerprint"]:
            self._sock.close()
            raise TierError(f"the row server at {self.socket_path} serves {hello['table']}, not {table} (their "
                            "headers or checksums differ): start a server for this table on another socket")
        self._config = EngramConfig(**hello["config"])
        self._num_rows = int(hello["num_rows"])
        self._rb = int(hello["row_bytes"])
        self.max_rows = int(hello["max_rows"])
        self.table = hello["table"]
        self.tier = str(hello.get("tier", "direct"))  # the server's tier
        self.columns = None if columns is None else check_columns(columns, self._config.cols_per_layer)
        self._shard: ShardRows | None = None if self.columns is None else shard_rows(self._config, self.columns)
        self._ids = np.frombuffer(self._buffer, np.int64, count=self.max_rows)  # [max_rows]
        self._rows = np.frombuffer(self._buffer, np.uint8, count=self.max_rows * self._rb,
                                   offset=hello["rows_offset"]).reshape(-1, self._rb)  # [max_rows, row_bytes]
        self.device = torch.device("cpu")
        self.sync = None  # rows are in host memory when a fetch returns
        self._lock = threading.RLock()  # a lease collected during a request may release from within it
        self._round_trips = 0
        self.closed = False

    # ------------------------------------------------------------------ the table
    @property
    def config(self) -> EngramConfig:
        return self._config

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def row_bytes(self) -> int:
        return self._rb

    # ------------------------------------------------------------------ reading rows
    def fetch(self, unique_ids: np.ndarray, *, hold: bool = True, requested: int | None = None) -> RemoteLease:
        """Raw rows of sorted distinct ids ``[u]`` -> ``RemoteLease`` (``raw: uint8 [u, row_bytes]``).

        With ``hold`` the rows stay pinned in the server's cache until the lease is released
        (or this client's connection ends)."""
        ids = as_row_ids(unique_ids, self._num_rows, sorted_distinct=True)
        raw, numbers = self._fetch(ids, hold, requested)
        return RemoteLease(ids, raw, self, numbers)

    def read_raw(self, row_ids: Any) -> torch.Tensor:
        """Raw rows ``uint8 [n, row_bytes]`` for ``row_ids`` (any int array-like, flattened)."""
        d = dedup(row_ids)
        raw, _ = self._fetch(as_row_ids(d.unique, self._num_rows), False, d.requested)
        return raw.index_select(0, torch.from_numpy(d.inverse))

    def gather(self, row_ids: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized rows: ids of shape ``S`` -> ``[*S, head_dim]`` of ``dtype``."""
        d = dedup(row_ids)
        raw, _ = self._fetch(as_row_ids(d.unique, self._num_rows), False, d.requested)
        rows = self.decode(raw, dtype)  # [u, head_dim]
        return rows.index_select(0, torch.from_numpy(d.inverse)).reshape(*(d.shape or (1,)), -1)

    def decode(self, raw: torch.Tensor | np.ndarray, dtype: torch.dtype = torch.float32, *,
               index: np.ndarray | None = None, index_base: int = 0,
               shape: tuple[int, ...] | None = None, buffers: RecycledArrays | None = None) -> torch.Tensor:
        return decode_rows(raw, self._config.row_format, self._config.head_dim, dtype, index=index,
                           index_base=index_base, shape=shape, buffers=buffers)

    def _fetch(self, ids: np.ndarray, hold: bool, requested: int | None) -> tuple[torch.Tensor, list[int]]:
        """Rows ``[u, row_bytes]`` of checked distinct ids, in pieces of ``max_rows``; the
        server's lease numbers (empty unless ``hold``)."""
        if self._shard is not None and self.columns is not None:
            require_in_shard(self._shard, self.columns, ids)
        out = np.empty((ids.size, self._rb), np.uint8)  # [u, row_bytes]
        numbers: list[int] = []
        requested = ids.size if requested is None else int(requested)
        with self._lock:
            try:
                for start in range(0, ids.size, self.max_rows):
                    piece = ids[start: start + self.max_rows]
                    self._ids[: piece.size] = piece
                    flags = p.HOLD if hold else 0
                    value, _, _ = self._ask(p.encode(p.FETCH, flags, piece.size, requested if start == 0 else 0))
                    out[start: start + piece.size] = self._rows[: piece.size]
                    if value:
                        numbers.append(value)
            except BaseException:
                self._release_locked(numbers)
                raise
        return torch.from_numpy(out), numbers

    def _ask(self, message: bytes) -> tuple[int, int, Any]:
        """Send a request, wait for its reply -> (value, extra, payload); raise a server error."""
        if self.closed:
            raise ValueError("this row client is closed: connect again")
        cause: OSError | None = None
        try:
            self._sock.send(message)
            reply = self._sock.recv(p.MAX_MESSAGE)
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
        if self.closed:
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
            _, _, payload = self._ask(p.encode(p.STATS))
            return {**payload, "client": {"round_trips": self._round_trips, "max_rows": self.max_rows}}

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

    def __enter__(self) -> "RowClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RowClient({self.socket_path!r}, table={self.table!r}, rows={self._num_rows:,})"


def start_row_server(table: str | os.PathLike[str], socket_path: str | os.PathLike[str], *, tier: str = "direct",
                     cache_bytes: int = 0, policy: str = "lru", max_rows: int | None = None,
                     timeout: float = 60.0) -> subprocess.Popen:
    """Start ``python -m engram_offload.serving.rowserver.server`` and wait until it answers at
    ``socket_path``; ``EngramError`` with its message when it exits first."""
    command = [sys.executable, "-m", "engram_offload.serving.rowserver.server", str(table), str(socket_path),
               "--tier", tier, "--cache", str(int(cache_bytes)), "--policy", policy]
    if max_rows is not None:
        command += ["--max-rows", str(int(max_rows))]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            said = server.stderr.read().strip() if server.stderr is not None else ""
            raise EngramError(f"the row server exited ({server.returncode}): {said}")
        if Path(socket_path).exists():
            try:
                RowClient(socket_path).close()
                return server
            except TierError:
                pass
        time.sleep(0.05)
    server.kill()
    raise EngramError(f"the row server did not answer at {socket_path} within {timeout:.0f} s")
