"""How a table lies in a Redis pool: extents, key names, the stored header.

Rows are cut along the table's natural extents: per layer, per (order, head) in the
order of ``EngramConfig.head_sizes``, each head's rows are split into extents of at most
``extent_rows`` rows. One string key per extent holds its rows back to back, each row in
the table's packed row format followed by its checksum (``ROW_SUM_BYTES``, little-endian:
a MAC of the row, its id and the table's fingerprint under the operator's row key,
``key.PoolKey.row_tags``), so row ``r`` of an extent starting at row ``s`` lies at byte
``(r - s) * stride`` with ``stride = row_bytes + 8``, and one ``GETRANGE`` reads a row
with its checksum. A row changed, copied over another, an extent's value swapped for
another's, another table's extent under this table's key, or rows written by anyone
without the key all fail the check::

    <fp>:engram:l<L>:h<H>:e<k>      extent k of head H (order * n_heads + head) of layer L
    {<fp>}:engram:header            JSON: pool layout version, extent_rows, the table header
    {<fp>}:engram:manifest          hash: extent index -> xxh3_64 of the extent's bytes
    {<fp>}:engram:complete          JSON written last: extent count, a MAC of the header and manifest

``<fp>`` is the table's fingerprint: xxh3_64 of its header JSON and of its page sums'
digest (so two tables of one layout but other rows differ). Extent keys carry no
braces, so Redis Cluster hashes the whole key and spreads a table's extents over the
16,384 slots and so over the nodes; the meta keys share the hash tag ``{<fp>}`` and sit
together in one slot. Every key of a table starts with its fingerprint, so dropping a
table never touches another's.

Pool layout versions: 1 held bare rows (no per-row checksums); 2 added checksums of the
rows' bytes alone; 3 bound them to the row id and the table's fingerprint; 4 stored the
table's page sums' digest in the header instead of its block digests; 5 (this one) keys the
row checksums and the complete marker with the operator's secret. A pool of another version
is refused with a request to publish the table again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..engram.config import EngramConfig
from ..errors import TableFormatError
from ..table.format import TableHeader, TableLayout
from .client import PoolError
from .key import PoolKey

__all__ = ["POOL_LAYOUT_VERSION", "ROW_SUM_BYTES", "ROW_CHECKSUM", "DEFAULT_EXTENT_ROWS", "MAX_EXTENT_BYTES",
           "PoolLayout", "PoolLayoutError", "fingerprint", "header_from_record", "rows_with_sums", "bad_rows"]

POOL_LAYOUT_VERSION = 5
ROW_SUM_BYTES = 8  # after every row: u64 little-endian, its MAC (PoolKey.row_tags)
ROW_CHECKSUM = "aes128-pmac64(key,fingerprint,row id,row)"
DEFAULT_EXTENT_ROWS = 1 << 18
MAX_EXTENT_BYTES = 512 << 20  # Redis's largest string


def fingerprint(header: TableHeader) -> str:
    """16 hex digits naming a table in the pool: ``TableHeader.fingerprint``."""
    return f"{header.fingerprint():016x}"


@dataclass(frozen=True)
class PoolLayout:
    """A table's extents in the pool: their keys, first rows and sizes."""

    header: TableHeader
    extent_rows: int = DEFAULT_EXTENT_ROWS

    def __post_init__(self) -> None:
        if self.extent_rows < 1:
            raise ValueError(f"extent_rows must be >= 1, got {self.extent_rows}")
        if self.extent_rows * self.stride > MAX_EXTENT_BYTES:
            raise ValueError(
                f"extents of {self.extent_rows:,} rows of {self.stride} bytes (with their checksums) exceed "
                f"Redis's {MAX_EXTENT_BYTES >> 20} MiB string limit: choose fewer extent rows"
            )

    @cached_property
    def fingerprint(self) -> str:
        return fingerprint(self.header)

    @property
    def stride(self) -> int:
        """Bytes per row in an extent: the packed row, then its checksum."""
        return self.header.layout.row_bytes + ROW_SUM_BYTES

    @cached_property
    def _extents(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        config, fp, size = self.header.config, self.fingerprint, self.extent_rows
        keys, starts, counts = [], [], []
        for layer, base in zip(config.layer_ids, config.layer_row_bases):
            for head, (offset, rows) in enumerate(zip(config.head_offsets(layer), config.head_sizes(layer))):
                for k, first in enumerate(range(0, rows, size)):
                    keys.append(f"{fp}:engram:l{layer}:h{head}:e{k}")
                    starts.append(base + offset + first)
                    counts.append(min(size, rows - first))
        return keys, np.array(starts, np.int64), np.array(counts, np.int64)

    @property
    def keys(self) -> list[str]:
        """Every extent's key, in row order."""
        return self._extents[0]

    @property
    def starts(self) -> np.ndarray:
        """First row of every extent (int64 ``[extents]``, increasing)."""
        return self._extents[1]

    @property
    def counts(self) -> np.ndarray:
        """Rows of every extent (int64 ``[extents]``)."""
        return self._extents[2]

    @property
    def num_extents(self) -> int:
        return len(self.keys)

    # -- meta keys ---------------------------------------------------------------------
    @property
    def header_key(self) -> str:
        return meta_key(self.fingerprint, "header")

    @property
    def manifest_key(self) -> str:
        return meta_key(self.fingerprint, "manifest")

    @property
    def complete_key(self) -> str:
        return meta_key(self.fingerprint, "complete")

    def header_record(self) -> bytes:
        """The JSON stored under ``header_key``: enough to open the table without its file."""
        return json.dumps({
            "pool_layout": POOL_LAYOUT_VERSION,
            "row_checksum": ROW_CHECKSUM,
            "fingerprint": self.fingerprint,
            "extent_rows": self.extent_rows,
            "table": self.header.layout.header_dict(),
            "sums_digest": f"{self.header.sums_digest:016x}",
        }, sort_keys=True).encode()


def meta_key(fp: str, what: str) -> str:
    return f"{{{fp}}}:engram:{what}"


def rows_with_sums(rows: np.ndarray, fp: str, ids: np.ndarray, key: PoolKey) -> np.ndarray:
    """Rows ``[n, row_bytes]`` of table ``fp`` with ids ``ids [n]`` -> the pool's rows
    ``[n, row_bytes + 8]``: each row, then its MAC under ``key``."""
    rows = np.ascontiguousarray(rows)
    n, rb = rows.shape
    packed = np.empty((n, rb + ROW_SUM_BYTES), np.uint8)
    packed[:, :rb] = rows
    packed[:, rb:] = key.row_tags(rows, rb, rb, fp, ids).astype("<u8").view(np.uint8).reshape(n, ROW_SUM_BYTES)
    return packed


def bad_rows(data, row_bytes: int, stride: int, fp: str, ids: np.ndarray, key: PoolKey) -> np.ndarray:
    """Positions (int64 ``[bad]``) of the rows of ``data`` (each ``stride`` bytes: a row, then
    its stored MAC) that fail their check as rows ``ids`` of table ``fp`` under ``key``: the
    bytes changed, the row (or its extent) is not where it belongs, or it was written
    without the key. Empty when all hold."""
    view = memoryview(data).cast("B")
    if stride < row_bytes + ROW_SUM_BYTES or row_bytes <= 0 or len(view) % stride:
        raise ValueError(f"data of {len(view)} bytes is not a whole number of {stride}-byte strides holding "
                         f"a {row_bytes}-byte row and its checksum")
    n = len(view) // stride
    if len(ids) != n:
        raise ValueError(f"{n} rows to check against {len(ids)} row ids")
    stored = np.ndarray((n,), "<u8", view, row_bytes, (stride,))  # [n], unaligned view of the stored MACs
    return np.flatnonzero(key.row_tags(view, row_bytes, stride, fp, ids) != stored)


class PoolLayoutError(PoolError):
    """The table in the pool was published with another pool layout version."""


def stored_layout_version(record: bytes) -> int | None:
    """The pool layout version of a stored header record (None when unreadable)."""
    try:
        version = json.loads(record)["pool_layout"]
    except (ValueError, KeyError, TypeError):
        return None
    return version if isinstance(version, int) else None


_OLD_LAYOUTS = {1: " (rows without checksums)", 2: " (row checksums not bound to the rows' places)",
                3: " (tables named by their block digests)", 4: " (row checksums not keyed)"}


def layout_version_problem(where: str, version: int | None) -> str:
    """Why a table stored with pool layout ``version`` (not this one) cannot be read."""
    return (f"{where} was published with pool layout version {version}{_OLD_LAYOUTS.get(version or 0, '')}; "
            f"this engram-offload reads version {POOL_LAYOUT_VERSION}: re-publish with engram-offload pool publish "
            "TABLE --pool URL (it replaces the old layout's keys)")


def header_from_record(record: bytes, where: str, *, any_version: bool = False) -> tuple[TableHeader, int]:
    """(the table header, extent_rows) from a stored header record; ``where`` names it in errors.

    A record of another pool layout version raises ``PoolLayoutError`` unless
    ``any_version`` (``pool status`` lists such tables)."""
    version = stored_layout_version(record)
    if version is None:
        raise TableFormatError(f"{where}: unreadable table header in the pool (no pool layout version)")
    if version != POOL_LAYOUT_VERSION and not any_version:
        raise PoolLayoutError(layout_version_problem(where, version))
    try:
        meta: dict[str, Any] = json.loads(record)
        table = meta["table"]
        layout = TableLayout(EngramConfig(**table["config"]), int(table["data_offset"]))
        header = TableHeader(Path(meta["fingerprint"]), layout, int(meta["sums_digest"], 16))
        extent_rows = int(meta["extent_rows"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TableFormatError(f"{where}: unreadable table header in the pool ({exc})") from None
    if fingerprint(header) != meta["fingerprint"]:
        raise TableFormatError(f"{where}: the stored table header does not match its fingerprint")
    return header, extent_rows
