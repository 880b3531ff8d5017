"""Whole-page reads checked against the table's page checksums (format version 3).

A tier that checks pages reads every page holding a requested row in full (rows never
straddle pages), back to back into one buffer, then ``check_pages`` compares each page's
checksum (XXH3, low 32 bits) with the one loaded at open. A page that differs is read once more from the
medium (a transient fault: a bad transfer, a flipped bit in flight); if it differs again,
``ChecksumError`` names the page and its rows.

A checkpoint (``table.checkpoint``) is planned the same way over its shards' pages
(``plan_checkpoint``): a row is one piece per part (its values, its scales), each in one page or
two consecutive ones (a row may straddle pages: consecutive pages of a tensor lie side by side in
the buffer, so a piece is one run there); ``files`` says which shard each page is read from, and
``gather_pieces`` puts the pieces of each row together.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

from ..buffers.rowcopy import native_move_rows
from ..table.checkpoint import Checkpoint
from ..table.format import TableHeader, TableLayout
from ..table.pagesum import page_sums
from ..table.stream import PAGE
from ..table.verify import bad_pages, page_checksum_error

__all__ = ["PagePlan", "plan_pages", "plan_checkpoint", "run_of_pages", "check_pages", "gather_pieces"]


class PagePlan(NamedTuple):
    pages: np.ndarray  # int64 [m] distinct data pages (a checkpoint's: checksummed pages), ascending
    starts: np.ndarray  # int64 [m] their file offsets
    dests: np.ndarray  # int64 [m] their byte offsets in the buffer (i * page_bytes)
    nbytes: int  # buffer bytes needed
    positions: np.ndarray  # int64 [n] each requested row's byte offset in the buffer (a checkpoint: [n, parts])
    files: np.ndarray | None = None  # int64 [m] the shard each page is in (a checkpoint), None: the table file
    valid: np.ndarray | None = None  # int64 [m] bytes of each page its shard holds (the rest reads as zeros)


def plan_pages(offsets: np.ndarray, layout: TableLayout) -> PagePlan:
    """Which whole pages hold the rows at file ``offsets`` (int64 ``[n]``), and where each
    row lands in a buffer of those pages read back to back."""
    page = layout.page_bytes
    pages, which = np.unique((offsets - layout.data_offset) // page, return_inverse=True)
    starts = layout.data_offset + pages * page
    dests = np.arange(len(pages), dtype=np.int64) * page
    positions = dests[which] + (offsets - starts[which])
    return PagePlan(pages, starts, dests, len(pages) * page, positions)


def plan_checkpoint(ids: np.ndarray, checkpoint: Checkpoint, parts: int | None = None) -> PagePlan:
    """The pages of a checkpoint's shards holding rows ``ids`` (int64 ``[n]``, in range), only their
    first ``parts`` parts (default all), and where each row's pieces land in a buffer of them."""
    ck = checkpoint
    p = len(ck.part_bytes) if parts is None else parts
    layer = np.searchsorted(ck.bases, ids, side="right") - 1  # [n]
    starts = ck.vbase[layer, :p] + (ids - ck.bases[layer])[:, None] * ck.part_bytes[:p]  # [n, p] in page space
    first = starts // PAGE
    pages = np.unique(np.concatenate([first.reshape(-1), ((starts + ck.part_bytes[:p] - 1) // PAGE).reshape(-1)]))
    files, offsets = ck.locate(pages)
    dests = np.arange(len(pages), dtype=np.int64) * PAGE
    positions = dests[np.searchsorted(pages, first)] + starts % PAGE  # [n, p]
    valid = np.minimum(PAGE, ck.sizes[files] - offsets)
    return PagePlan(pages, offsets, dests, len(pages) * PAGE, positions, files, valid)


def gather_pieces(buf: np.ndarray, plan: PagePlan, checkpoint: Checkpoint, out: torch.Tensor,
                  resident: np.ndarray | None = None, ids: np.ndarray | None = None) -> None:
    """Rows of a checkpoint plan's pages (``buf``, uint8) into ``out`` (uint8 ``[n, row_bytes]``):
    each planned part's piece at its column; the parts after them from ``resident`` (uint8
    ``[num_rows, their bytes]``, rows ``ids``)."""
    in_place = out.device.type == "cpu" and out.is_contiguous()
    dest = out.numpy() if in_place else np.empty(tuple(out.shape), np.uint8)  # [n, row_bytes]
    flat, rows = dest.reshape(-1), np.arange(len(dest), dtype=np.int64) * dest.shape[1]
    planned = plan.positions.shape[1]
    for k in range(planned):
        _move(buf, np.ascontiguousarray(plan.positions[:, k]), flat, rows + int(checkpoint.columns[k]),
              int(checkpoint.part_bytes[k]))
    if resident is not None and ids is not None:
        _move(resident.reshape(-1), ids * resident.shape[1], flat, rows + int(checkpoint.columns[planned]),
              resident.shape[1])
    if not in_place:
        out.copy_(torch.from_numpy(dest))


def _move(src: np.ndarray, src_at: np.ndarray, dest: np.ndarray, dest_at: np.ndarray, width: int) -> None:
    """``width`` bytes at each of ``src_at`` (int64 ``[n]``) of flat ``src`` to ``dest_at`` of flat ``dest``."""
    move = native_move_rows()
    if move is not None:
        move(src, src_at, dest, dest_at, width)
    else:
        span = np.arange(width, dtype=np.int64)
        dest[dest_at[:, None] + span] = src[src_at[:, None] + span]


def run_of_pages(first: int, count: int, layout: TableLayout) -> PagePlan:
    """Pages ``first..first+count-1`` read back to back (a load chunk); no requested rows."""
    page = layout.page_bytes
    pages = np.arange(first, first + count, dtype=np.int64)
    dests = np.arange(count, dtype=np.int64) * page
    return PagePlan(pages, layout.data_offset + pages * page, dests, count * page, np.empty(0, np.int64))


def check_pages(header: TableHeader, plan: PagePlan, buf: np.ndarray,
                reread: Callable[[np.ndarray], None]) -> None:
    """Check the pages of ``plan`` held in ``buf`` (uint8) against the table's checksums (a
    checkpoint plan's: its sidecar's); pages that differ are read again by ``reread(positions)``
    (indices into ``plan.pages``) and checked again; ``ChecksumError`` for a page bad twice."""
    checkpoint = getattr(header, "checkpoint", None) if plan.files is not None else None
    if checkpoint is None:
        bad = bad_pages(header, plan.pages, buf[: plan.nbytes])
    else:
        bad = np.flatnonzero(page_sums(buf[: plan.nbytes], PAGE) != checkpoint.page_sums[plan.pages])
    if not bad.size:
        return
    reread(bad)
    page = header.layout.page_bytes if checkpoint is None else PAGE
    for i in bad.tolist():
        one = plan.pages[i: i + 1]
        held = buf[plan.dests[i]: plan.dests[i] + page]
        if checkpoint is not None and page_sums(held, PAGE)[0] != checkpoint.page_sums[one[0]]:
            raise checkpoint.page_error(int(one[0]))
        if checkpoint is None and bad_pages(header, one, held).size:
            raise page_checksum_error(header, int(one[0]))
