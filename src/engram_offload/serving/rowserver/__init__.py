"""One row server per machine: the table's tier, one row cache and the reads, shared by every rank.

``RowServer`` (server.py; ``engram-offload row-server`` runs one) owns a ``TableStore`` and serves it on a Unix socket; each rank
opens a ``RowClient`` (client.py), which has the store's interface. Rows move through
shared memory, never through the socket (protocol.py). docs/ranks.md says why a server
rather than a cache in shared memory.
"""

from __future__ import annotations

from .client import RemoteLease, RowClient, start_row_server
from .server import RowServer

__all__ = ["RemoteLease", "RowClient", "RowServer", "start_row_server"]
