"""The runtime path from a table to a model: the store (``store.open_table``, one
``TableStore`` over a tier, its caches and a device), the ``Prefetcher`` (``prefetch``), a
step's deduplication (``dedup``, C helper ``_dedupkernel.c``), tensor-parallel column shards
(``sharding``), the wiring into a model's forward (``wiring``) and one row server per machine
(``rowserver``: the server runs a store; ``open_table(row_server=)`` returns its client).

It builds on storage (``tiers``, ``cache``, ``pool``) and the device path (``gpu``); the tools
(``bench``, ``model``, ``commands``) and engine integrations build on it.
"""
