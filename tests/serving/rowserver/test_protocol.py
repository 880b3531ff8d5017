"""The row server's wire format, byte for byte: messages, the exchange buffer's layout, peers."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from engram_offload.serving.rowserver import protocol as p


def test_a_message_is_its_fixed_header_then_its_json_payload():
    header = struct.pack("<4sIQQ", b"FTCH", 1, 2, 3)
    assert p.MSG.size == 24
    assert p.encode(p.FETCH, 1, 2, 3) == header
    assert p.encode(p.FETCH, 1, 2, 3, payload={}) == header + b"{}"
    assert p.encode(p.STATS) == struct.pack("<4sIQQ", b"STAT", 0, 0, 0)
    assert p.encode(p.ERROR, payload={"type": "ValueError", "message": "m"}) == \
        struct.pack("<4sIQQ", b"EROR", 0, 0, 0) + b'{"type": "ValueError", "message": "m"}'
    assert p.decode(header) == (b"FTCH", 1, 2, 3, None)
    assert p.decode(header + b"{}") == (b"FTCH", 1, 2, 3, {})
    assert p.decode(p.encode(p.OK, 0, 1 << 63, 7, payload=[1, "a"])) == (b"OK__", 0, 1 << 63, 7, [1, "a"])


@pytest.mark.parametrize("size", [0, 1, 23])
def test_a_short_message_is_a_value_error_naming_its_size(size):
    with pytest.raises(ValueError, match=rf"^a row-server message is at least 24 bytes, got {size}$"):
        p.decode(b"x" * size)


@pytest.mark.parametrize("max_rows,row_bytes,offset", [(1, 10, 4096), (512, 3, 4096), (513, 3, 8192),
                                                        (0, 5, 0), (1024, 1, 8192), (4097, 1, 36864)])
def test_the_rows_start_at_the_first_page_after_the_ids(max_rows, row_bytes, offset):
    assert p.buffer_layout(max_rows, row_bytes) == (offset, offset + max_rows * row_bytes)


def test_a_peer_is_known_by_what_the_kernel_recorded_and_only_this_uid_or_root_is_trusted():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        assert p.peer_credentials(a) == (os.getpid(), os.geteuid(), os.getegid())
    assert p.trusted_uid(os.geteuid()) and p.trusted_uid(0)
    assert not p.trusted_uid(os.geteuid() + 1)
    assert not p.trusted_uid(-1)
