"""Checking table data against its page checksums: whole files, and pages as they are read."""

from __future__ import annotations

import os

import numpy as np

from ..errors import ChecksumError
from .checkpoint import CheckpointHeader, verify_checkpoint  # (a checkpoint opens as a table once this is loaded)
from .format import TableHeader, read_header
from .pagesum import page_sums
from .progress import byte_progress

__all__ = ["verify_table", "bad_pages", "page_checksum_error"]

VERIFY_CHUNK_BYTES = 1 << 20


def page_checksum_error(header: TableHeader, page: int, reread: bool = True) -> ChecksumError:
    first, last = header.layout.page_rows(page)
    again = " after a re-read" if reread else ""
    return ChecksumError(
        f"{header.path}: data page {page} (rows {first:,}..{last:,}) does not match its checksum{again}; "
        "the table is damaged: rewrite it (make-table / convert) or restore a copy"
    )


def bad_pages(header: TableHeader, pages: np.ndarray, data) -> np.ndarray:
    """Positions ``i`` where page ``pages[i]`` (int64 ``[m]``), held at ``data[i*page_bytes:]``
    (whole pages back to back), differs from its checksum. The header must carry page sums."""
    assert header.page_sums is not None
    got = page_sums(data, header.layout.page_bytes)
    return np.flatnonzero(got != header.page_sums[pages])


def verify_table(path: str | os.PathLike[str], progress: bool | None = None) -> TableHeader:
    """Read every data page of the table at ``path`` and check it; return its header. A checkpoint
    (folder or sidecar) has every Engram page checked against its sidecar.

    Raises ``TableFormatError`` for a damaged header, size or trailer, ``ChecksumError``
    naming the first bad page and its rows.
    """
    header = read_header(path)
    if isinstance(header, CheckpointHeader):
        return verify_checkpoint(header, progress)
    layout = header.layout
    step = max(1, VERIFY_CHUNK_BYTES // layout.page_bytes)
    buf = bytearray(step * layout.page_bytes)
    with open(header.path, "rb", buffering=0) as f, \
            byte_progress(f"verifying {header.path.name}", layout.data_bytes, progress) as advance:
        for first in range(0, layout.num_pages, step):
            pages = np.arange(first, min(first + step, layout.num_pages), dtype=np.int64)
            view = memoryview(buf)[: len(pages) * layout.page_bytes]
            got = os.preadv(f.fileno(), [view], layout.data_offset + first * layout.page_bytes)
            bad = bad_pages(header, pages, view) if got == len(view) else np.zeros(1, np.int64)
            if bad.size:
                raise page_checksum_error(header, int(pages[bad[0]]), reread=False)
            advance(len(view))
    return header
