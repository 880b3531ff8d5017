"""Whole-page reads checked against the table's page checksums (format version 3).

A tier that checks pages reads every page holding a requested row in full (rows never
straddle pages), back to back into one buffer, then ``check_pages`` compares each page's
checksum (XXH3, low 32 bits) with the one loaded at open. A page that differs is read once more from the
medium (a transient fault: a bad transfer, a flipped bit in flight); if it differs again,
``ChecksumError`` names the page and its rows.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from ..table.format import TableHeader, TableLayout
from ..table.verify import bad_pages, page_checksum_error

__all__ = ["PagePlan", "plan_pages", "run_of_pages", "check_pages"]


class PagePlan(NamedTuple):
    pages: np.ndarray  # int64 [m] distinct data pages, ascending
    starts: np.ndarray  # int64 [m] their file offsets
    dests: np.ndarray  # int64 [m] their byte offsets in the buffer (i * page_bytes)
    nbytes: int  # buffer bytes needed
    positions: np.ndarray  # int64 [n] each requested row's byte offset in the buffer


def plan_pages(offsets: np.ndarray, layout: TableLayout) -> PagePlan:
    """Which whole pages hold the rows at file ``offsets`` (int64 ``[n]``), and where each
    row lands in a buffer of those pages read back to back."""
    page = layout.page_bytes
    pages, which = np.unique((offsets - layout.data_offset) // page, return_inverse=True)
    starts = layout.data_offset + pages * page
    dests = np.arange(len(pages), dtype=np.int64) * page
    positions = dests[which] + (offsets - starts[which])
    return PagePlan(pages, starts, dests, len(pages) * page, positions)


def run_of_pages(first: int, count: int, layout: TableLayout) -> PagePlan:
    """Pages ``first..first+count-1`` read back to back (a load chunk); no requested rows."""
    page = layout.page_bytes
    pages = np.arange(first, first + count, dtype=np.int64)
    dests = np.arange(count, dtype=np.int64) * page
    return PagePlan(pages, layout.data_offset + pages * page, dests, count * page, np.empty(0, np.int64))


def check_pages(header: TableHeader, plan: PagePlan, buf: np.ndarray,
                reread: Callable[[np.ndarray], None]) -> None:
    """Check the pages of ``plan`` held in ``buf`` (uint8); pages that differ are read again
    by ``reread(positions)`` (indices into ``plan.pages``) and checked again; ``ChecksumError``
    for a page bad twice."""
    bad = bad_pages(header, plan.pages, buf[: plan.nbytes])
    if not bad.size:
        return
    reread(bad)
    page = header.layout.page_bytes
    for i in bad.tolist():
        one = plan.pages[i: i + 1]
        if bad_pages(header, one, buf[plan.dests[i]: plan.dests[i] + page]).size:
            raise page_checksum_error(header, int(one[0]))
