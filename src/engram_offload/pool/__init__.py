"""The pooled copy of a table: one copy in a Redis Cluster shared by many serving machines.

``layout`` says where rows lie (extents, key names), ``key`` reads the operator's key file
(the password, the key of the rows' MACs), ``client`` talks RESP to the nodes, ``publish``
loads, lists and drops tables, ``servers`` starts loopback servers to try it out. The ``remote`` tier (``engram_offload.tiers.remote``) reads rows from the pool.
"""

from __future__ import annotations

__all__ = ["publish_table", "pool_status", "drop_table", "start_local_pool"]


def __getattr__(name: str):
    if name in ("publish_table", "pool_status", "drop_table"):
        from . import publish

        return getattr(publish, name)
    if name == "start_local_pool":
        from .servers import start_local_pool

        return start_local_pool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
