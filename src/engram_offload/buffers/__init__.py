"""Host buffers, the lowest layer above the shared facts: rows moved between buffers
(``rowcopy``, C helper ``_rowcopy.c``), arrays used again instead of fresh pages
(``recycle``), and host memory page-locked and mapped for a device (``hostmem``).

Nothing here knows Engram, tables or tiers; every layer above may use it.
"""
