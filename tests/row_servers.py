"""A row server serving from a thread of the test process, for the tests that need the server's
own code to run where they can see it (mutation testing records the calls of this process only)."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Iterator

from engram_offload.serving.rowserver import RowServer
from engram_offload.serving.store import TableStore, open_table

from tiny_tables import tiny_config

ROW_BYTES = tiny_config("fp8_e4m3_ue8m0", 64).row_bytes  # the row server tests' table


@contextlib.contextmanager
def serving(path: Path, sock: Path, cache_rows: int = 400, store: TableStore | None = None,
            **options: int) -> Iterator[RowServer]:
    """A ``RowServer`` of ``path`` (direct tier, a ``cache_rows``-row cache), or of ``store``,
    serving ``sock`` from a thread; closed, and its thread joined, on exit."""
    if store is None:
        store = open_table(path, "direct", cache_bytes=cache_rows * ROW_BYTES)
    server = RowServer(store, sock, **options)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.close()
        thread.join(timeout=30)
        assert not thread.is_alive()
