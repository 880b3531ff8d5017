"""The row client's sampled check reaches every position of a fetch: a server that changes only
the last row (or any one position) of every fetch is caught."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.errors import TierError
from engram_offload.serving.rowserver.client import RowClient

from row_servers import serving
from test_client import tampering


@pytest.mark.parametrize("position", [0, 1, 2])
def test_a_wrong_row_at_any_position_of_a_fetch_is_caught(table, socket_dir, position):
    path, _ = table
    sock = socket_dir / "rows.sock"
    wrong: list[int] = []
    with serving(path, sock, store=tampering(path, wrong), max_rows=100):
        client = RowClient(sock, table=path)
        client.read_raw(np.arange(16))  # the connect's full check: right rows
        client._rng = np.random.default_rng(position)
        wrong.append(position)  # from now on this position of every fetch is wrong, and only it
        with pytest.raises(TierError, match=f"sent row {40 + position} different"):
            for _ in range(60):
                client.read_raw([40, 41, 42])
        client.close()
