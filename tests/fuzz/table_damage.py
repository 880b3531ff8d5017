"""Damaging table files on purpose: headers rewritten with a valid checksum, raw rows of a file."""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from engram_offload.table.format import MAGIC, PREFIX, TableLayout


def header_meta(path: str | Path) -> dict:
    """The header JSON of a table file, as a dict."""
    data = Path(path).read_bytes()
    _, _, length, _ = PREFIX.unpack(data[:PREFIX.size])
    return json.loads(data[PREFIX.size:PREFIX.size + length])


def rewrite_header(src: str | Path, dst: str | Path, meta: object, version: int | None = None) -> None:
    """Copy ``src`` to ``dst`` with its header JSON replaced by ``meta`` under a VALID checksum
    (and the prefix's format ``version``: by default ``src``'s).

    The data stays where it was; a body longer than the old header area overwrites the start
    of the data (a damage of its own)."""
    data = bytearray(Path(src).read_bytes())
    if version is None:
        version = PREFIX.unpack(data[:PREFIX.size])[1]
    body = json.dumps(meta, sort_keys=True).encode()
    head = PREFIX.pack(MAGIC, version, len(body), xxhash.xxh3_64_intdigest(body)) + body
    old_length = PREFIX.unpack(data[:PREFIX.size])[2]
    data[PREFIX.size:PREFIX.size + old_length] = bytes(old_length)  # clear the old JSON
    data[:len(head)] = head
    Path(dst).write_bytes(bytes(data))


def rows_on_disk(path: str | Path, layout: TableLayout) -> np.ndarray:
    """Raw rows ``uint8 [num_rows, row_bytes]`` read straight from the file's bytes at ``layout``."""
    data = np.fromfile(path, np.uint8)
    offsets = layout.row_offsets(np.arange(layout.num_rows, dtype=np.int64))
    return data[offsets[:, None] + np.arange(layout.row_bytes)]


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail with ``TimeoutError`` instead of hanging when the block runs past ``seconds``
    (main thread only: it uses SIGALRM)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
