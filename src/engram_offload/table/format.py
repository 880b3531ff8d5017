"""The table file format: header, row placement, checksum trailer (docs/table-format.md).

A table file is, in order::

    prefix   24 bytes: b"ENGRAMTB", u32 format version, u32 JSON length, u64 xxh3_64(JSON)
    header   UTF-8 JSON (magic, version, the full EngramConfig, the layout), zero padded
             to ``data_offset`` (a multiple of 4096)
    data     ``num_pages`` pages of ``page_bytes``; page ``p`` holds rows
             ``p*rows_per_page .. (p+1)*rows_per_page-1`` back to back, zero padded
    trailer  at ``trailer_offset``: one little-endian u32 per data page, the low 32 bits of
             its XXH3-64 (``page_sums``); then u64 xxh3_64 of the page sums' bytes
             (``sums_digest``), then u64 xxh3_64 of everything before it in the trailer

The page checksums (loaded into DRAM at open, about 0.1% of the data) are what every read
and ``verify`` checks: a page is verified by itself. Their digest is the table's content
identity (``TableHeader.fingerprint``: shared segments, row servers and pool keys are named
by it), short enough to store with a published table.

``page_bytes`` is 4096 when a row fits in 4 KiB (``floor(4096 / row_bytes)`` rows a page,
so no row straddles a page), else the row size rounded up to 4096 (one row a page, every
row page aligned). Every row is therefore served by one direct read of its whole page,
checked against the page's checksum. All integers are little-endian; nothing is pickled.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import xxhash

from ..engram.config import EngramConfig, check_config_fields
from ..errors import TableFormatError
from .safeio import open_input, parse_json

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "PAGE_BYTES",
    "SECTOR_BYTES",
    "TableLayout",
    "TableHeader",
    "read_header",
    "encode_header",
    "check_config_fields",
]

MAGIC = b"ENGRAMTB"
MAGIC_NAME = "engram-offload-table"
FORMAT_VERSION = 3
PAGE_SUM_BYTES = 4  # u32 low half of XXH3-64 per data page
PREFIX = struct.Struct("<8sIIQ")  # magic, version, JSON length, xxh3_64 of the JSON
PAGE_BYTES = 4096
SECTOR_BYTES = 512
MAX_HEADER_BYTES = 1 << 24
_OLD_FORMATS = {1: " (block checksums only)", 2: " (page and block checksums)"}
# Bounds of a layout's fields. DeepSeek-V4.1 has 2 layers x 3 orders x 8 heads = 48 primes;
# the head count bounds the prime search (a few seconds at most), the others typos.


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class TableLayout:
    """Where every byte of a table goes, derived from its config."""

    config: EngramConfig
    data_offset: int

    @classmethod
    def for_config(cls, config: EngramConfig) -> "TableLayout":
        """The layout of ``config``'s table."""
        layout = cls(config, PAGE_BYTES)
        # The header size depends on data_offset only through its digits: settle it.
        while True:
            need = round_up(PREFIX.size + len(layout.header_json()), PAGE_BYTES)
            if need == layout.data_offset:
                return layout
            layout = cls(config, need)

    # -- geometry ---------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.config.num_rows

    @property
    def row_bytes(self) -> int:
        return self.config.row_bytes

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def row_format(self) -> str:
        return self.config.row_format

    @property
    def page_bytes(self) -> int:
        return _page_bytes(self.row_bytes)

    @property
    def rows_per_page(self) -> int:
        return self.page_bytes // self.row_bytes

    @property
    def num_pages(self) -> int:
        return -(-self.num_rows // self.rows_per_page)

    @property
    def data_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def trailer_offset(self) -> int:
        return self.data_offset + self.data_bytes

    @property
    def page_sums_bytes(self) -> int:
        return PAGE_SUM_BYTES * self.num_pages

    @property
    def trailer_bytes(self) -> int:
        return self.page_sums_bytes + 16  # page sums, their digest, the trailer's check

    @property
    def file_bytes(self) -> int:
        return self.trailer_offset + self.trailer_bytes

    def row_offsets(self, ids: np.ndarray) -> np.ndarray:
        """File byte offsets (int64) of rows ``ids`` (int64, already range checked)."""
        rpp = self.rows_per_page
        return self.data_offset + (ids // rpp) * self.page_bytes + (ids % rpp) * self.row_bytes

    def page_rows(self, page: int) -> tuple[int, int]:
        """Rows ``[first, last]`` stored in data page ``page``."""
        first = page * self.rows_per_page
        return first, min(first + self.rows_per_page, self.num_rows) - 1

    # -- header -----------------------------------------------------------------------
    def header_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "magic": MAGIC_NAME,
            "version": FORMAT_VERSION,
            "config": c.to_dict(),
            "layer_ids": list(c.layer_ids),
            "head_sizes": {str(i): list(c.head_sizes(i)) for i in c.layer_ids},
            "layer_row_bases": list(c.layer_row_bases),
            "num_rows": c.num_rows,
            "head_dim": c.head_dim,
            "row_format": c.row_format,
            "row_bytes": c.row_bytes,
            "stride": self.page_bytes,
            "rows_per_page": self.rows_per_page,
            "data_offset": self.data_offset,
            "data_bytes": self.data_bytes,
            "checksum": "xxh3_64",
            "trailer_offset": self.trailer_offset,
            "file_bytes": self.file_bytes,
            "page_checksum": "xxh3_64_low32",
            "page_checksums_offset": self.trailer_offset,
        }

    def header_json(self) -> bytes:
        return json.dumps(self.header_dict(), sort_keys=True).encode()


def _page_bytes(row_bytes: int) -> int:
    return PAGE_BYTES if row_bytes <= PAGE_BYTES else round_up(row_bytes, PAGE_BYTES)


def encode_header(layout: TableLayout) -> bytes:
    """The file's first ``data_offset`` bytes: prefix, JSON, zero padding."""
    body = layout.header_json()
    head = PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), xxhash.xxh3_64_intdigest(body)) + body
    return head + bytes(layout.data_offset - len(head))


