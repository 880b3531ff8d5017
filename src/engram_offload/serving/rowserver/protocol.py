"""The row server's wire format: small fixed messages on a Unix ``SOCK_SEQPACKET`` socket.

Rows never travel through the socket. At connect the server hands the client a memfd
(``SCM_RIGHTS``) holding one exchange buffer for that connection::

    ids   int64 [max_rows]              from byte 0, written by the client
    rows  uint8 [max_rows, row_bytes]   from ``rows_offset`` (page aligned), written by the server

and every request is one message ``(op, flags, value, extra)``; a reply is the same header
plus, for ``HELO``, ``STAT`` and ``EROR``, a JSON payload. One request is in flight per
connection at a time.

Both ends trust only the operator's uid and root: each reads the other's uid from the
socket (``SO_PEERCRED``, set by the kernel, not by the peer) and refuses any other.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

__all__ = ["MSG", "FETCH", "RELEASE", "STATS", "HELLO", "OK", "ERROR", "HOLD", "encode", "decode", "buffer_layout",
           "peer_credentials", "trusted_uid"]

MSG = struct.Struct("<4sIQQ")  # op, flags, value, extra
MAX_MESSAGE = 1 << 20

FETCH = b"FTCH"  # value: n sorted distinct ids in the buffer; extra: ids they stand for; flags: HOLD
RELEASE = b"RELS"  # value: a lease number; no reply
STATS = b"STAT"  # reply payload: the server's stats
HELLO = b"HELO"  # server -> client at connect, with the memfd; payload: table and buffer facts
OK = b"OK__"  # reply to FETCH; value: the lease number (0: nothing held)
ERROR = b"EROR"  # reply; payload {"type", "message"}

HOLD = 1


def encode(op: bytes, flags: int = 0, value: int = 0, extra: int = 0, payload: Any = None) -> bytes:
    body = b"" if payload is None else json.dumps(payload).encode()
    return MSG.pack(op, flags, value, extra) + body


def decode(message: bytes) -> tuple[bytes, int, int, int, Any]:
    """(op, flags, value, extra, payload or None); ``ValueError`` for a short message."""
    if len(message) < MSG.size:
        raise ValueError(f"a row-server message is at least {MSG.size} bytes, got {len(message)}")
    op, flags, value, extra = MSG.unpack_from(message)
    payload = json.loads(message[MSG.size:]) if len(message) > MSG.size else None
    return op, flags, value, extra, payload


def buffer_layout(max_rows: int, row_bytes: int) -> tuple[int, int]:
    """(rows_offset, total bytes) of a connection's exchange buffer."""
    rows_offset = -(-max_rows * 8 // 4096) * 4096
    return rows_offset, rows_offset + max_rows * row_bytes


_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as the
    kernel recorded them at connect (``SO_PEERCRED``): the peer cannot claim another."""
    return _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))


def trusted_uid(uid: int) -> bool:
    """Whether ``uid`` may serve or read this process's rows: this process's own uid, or root."""
    return uid in (os.geteuid(), 0)
