"""The host DRAM a machine needs when it runs ``dp`` data-parallel replicas of a placement.

Per machine: the host copy of the table x (1 if the replicas share it, ``tier="shared"``,
else ``dp``) + the DRAM row cache x (1 with one row server a machine, else ``dp``) + each
replica's step buffers x ``dp``. A replica is one TP group; its buffers hold two steps'
rows (the step in use and the one being fetched) of its batch, every column.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .placement import PlacementResult

__all__ = ["BUFFERED_STEPS", "MachineDram", "machine_dram"]

BUFFERED_STEPS = 2  # a replica's rows in host buffers: the step being computed and the next one


@dataclass(frozen=True)
class MachineDram:
    """Host DRAM per machine of one placement at ``dp`` replicas (bytes)."""

    placement: str
    tp: int
    dp: int
    shared_host_copy: bool
    row_server: bool
    host_copy_bytes: float  # one copy of the table in host DRAM (the dram placement)
    cache_bytes: float  # one replica's DRAM row cache (the nvme placement)
    buffer_bytes_per_rank: float  # one replica's step buffers
    total_bytes: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def machine_dram(r: PlacementResult, dp: int, shared_host_copy: bool, row_server: bool) -> MachineDram:
    """The host DRAM a machine needs for ``dp`` replicas of placement ``r`` (see the module)."""
    if dp < 1:
        raise ValueError(f"--dp must be >= 1, got {dp}")
    host_copy = r.host_bytes_per_gpu * r.tp if r.name == "dram" else 0.0
    cache = r.cache_bytes_per_gpu * r.tp if r.name == "nvme" else 0.0
    buffers = 0.0 if r.name == "hbm" else float(BUFFERED_STEPS * r.batch * r.bytes_per_token_per_gpu * r.tp)
    total = (host_copy * (1 if shared_host_copy else dp) + cache * (1 if row_server else dp) + buffers * dp)
    return MachineDram(r.name, r.tp, dp, shared_host_copy, row_server, host_copy, cache, buffers, total)
