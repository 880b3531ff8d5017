"""Storage tiers: where a table's rows are read from, all behind ``base.Tier``.

``TIERS`` is the one list of tiers: each is registered by name with its ``"module:Class"``
(imported only when asked for) and whether it is *resident* (the whole table loaded into
DRAM at open, so there is nothing to warm or to evict). Adding a tier is a new file plus
one line here. A tier never imports the store or the benchmarks.
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
    resident: bool  # the whole table in DRAM


TIERS: dict[str, TierEntry] = {
    "memory": TierEntry("engram_offload.tiers.memory:MemoryTier", resident=True),
    "pinned": TierEntry("engram_offload.tiers.pinned:PinnedTier", resident=True),
    "mmap": TierEntry("engram_offload.tiers.mmap:MmapTier", resident=False),
    "direct": TierEntry("engram_offload.tiers.direct:DirectTier", resident=False),
    "shared": TierEntry("engram_offload.tiers.shared:SharedTier", resident=True),
    "remote": TierEntry("engram_offload.tiers.remote:RemoteTier", resident=False),
}


def tier_names() -> tuple[str, ...]:
    """The registered tier names, in registry order."""
    return tuple(TIERS)


def _entry(name: str) -> TierEntry:
    try:
        return TIERS[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r}; choose one of: {', '.join(TIERS)}") from None


def is_resident(name: str) -> bool:
    """Whether tier ``name`` holds the whole table in DRAM (``memory``, ``pinned``)."""
    return _entry(name).resident


def get_tier_class(name: str) -> type[Tier]:
    """The tier class registered as ``name``; ``ValueError`` listing the known names."""
    module, cls = _entry(name).target.split(":")
    return getattr(importlib.import_module(module), cls)


def open_tier(name: str, header: TableHeader, **options: Any) -> Tier:
    """Open the table described by ``header`` on tier ``name`` with the tier's ``options``."""
    return get_tier_class(name)(header, **options)
