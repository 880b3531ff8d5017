"""The runtime path from a table to a model: the row-store base (``rowstore``), the store
(``store.open_table``, one ``TableStore`` over a tier, its caches and a device; ``layered``:
each Engram layer on its own tier), the ``Prefetcher`` (``prefetch``, with its ``step``,
``outputs`` and ``drafts``), a step's deduplication (``dedup``, C helper ``_dedupkernel.c``),
tensor-parallel column shards (``sharding``) and one row server per machine (``rowserver``:
the server runs a store; ``open_table(row_server=)`` returns its client).

It builds on storage (``tiers``, ``cache``, ``pool``) and the device path (``gpu``); the tools
(``bench``, ``model``, ``commands``) and engine integrations build on it.
"""