@dataclass(frozen=True)
class TableHeader:
    """An opened table's path, layout and checksums (from the trailer)."""

    path: Path
    layout: TableLayout
    sums_digest: int  # xxh3_64 of the page sums' bytes: the table's content identity
    page_sums: np.ndarray | None = None  # uint32 [num_pages] low 32 bits of XXH3-64 per data page; None in a pool's copy

    @property
    def config(self) -> EngramConfig:
        return self.layout.config

    def fingerprint(self) -> int:
        """xxh3_64 of the header JSON and the page sums' digest (u64): equal tables, equal prints
        (the name of a table's shared segment, row server and pool keys)."""
        return xxhash.xxh3_64_intdigest(self.layout.header_json() + struct.pack("<Q", self.sums_digest))


# What else opens as a table: each returns its header, or None for a path not its own
# (``table.checkpoint``: a checkpoint's folder or sidecar, registered when the package loads).
OPENERS: list[Callable[[Path], TableHeader | None]] = []


def read_header(path: str | os.PathLike[str]) -> TableHeader:
    """Open ``path`` as a table: check magic, version, header, size and trailer.

    Raises ``TableFormatError`` saying what is wrong (foreign file, truncation, ...).
    """
    path = Path(path)
    for opener in OPENERS:
        if (other := opener(path)) is not None:
            return other
    if path.is_dir():
        raise TableFormatError(f"{path} is a directory, not a table file: give the table's file")
    with open_input(path, "table file", TableFormatError) as f:  # a FIFO or device: refused, never waited on
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(PREFIX.size)
        if len(prefix) < PREFIX.size:
            raise TableFormatError(
                f"{path} is not an engram-offload table: {size} bytes is too short for a header"
            )
        magic, version, length, digest = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise TableFormatError(
                f"{path} is not an engram-offload table (starts with {magic!r}, expected {MAGIC!r})"
            )
        if version != FORMAT_VERSION:
            raise TableFormatError(
                f"{path} has table format version {version}{_OLD_FORMATS.get(version, '')}; this engram-offload "
                f"reads version {FORMAT_VERSION} only: rewrite the table with engram-offload convert (or make-table)"
            )
        if length > MAX_HEADER_BYTES:
            raise TableFormatError(f"{path}: header length {length} is implausible; the file is damaged")
        body = f.read(length)
        if len(body) < length:
            raise TableFormatError(f"{path} is truncated inside its header ({size} bytes)")
        if xxhash.xxh3_64_intdigest(body) != digest:
            raise TableFormatError(f"{path}: the header does not match its checksum; the file is damaged")
        data_offset = round_up(PREFIX.size + length, PAGE_BYTES)
        layout = _layout_from_header(path, body, data_offset)
        if size != layout.file_bytes:
            what = "truncated" if size < layout.file_bytes else "longer than its header says"
            raise TableFormatError(
                f"{path} is {what}: {size:,} bytes, expected {layout.file_bytes:,}; "
                "rewrite or re-copy the table"
            )
        f.seek(layout.trailer_offset)
        trailer = f.read(layout.trailer_bytes)
    if len(trailer) == layout.trailer_bytes:
        view, (sums_digest, check) = memoryview(trailer), struct.unpack("<QQ", trailer[-16:])
        sums = view[:-16]
        if xxhash.xxh3_64_intdigest(view[:-8]) == check and xxhash.xxh3_64_intdigest(sums) == sums_digest:
            return TableHeader(path, layout, sums_digest, np.frombuffer(sums, dtype="<u4").copy())
    raise TableFormatError(f"{path}: the checksum trailer is damaged; rewrite the table")


def _layout_from_header(path: Path, body: bytes, data_offset: int) -> TableLayout:
    """The layout a header's JSON describes, every field checked (type, range, agreement with
    the layout derived from its config) before it is used."""
    try:
        meta = parse_json(body, "the header")  # nested too deeply for the parser: a ValueError
        if not isinstance(meta, dict):
            raise ValueError(f"the header is a JSON {type(meta).__name__}, not an object")
        check_config_fields(meta.get("config"))
        config = EngramConfig(**meta["config"])
        layout = TableLayout(config, data_offset)
        expected = layout.header_dict()
    except (ValueError, KeyError, TypeError) as exc:
        raise TableFormatError(f"{path}: unreadable table header ({exc}); the file is damaged") from None
    for key, value in expected.items():
        if key != "config" and meta.get(key) != value:
            raise TableFormatError(
                f"{path}: header field {key}={meta.get(key)!r} disagrees with the layout "
                f"derived from its config ({value!r}); the file is damaged"
            )
    return layout
