"""Row caches in front of a tier: policies, admission, the cache itself, leases, building the levels.

The store (``engram_offload.serving.store.TableStore``) walks these levels; nothing here imports it.
"""

from __future__ import annotations

from .admission import FrequencySketch
from .index import RowIndex
from .lease import Lease, RowsInPlace
from .levels import build_levels
from .policy import POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy, make_policy
from .row_cache import RowCache

__all__ = [
    "EvictionPolicy",
    "FrequencySketch",
    "LFUPolicy",
    "LRUPolicy",
    "Lease",
    "POLICIES",
    "RowCache",
    "RowIndex",
    "RowsInPlace",
    "build_levels",
    "make_policy",
]
