"""Row caches in front of a tier: policies, admission, the cache itself, the cached store."""

from __future__ import annotations

from .admission import FrequencySketch
from .index import RowIndex
from .policy import POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy, make_policy
from .row_cache import RowCache
from .store import CachedStore, Lease, RowSource, build_levels

__all__ = [
    "CachedStore",
    "EvictionPolicy",
    "FrequencySketch",
    "LFUPolicy",
    "LRUPolicy",
    "Lease",
    "POLICIES",
    "RowCache",
    "RowIndex",
    "RowSource",
    "build_levels",
    "make_policy",
]
