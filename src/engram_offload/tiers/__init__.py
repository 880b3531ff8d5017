"""Storage tiers: where a table's rows are read from, all behind ``base.Tier``.

``TIERS`` is the one list of tiers: each is registered by name with its ``"module:Class"``
(imported only when asked for) and the facts every other layer asks of a tier; each subset of
tiers anywhere in the package is ``tier_names(...)`` of these flags. Adding a tier is a new file
plus one line here. A tier never imports the store or the benchmarks.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

from ..table.format import TableHeader
from .base import Tier, as_row_ids
from .policy import DEFAULT_QUEUE_DEPTH

__all__ = ["DEFAULT_QUEUE_DEPTH", "TIERS", "Tier", "TierEntry", "as_row_ids", "get_tier_class", "is_resident",
           "open_tier", "tier_names"]


class TierEntry(NamedTuple):
    target: str  # "module:Class"
    resident: bool  # the whole table in DRAM: nothing to warm or to evict
    addressable: bool  # a device reads the rows in place (over UVA); the others are read by a host thread
    row_reads: bool  # each row is read from a device or a server, which a DRAM row cache saves (mmap: the page cache)
    local: bool = True  # the rows are on this machine
    private: bool = True  # the process's own copy (shared: one copy a machine that outlives its processes)


TIERS: dict[str, TierEntry] = {
    "memory": TierEntry("engram_offload.tiers.memory:MemoryTier", resident=True, addressable=True, row_reads=False),
    "pinned": TierEntry("engram_offload.tiers.pinned:PinnedTier", resident=True, addressable=True, row_reads=False),
    "mmap": TierEntry("engram_offload.tiers.mmap:MmapTier", resident=False, addressable=False, row_reads=False),
    "direct": TierEntry("engram_offload.tiers.direct:DirectTier", resident=False, addressable=False, row_reads=True),
    "shared": TierEntry("engram_offload.tiers.shared:SharedTier", resident=True, addressable=True, row_reads=False,
                        private=False),
    "remote": TierEntry("engram_offload.tiers.remote:RemoteTier", resident=False, addressable=False, row_reads=True,
                        local=False),
}


def tier_names(**flags: bool) -> tuple[str, ...]:
    """The registered tier names whose entries have every one of ``flags`` (e.g.
    ``addressable=True``), in registry order; no flags: all of them."""
    unknown = set(flags) - set(TierEntry._fields[1:])
    if unknown:
        raise ValueError(f"no tier flag {', '.join(sorted(unknown))}; the flags: {', '.join(TierEntry._fields[1:])}")
    return tuple(name for name, entry in TIERS.items()
                 if all(getattr(entry, flag) == value for flag, value in flags.items()))


def _entry(name: str) -> TierEntry:
    try:
        return TIERS[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r}; choose one of: {', '.join(TIERS)}") from None


def is_resident(name: str) -> bool:
    """Whether tier ``name`` holds the whole table in DRAM (``tier_names(resident=True)``)."""
    return _entry(name).resident


def get_tier_class(name: str) -> type[Tier]:
    """The tier class registered as ``name``; ``ValueError`` listing the known names."""
    module, cls = _entry(name).target.split(":")
    return getattr(importlib.import_module(module), cls)


def open_tier(name: str, header: TableHeader, **options: Any) -> Tier:
    """Open the table described by ``header`` on tier ``name`` with the tier's ``options``."""
    return get_tier_class(name)(header, **options)
