"""Storage tiers: where a table's rows are read from, all behind ``base.Tier``.

A tier is registered by name as ``"module:Class"`` and imported only when asked for, so
adding one is a new file plus one line in ``TIERS``.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..table.format import TableHeader
from .base import Tier, as_row_ids

__all__ = ["TIERS", "Tier", "as_row_ids", "get_tier_class", "open_tier"]

TIERS: dict[str, str] = {
    "memory": "engram_offload.tiers.memory:MemoryTier",
    "pinned": "engram_offload.tiers.pinned:PinnedTier",
    "mmap": "engram_offload.tiers.mmap:MmapTier",
    "direct": "engram_offload.tiers.direct:DirectTier",
}


def get_tier_class(name: str) -> type[Tier]:
    """The tier class registered as ``name``; ``ValueError`` listing the known names."""
    try:
        module, cls = TIERS[name].split(":")
    except KeyError:
        raise ValueError(f"unknown tier {name!r}; choose one of: {', '.join(TIERS)}") from None
    return getattr(importlib.import_module(module), cls)


def open_tier(name: str, header: TableHeader, **options: Any) -> Tier:
    """Open the table described by ``header`` on tier ``name`` with the tier's ``options``."""
    return get_tier_class(name)(header, **options)
