"""``tier: "auto"``: the plugins' tier chosen at start-up from this machine's facts, by the planner's rules.

The planner's host-DRAM rule (``planner.ranks.machine_dram`` within
``Assumptions.dram_usable_fraction`` of the DRAM) weighs what a resident tier would hold on
this machine against its free DRAM (``MemAvailable``): ``pinned`` holds each rank's share of
the table (all ranks together: the table once per engine replica), ``shared`` one copy a
machine for every replica (the planner's choice with more than one replica, where
``/dev/shm`` holds it). When neither fits: the planner's nvme placement, ``direct`` behind a
row cache a rank, the smallest reaching the planner's target hit rate on real text
(``planner.realtext``) within the DRAM allowed; refused on a rotational disk. ``mmap`` (which
the planner never proposes) and ``remote`` (a pool is the operator's to name) are never chosen.

Each rank resolves on its own: resolve before any rank loads the table (at plugin load), so
that every rank sees the same free DRAM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..engram.config import EngramConfig
from ..machine import _block_device, available_memory_bytes, free_disk_bytes
from ..planner.assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from ..planner.placement import PlacementResult, Workload
from ..planner.ranks import machine_dram
from ..planner.realtext import RealTextMRC
from ..serving.sharding import column_range, shard_rows
from ..table.format import read_header
from ..tiers.segments import DEFAULT_SHM_DIR
from ..units import format_bytes
from .settings import AUTO, OffloadSettings

__all__ = ["MachineFacts", "read_facts", "resolve_tier"]


@dataclass(frozen=True)
class MachineFacts:
    """What ``auto`` weighs; None where the machine does not say."""

    free_dram: int | None  # MemAvailable, bytes
    rotational: bool | None  # the disk holding the table
    shm_free: int | None  # free bytes of the shared tier's folder (/dev/shm)


def read_facts(table: str, shm_dir: str = DEFAULT_SHM_DIR) -> MachineFacts:
    """This machine's facts for the table file ``table``."""
    rotational = (_block_device(table) or {}).get("rotational")
    return MachineFacts(available_memory_bytes(), None if rotational is None else rotational == "1",
                        free_disk_bytes(shm_dir) if Path(shm_dir).is_dir() else None)


def resolve_tier(settings: OffloadSettings, world: int, *, replicas: int = 1, facts: MachineFacts | None = None,
                 config: EngramConfig | None = None, graphs_fix: str | None = None,
                 assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> tuple[OffloadSettings, str]:
    """``settings`` with a concrete tier, and the line saying why to log at start-up.

    A tier the settings name is kept. ``world``: the tensor-parallel ranks (on this machine);
    ``replicas``: the engine's data-parallel replicas on this machine; ``facts`` (default: read
    now) and ``config`` (default: the table's header) are the inputs of the choice.
    ``graphs_fix``: the engine captures CUDA graphs that a host read cannot run in, and this
    is the engine's flag that turns them off: auto then chooses only a tier the GPU reads in
    place, or says what to do.
    ``ValueError`` (one line) where auto cannot choose.
    """
    if settings.tier != AUTO:
        return settings, f"tier {settings.tier} as set"
    if world < 1 or replicas < 1:
        raise ValueError(f"tier auto needs world >= 1 and replicas >= 1, got {world}, {replicas}")
    config = config or read_header(settings.table).config
    facts = facts or read_facts(settings.table)
    if facts.free_dram is None:
        raise ValueError("tier auto cannot tell this machine's free DRAM (no MemAvailable): name a tier")
    rb, table = config.row_bytes, config.table_bytes
    share = max(shard_rows(config, column_range(config.cols_per_layer, r, world)).num_rows for r in range(world))
    room = assumptions.dram_usable_fraction * facts.free_dram
    free = f"{assumptions.dram_usable_fraction:.0%} of {format_bytes(facts.free_dram)} free DRAM"
    copies = f"{replicas} replicas x {world} ranks" if replicas > 1 else f"{world} ranks"
    resident = PlacementResult("dram", world, True, host_bytes_per_gpu=table / world)  # the table, over the ranks
    private = machine_dram(resident, replicas, shared_host_copy=False, row_server=False).total_bytes
    held = f"{format_bytes(private)} ({copies}, up to {format_bytes(share * rb)} a rank)"
    if replicas > 1 and table <= room and (facts.shm_free is None or table <= facts.shm_free):
        return (replace(settings, tier="shared"),
                f"auto chose shared: one {format_bytes(table)} copy for {replicas} replicas fits in {free}")
    if private <= room:
        return replace(settings, tier="pinned"), f"auto chose pinned: {held} fits in {free}"
    if graphs_fix is not None:
        raise ValueError(f"tier auto found no tier the GPU reads in place: {held} does not fit in {free}, and "
                         f"a tier read on the host (direct) cannot run in the engine's CUDA graphs: {graphs_fix}, "
                         "or free DRAM")
    if facts.rotational:
        raise ValueError(f"tier auto found no tier: {held} does not fit in {free}, and {settings.table} is on a "
                         "rotational disk: free DRAM, move the table to NVMe, or name a tier")
    curve = RealTextMRC(config.bytes_per_token_per_gpu(world) // rb, share)  # one rank's rows
    want = curve.rows_for_hit_rate(Workload().target_hit_rate) or share
    rows = min(want, share, int(room // (world * replicas * rb)))
    return (replace(settings, tier="direct", cache_bytes=rows * rb or None),
            f"auto chose direct: {held} does not fit in {free}; a {format_bytes(rows * rb)} row cache a rank "
            f"({curve.hit_ratio(rows):.0%} hits on real text)")
