"""A checkpoint's sidecar: what ``engram-offload index`` writes so its shards serve as a table,
and the row map it holds (``Checkpoint``: each layer's parts, the pages under them, their sums).

The file (little-endian, nothing pickled; about 0.2% of the Engram bytes)::

    prefix   24 bytes: b"ENGRAMIX", u32 version (1), u32 JSON length, u64 xxh3_64 of the JSON
    JSON     the checkpoint folder, the full EngramConfig, each shard holding an Engram tensor
             (file name, size, mtime_ns, xxh3_64 of its safetensors header), each layer's parts
             (tensor, shard, byte offset, row bytes, rows, dtype, shape, first page sum)
    sums     u32 per page of the shards covering an Engram tensor (``shard_pages`` of them), then
             for each of ``tables``, u32 per page of a table of those parts of the rows: the
             table ``convert`` would write (every part), and one of the scales alone (the part the
             direct tier holds resident)
    trailer  u64 xxh3_64 of the sums

Trust: only a sidecar of this process's uid or root, writable by no one else, is read (as the
shared tier trusts only such segments); a shard whose size, mtime or header differs from the
sidecar's is refused at open, naming the command that indexes it again.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import xxhash

from ..atomic import atomic_path
from ..engram.config import EngramConfig, check_config_fields
from ..errors import ChecksumError, TableFormatError
from .format import TableLayout
from .stream import PAGE, Span, open_for_load

__all__ = ["SIDECAR_NAME", "Checkpoint", "Part", "PartsLayout", "Piece", "find_parts", "is_sidecar", "read_sidecar",
           "shard_identity", "table_layout", "write_sidecar"]

SIDECAR_NAME = "engram-offload.index"
MAGIC = b"ENGRAMIX"
MAGIC_NAME = "engram-offload-checkpoint-index"
VERSION = 1
PREFIX = struct.Struct("<8sIIQ")  # magic, version, JSON length, xxh3_64 of the JSON
MAX_JSON_BYTES = 16 << 20
MAX_SHARD_HEADER = 100 << 20  # safetensors' own bound on a header

# Row bytes as the checkpoint stores them: safetensors dtype of the weight for each row format.
WEIGHT_DTYPES = {"fp8_e4m3_ue8m0": "F8_E4M3", "fp32": "F32", "bf16": "BF16", "fp16": "F16"}
SCALE_DTYPES = ("F8_E8M0", "U8")
ITEM_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "U8": 1, "F32": 4, "BF16": 2, "F16": 2}


@dataclass(frozen=True)
class Part:
    """One tensor holding ``row_bytes`` of each of a layer's ``rows`` rows, from byte ``offset``
    of shard ``shard``; its pages' checksums start at ``first_sum`` in ``Checkpoint.page_sums``."""

    tensor: str
    shard: int
    offset: int
    row_bytes: int
    rows: int
    first_sum: int

    @property
    def first_page(self) -> int:
        return self.offset // PAGE

    @property
    def pages(self) -> int:
        return -(-(self.offset + self.rows * self.row_bytes) // PAGE) - self.first_page


class Piece(NamedTuple):
    """A part's rows inside a loaded chunk: ``rows`` rows from the chunk's row ``row``, whose
    ``pages`` pages (checksums from ``first_sum``) lie at ``at`` in the buffer, the first row's
    bytes ``skip`` bytes after them."""

    part: int
    column: int
    row_bytes: int
    row: int
    rows: int
    at: int
    pages: int
    first_sum: int
    skip: int
    span: Span


class Checkpoint:
    """Where a checkpoint's Engram rows are: shards (``identities``: name, size, mtime_ns,
    header_xxh3), each layer's parts, and the checksums of the pages they cover."""

    def __init__(self, directory: Path, sidecar: Path, config: EngramConfig, identities: list[dict[str, Any]],
                 parts: dict[int, tuple[Part, ...]], sums: np.ndarray) -> None:
        self.directory, self.sidecar, self.config = directory, sidecar, config
        self.table_sums: dict[tuple[int, ...], np.ndarray] = {}  # parts -> uint32 page sums of their table
        self.identities = identities
        self.shards = tuple(directory / ident["name"] for ident in identities)
        self.sizes = np.array([ident["size"] for ident in identities], np.int64)  # [S]
        self.parts = parts
        self.page_sums = sums  # uint32 [G]
        first = parts[config.layer_ids[0]]
        self.part_bytes = np.array([p.row_bytes for p in first], np.int64)  # [P]
        self.columns = np.cumsum(self.part_bytes) - self.part_bytes  # [P] where each part goes in a row
        self.bases = np.array(config.layer_row_bases, np.int64)  # [L]
        # [L, P] page-space offset of each part's row 0: its first page's place, then the offset in it
        self.vbase = np.array([[p.first_sum * PAGE + p.offset % PAGE for p in parts[i]] for i in config.layer_ids],
                              np.int64)
        regions = sorted((p for i in config.layer_ids for p in parts[i]), key=lambda p: p.first_sum)
        self.region_sum = np.array([p.first_sum for p in regions], np.int64)  # [R] ascending
        self.region_page = np.array([p.first_page for p in regions], np.int64)  # [R] file page of each
        self.region_shard = np.array([p.shard for p in regions], np.int64)  # [R]
        self._regions = regions

    def locate(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Shard index and file offset (int64 ``[m]`` each) of checksummed pages ``pages``."""
        r = np.searchsorted(self.region_sum, pages, side="right") - 1
        return self.region_shard[r], (self.region_page[r] + pages - self.region_sum[r]) * PAGE

    def layer_ranges(self, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
        """(layer id, its first row in the table, local rows lo, hi) of table rows ``[start, stop)``."""
        for layer, base in zip(self.config.layer_ids, self.config.layer_row_bases):
            lo, hi = max(start - base, 0), min(stop - base, self.config.rows_per_layer[layer])
            if lo < hi:
                yield layer, base, lo, hi

    def page_error(self, page: int, reread: bool = True) -> ChecksumError:
        """The error for checksummed page ``page`` read wrong (twice, with ``reread``), naming the
        rows of every Engram tensor in it."""
        shards, offsets = self.locate(np.array([page], np.int64))
        shard, at = int(shards[0]), int(offsets[0])
        held = [f"{p.tensor} rows {max(0, (at - p.offset) // p.row_bytes):,}.."
                f"{min(p.rows, -(-(at + PAGE - p.offset) // p.row_bytes)) - 1:,}"
                for p in self._regions if p.shard == shard and p.first_page <= at // PAGE < p.first_page + p.pages]
        again = " after a re-read" if reread else ""
        return ChecksumError(
            f"{self.shards[shard]}: the page at byte {at:,} ({', '.join(held)}) does not match the checksum "
            f"{self.sidecar} holds{again}: the shard is damaged or was changed; re-download it, or re-index with "
            f"engram-offload index {self.directory}")

    def chunks(self, start: int, stop: int, parts: tuple[int, ...], chunk_rows: int, fds: list[int]
               ) -> Iterator[tuple[tuple[int, int, list[Piece]], list[Span]]]:
        """``ChunkReader`` chunks of table rows ``[start, stop)``, ``chunk_rows`` at a time: the
        pages of each layer's ``parts`` (indexes into a layer's parts) under them."""
        column = dict(zip(parts, np.cumsum([self.part_bytes[k] for k in parts]) - self.part_bytes[list(parts)]))
        for a in range(start, stop, chunk_rows):
            b = min(a + chunk_rows, stop)
            pieces, spans, at = [], [], 0
            for layer, base, lo, hi in self.layer_ranges(a, b):
                for k in parts:
                    p = self.parts[layer][k]
                    first, end = p.offset + lo * p.row_bytes, p.offset + hi * p.row_bytes
                    f0, f1 = first // PAGE, -(-end // PAGE)
                    span = Span(fds[p.shard], f0 * PAGE, (f1 - f0) * PAGE,
                                int(min((f1 - f0) * PAGE, self.sizes[p.shard] - f0 * PAGE)), self.shards[p.shard])
                    pieces.append(Piece(k, int(column[k]), p.row_bytes, base + lo - a, hi - lo, at, f1 - f0,
                                        p.first_sum + f0 - p.first_page, first - f0 * PAGE, span))
                    spans.append(span)
                    at += span.nbytes
            yield (a, b, pieces), spans

    def chunk_buffer_bytes(self, chunk_rows: int, parts: tuple[int, ...]) -> int:
        """A buffer that holds any chunk of ``chunk_rows`` rows: their bytes, two part pages a piece."""
        pieces = len(parts) * len(self.config.layer_ids)
        return chunk_rows * int(self.part_bytes[list(parts)].sum()) + 2 * PAGE * pieces

    def open_files(self) -> list[int]:
        """A descriptor per shard (O_DIRECT where the file system takes it); the caller closes them."""
        fds: list[int] = []
        try:
            for shard in self.shards:
                fds.append(open_for_load(shard))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds



@dataclass(frozen=True)
class PartsLayout(TableLayout):
    """The layout of a table of only some ``parts`` of each row, ``width`` bytes a row (a checkpoint's
    scales, held resident by a tier of their own); not a file: its pages are those its tier checks."""

    width: int = 0
    parts: tuple[int, ...] = ()

    @property
    def row_bytes(self) -> int:
        return self.width

    def header_dict(self) -> dict[str, Any]:
        return {**super().header_dict(), "row_bytes": self.width, "parts": list(self.parts)}


def table_layout(checkpoint: Checkpoint, parts: tuple[int, ...]) -> TableLayout:
    """The layout of the table of ``parts`` of the checkpoint's rows: every part, the table ``convert``
    writes; else a ``PartsLayout``."""
    if parts == tuple(range(len(checkpoint.part_bytes))):
        return TableLayout.for_config(checkpoint.config)
    return PartsLayout(checkpoint.config, PAGE, width=int(checkpoint.part_bytes[list(parts)].sum()), parts=parts)


def is_sidecar(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file starting with the sidecar's magic."""
    try:
        if not os.path.isfile(path):
            return False
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


# ------------------------------------------------------------------------------------ shards
def _shard_header(path: Path) -> tuple[bytes, dict[str, Any]]:
    """A safetensors file's header bytes (length prefix included) and its parsed JSON."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= MAX_SHARD_HEADER:
            raise ValueError(f"{path} is not a safetensors file (header length {n}): re-download the shard")
        body = f.read(n)
    try:
        meta = json.loads(body)
        if not isinstance(meta, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        raise ValueError(f"{path} has an unreadable safetensors header ({exc}): re-download the shard") from None
    return head + body, meta


def shard_identity(path: Path) -> dict[str, Any]:
    """What names a shard's contents: file name, size, mtime_ns and xxh3_64 of its safetensors header."""
    st = os.stat(path)
    head, _ = _shard_header(path)
    return {"name": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "header_xxh3": f"{xxhash.xxh3_64_intdigest(head):016x}"}


def find_parts(directory: Path, config: EngramConfig) -> tuple[list[Path], dict[int, tuple[Part, ...]]]:
    """The shards holding the Engram embeddings of the checkpoint in ``directory`` and each layer's
    parts (values, then ue8m0 scales for fp8 rows); ``ValueError`` for tensors whose bytes are not
    the table's rows as stored (those need ``convert``)."""
    from .convert import find_engram_tensors

    found = find_engram_tensors(directory)
    if sorted(found) != sorted(config.layer_ids):
        raise ValueError(f"the checkpoint's Engram layers {sorted(found)} do not match the config's "
                         f"{list(config.layer_ids)}")
    shards: list[Path] = []
    headers: dict[Path, tuple[int, dict[str, Any]]] = {}
    placed: list[tuple[int, int, int, str, int]] = []  # (shard, offset, layer, tensor, row bytes)
    d, fmt = config.head_dim, config.row_format
    if fmt not in WEIGHT_DTYPES:
        raise ValueError(f"a table of {fmt} rows cannot be served from the checkpoint's bytes: convert it instead "
                         "(engram-offload convert)")
    for layer in config.layer_ids:
        t = found[layer]
        rows = config.rows_per_layer[layer]
        wanted: list[tuple[str, Path, tuple[str, ...], int]] = [(t.weight, t.shard, (WEIGHT_DTYPES[fmt],), d)]
        if fmt == "fp8_e4m3_ue8m0":
            if t.scale is None or t.scale_shard is None:
                raise ValueError(f"{t.weight} is fp8 but layer {layer} has no embed.scale: the checkpoint is incomplete")
            wanted.append((t.scale, t.scale_shard, SCALE_DTYPES, d // 32))
        elif t.scale is not None:
            raise ValueError(f"{t.scale} scales a {fmt} embedding: convert this checkpoint instead (engram-offload convert)")
        for name, shard, dtypes, width in wanted:
            if shard not in headers:
                head, meta = _shard_header(shard)
                headers[shard] = (len(head), meta)
                shards.append(shard)
            start, meta = headers[shard]
            entry = meta.get(name)
            if not isinstance(entry, dict):
                raise ValueError(f"{shard} has no tensor {name} in its header: re-download the shard")
            dtype, shape, (begin, end) = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets", (0, -1))
            if dtype not in dtypes:
                raise ValueError(f"{name} is {dtype}, not {' or '.join(dtypes)}: its bytes are not the table's {fmt} "
                                 "rows; convert this checkpoint instead (engram-offload convert)")
            if shape != [rows, width]:
                raise ValueError(f"{name} has shape {shape}; the config derives [{rows}, {width}] for layer {layer}: "
                                 "check the config matches the checkpoint")
            row_bytes = width * ITEM_BYTES[dtype]
            if end - begin != rows * row_bytes or begin < 0:
                raise ValueError(f"{shard}: {name}'s data offsets {begin}..{end} do not hold {rows:,} rows of "
                                 f"{row_bytes} bytes: re-download the shard")
            placed.append((shards.index(shard), start + begin, layer, name, row_bytes))
    parts: dict[int, list[Part]] = {layer: [] for layer in config.layer_ids}
    first_sum = 0
    for index, offset, layer, name, row_bytes in sorted(placed):  # a shard's pages together
        part = Part(name, index, offset, row_bytes, config.rows_per_layer[layer], first_sum)
        parts[layer].append(part)
        first_sum += part.pages
    ordered = {layer: tuple(sorted(ps, key=lambda p: p.tensor != found[layer].weight)) for layer, ps in parts.items()}
    return shards, ordered


# ------------------------------------------------------------------------------------ the file
def write_sidecar(checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint``'s sidecar at ``checkpoint.sidecar`` atomically, writable by its owner only."""
    meta = {
        "magic": MAGIC_NAME, "version": VERSION, "checkpoint": str(checkpoint.directory),
        "config": checkpoint.config.to_dict(), "shards": checkpoint.identities,
        "layers": {str(layer): [vars(p) for p in parts] for layer, parts in checkpoint.parts.items()},
        "shard_pages": len(checkpoint.page_sums),
        "tables": [[list(parts), len(sums)] for parts, sums in checkpoint.table_sums.items()],
    }
    body = json.dumps(meta, sort_keys=True).encode()
    sums = [checkpoint.page_sums.astype("<u4"), *(t.astype("<u4") for t in checkpoint.table_sums.values())]
    digest = xxhash.xxh3_64()
    with atomic_path(checkpoint.sidecar) as tmp:
        with open(tmp, "wb") as f:
            f.write(PREFIX.pack(MAGIC, VERSION, len(body), xxhash.xxh3_64_intdigest(body)) + body)
            for array in sums:
                data = array.tobytes()
                f.write(data)
                digest.update(data)
            f.write(struct.pack("<Q", digest.intdigest()))
    mode = stat.S_IMODE(os.stat(checkpoint.sidecar).st_mode)
    if mode & 0o022:
        os.chmod(checkpoint.sidecar, mode & ~0o022)
    return checkpoint.sidecar


def _trusted(path: Path, st: os.stat_result) -> None:
    """Refuse a sidecar another uid wrote or may write."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise TableFormatError(f"{path} belongs to uid {st.st_uid}, not to this process's uid {me} or root: an index "
                               f"is trusted only from its operator; index the checkpoint yourself "
                               f"(engram-offload index CHECKPOINT_DIR --out SIDECAR)")
    if st.st_mode & 0o022:
        raise TableFormatError(f"{path} is mode {stat.S_IMODE(st.st_mode):04o}: other users may write it, so it cannot "
                               f"be trusted; chmod go-w {path}, or index the checkpoint again")


def read_sidecar(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint a sidecar (or a checkpoint folder, its sidecar beside the shards) describes,
    every shard's identity checked, with the page sums of its tables."""
    given = Path(path)
    sidecar = given / SIDECAR_NAME if given.is_dir() else given
    try:
        f = open(sidecar, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{given} has no index ({SIDECAR_NAME}): run engram-offload index {given} once "
                                "(with --out SIDECAR on a read-only mount, then open that file)") from None
    with f:
        st = os.fstat(f.fileno())
        _trusted(sidecar, st)
        magic, version, length, digest = PREFIX.unpack(f.read(PREFIX.size).ljust(PREFIX.size, b"\0"))
        if magic != MAGIC or version != VERSION:
            raise TableFormatError(f"{sidecar} is not a checkpoint index of version {VERSION}: index the checkpoint "
                                   "again (engram-offload index)")
        body = f.read(min(length, MAX_JSON_BYTES))
        if xxhash.xxh3_64_intdigest(body) != digest:
            raise TableFormatError(f"{sidecar}: the index's header does not match its checksum; index the checkpoint again")
        checkpoint, tables = _checkpoint(sidecar, body)
        g, t = len(checkpoint.page_sums), sum(pages for _, pages in tables)
        if st.st_size != PREFIX.size + length + 4 * (g + t) + 8:
            raise TableFormatError(f"{sidecar} is {st.st_size:,} bytes, not what its header says: it is truncated or "
                                   "damaged; index the checkpoint again")
        raw = f.read(4 * (g + t) + 8)
    if xxhash.xxh3_64_intdigest(raw[:-8]) != struct.unpack("<Q", raw[-8:])[0]:
        raise TableFormatError(f"{sidecar}: its page checksums are damaged; index the checkpoint again")
    checkpoint.page_sums[:] = np.frombuffer(raw, "<u4", count=g)
    at = 4 * g
    for parts, pages in tables:
        checkpoint.table_sums[parts] = np.frombuffer(raw, "<u4", count=pages, offset=at).copy()
        at += 4 * pages
    if given.is_dir() and not _same(given, checkpoint.directory):
        raise TableFormatError(f"{sidecar} indexes {checkpoint.directory}, not {given}: index {given} again")
    for shard, ident in zip(checkpoint.shards, checkpoint.identities):
        try:
            now = shard_identity(shard)
        except (FileNotFoundError, ValueError):
            now = None
        if now != ident:
            raise TableFormatError(f"{shard} is not the shard indexed in {sidecar} (its size, mtime or header "
                                   f"changed, or it is gone): index it again with engram-offload index "
                                   f"{checkpoint.directory}" + (f" --out {sidecar}" if sidecar.parent != checkpoint.directory else ""))
    return checkpoint


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _checkpoint(sidecar: Path, body: bytes) -> tuple[Checkpoint, list[tuple[tuple[int, ...], int]]]:
    """The checkpoint a sidecar's JSON describes (its page sums zero) and its tables (parts, pages),
    every field checked."""
    try:
        meta = json.loads(body)
        if not isinstance(meta, dict) or meta.get("magic") != MAGIC_NAME:
            raise ValueError("not a checkpoint index")
        check_config_fields(meta.get("config"))
        config = EngramConfig(**meta["config"])
        identities = [{k: ident[k] for k in ("name", "size", "mtime_ns", "header_xxh3")} for ident in meta["shards"]]
        if any(Path(i["name"]).name != i["name"] or not isinstance(i["size"], int) for i in identities):
            raise ValueError("a shard name is not a file name")
        parts = {layer: tuple(Part(**p) for p in meta["layers"][str(layer)]) for layer in config.layer_ids}
        pages = int(meta["shard_pages"])
        for layer, ps in parts.items():
            if sum(p.row_bytes for p in ps) != config.row_bytes or any(p.rows != config.rows_per_layer[layer] for p in ps):
                raise ValueError(f"layer {layer}'s parts do not make {config.row_bytes}-byte rows")
            for p in ps:
                if not (0 <= p.shard < len(identities) and p.offset >= 0 and 0 <= p.first_sum
                        and p.first_sum + p.pages <= pages
                        and p.offset + p.rows * p.row_bytes <= identities[p.shard]["size"]):
                    raise ValueError(f"{p.tensor} lies outside its shard or the page sums")
        checkpoint = Checkpoint(Path(meta["checkpoint"]), sidecar, config, identities, parts, np.zeros(pages, np.uint32))
        tables = [(tuple(int(k) for k in kept), int(count)) for kept, count in meta["tables"]]
        everything = tuple(range(len(checkpoint.part_bytes)))
        if tables[0][0] != everything or any(not set(kept) <= set(everything)
                                             or count != table_layout(checkpoint, kept).num_pages for kept, count in tables):
            raise ValueError("its tables' page counts disagree with the config")
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise TableFormatError(f"{sidecar}: unreadable checkpoint index ({exc}); index the checkpoint again") from None
    return checkpoint, tables
