"""A row server serving from a thread of the test process, for the tests that need the server's
own code to run where they can see it (mutation testing records the calls of this process only)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Callable, Iterator

from engram_offload.serving.rowserver import RowServer
from engram_offload.serving.store import TableStore, open_table

from tiny_tables import tiny_config

ROW_BYTES = tiny_config("fp8_e4m3_ue8m0", 64).row_bytes  # the row server tests' table


@contextlib.contextmanager
def serving(path: Path, sock: Path, cache_rows: int = 400, store: TableStore | None = None,
            before: Callable[[RowServer], None] | None = None, **options: int) -> Iterator[RowServer]:
    """A ``RowServer`` of ``path`` (direct tier, a ``cache_rows``-row cache), or of ``store``,
    serving ``sock`` from a thread (``before`` is called with it first); closed, and its thread
    joined, on exit, which fails if a thread of the server raised meanwhile (a connection's
    thread must end quietly)."""
    if store is None:
        store = open_table(path, "direct", cache_bytes=cache_rows * ROW_BYTES)
    server = RowServer(store, sock, **options)
    if before is not None:
        before(server)
    failed: list[BaseException | None] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: failed.append(args.exc_value)  # a connection's thread that raised
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        try:
            server.close()
            thread.join(timeout=30)
            assert not thread.is_alive()
        finally:
            threading.excepthook = hook
    assert failed == [], f"a row server thread raised: {failed!r}"
