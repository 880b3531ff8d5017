"""A checkpoint as a table: its Engram rows served from its own safetensors shards.

``index_checkpoint`` (``engram-offload index``) reads every Engram page once and writes a small
sidecar (``table/sidecar.py``): the layout, where each layer's tensors lie, their pages' checksums
and each shard's identity. ``read_checkpoint_header`` then opens the checkpoint (its folder or
the sidecar) as a ``TableHeader`` of the table ``convert`` would write: the same layout, page sums
and fingerprint (a shared segment, row server or pool of either serves the other), plus a
``Checkpoint``: where each row's bytes are.

A table row of a layer is the concatenation of its parts, one per tensor: for fp8 rows the
``head_dim`` value bytes of ``embed.weight`` at ``offset + row * head_dim`` (not page aligned:
a row may straddle two pages) then the ``head_dim / 32`` scale bytes of ``embed.scale``. Pages
are the shards' own aligned 4 KiB pages; those covering an Engram tensor are numbered across the
shards (``Part.first_sum``), their checksums (``pagesum``: low 32 bits of XXH3-64, a page past its
file's end read as zeros) in ``Checkpoint.page_sums``. Every page a tier reads is checked.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ..engram.config import EngramConfig
from ..errors import TableFormatError
from .format import OPENERS, TableHeader, TableLayout
from .pagesum import page_sums
from .progress import byte_progress
from .sidecar import (
    SIDECAR_NAME,
    Checkpoint,
    Part,
    Piece,
    find_parts,
    is_sidecar,
    read_sidecar,
    shard_identity,
    table_layout,
    write_sidecar,
)
from .stream import PAGE, ChunkReader, read_fully

__all__ = ["Checkpoint", "CheckpointHeader", "Part", "checkpoint_of", "index_checkpoint", "is_checkpoint",
           "load_rows", "read_checkpoint_header", "scales_header", "verify_checkpoint"]

LOAD_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class CheckpointHeader(TableHeader):
    """A checkpoint opened as the table ``convert`` would write from it (``path``: its sidecar); with
    ``parts``, as a table of only those parts of each row (``scales_header``)."""

    checkpoint: Checkpoint | None = None
    parts: tuple[int, ...] | None = None


_OPENED: weakref.WeakValueDictionary[tuple[str, int], Checkpoint] = weakref.WeakValueDictionary()


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a checkpoint's folder (its ``config.json`` or sidecar in it) or sidecar."""
    folder = Path(path)
    if folder.is_dir():
        return (folder / "config.json").is_file() or (folder / SIDECAR_NAME).exists()
    return is_sidecar(folder)


def read_checkpoint_header(path: str | os.PathLike[str]) -> CheckpointHeader:
    """Open a checkpoint (its folder, with the sidecar ``index`` wrote beside it, or the sidecar)
    as a table; refuse a sidecar of another uid or a shard changed since it was indexed."""
    checkpoint = read_sidecar(path)
    header = _header(checkpoint, tuple(range(len(checkpoint.part_bytes))), checkpoint.sidecar)
    _OPENED[(str(checkpoint.sidecar), header.sums_digest)] = checkpoint
    return header


def scales_header(header: CheckpointHeader) -> CheckpointHeader | None:
    """A table of the checkpoint's scales alone (``head_dim / 32`` bytes a row), for a resident tier to
    hold (the direct tier's scales); None for rows without scales. Its path, ``<sidecar>.scales``, only
    names it (a shared segment's source)."""
    checkpoint = header.checkpoint
    if checkpoint is None or len(checkpoint.part_bytes) < 2:
        return None
    return _header(checkpoint, (1,), checkpoint.sidecar.with_name(checkpoint.sidecar.name + ".scales"))


def _header(checkpoint: Checkpoint, parts: tuple[int, ...], path: Path) -> CheckpointHeader:
    sums = checkpoint.table_sums[parts]
    digest = xxhash.xxh3_64_intdigest(sums.astype("<u4").tobytes())
    whole = parts == tuple(range(len(checkpoint.part_bytes)))
    return CheckpointHeader(path, table_layout(checkpoint, parts), digest, sums, checkpoint=checkpoint,
                            parts=None if whole else parts)


def _opener(path: Path) -> CheckpointHeader | None:
    """``format.read_header``'s opener of checkpoints."""
    return read_checkpoint_header(path) if is_checkpoint(path) else None


OPENERS.append(_opener)


def checkpoint_of(header: TableHeader) -> Checkpoint | None:
    """The checkpoint behind ``header`` (a checkpoint's, or a slice of one: ``layered.window_header``),
    None for a table file's."""
    found = getattr(header, "checkpoint", None) or _OPENED.get((str(header.path), header.sums_digest))
    if found is not None or not is_checkpoint(header.path):
        return found
    again = read_checkpoint_header(header.path)
    if again.sums_digest != header.sums_digest:
        raise TableFormatError(f"{header.path} was re-indexed since it was opened: open the checkpoint again")
    return again.checkpoint


# ---------------------------------------------------------------------------------------- loading
def load_rows(checkpoint: Checkpoint, start: int, stop: int, dest: np.ndarray | None, *,
              parts: tuple[int, ...] | None = None, verify: bool = True, progress: bool | None = None,
              what: str = "loading", on_chunk: Callable[[int], None] | None = None,
              chunk_bytes: int = LOAD_CHUNK_BYTES, read: Callable[..., None] = read_fully) -> None:
    """Table rows ``[start, stop)`` of ``checkpoint`` into ``dest`` (uint8 ``[stop - start, width]``:
    the bytes of ``parts``, default all: whole rows), read at the disk's sequential rate, every page
    checked unless ``verify`` is False (a bad page is read once more, then ``ChecksumError``);
    ``dest`` None: check only. ``on_chunk(bytes done)`` after each chunk."""
    parts = tuple(range(len(checkpoint.part_bytes))) if parts is None else parts
    width = int(checkpoint.part_bytes[list(parts)].sum())
    chunk_rows = max(1, chunk_bytes // width)
    fds = checkpoint.open_files()
    reader = ChunkReader(checkpoint.chunks(start, stop, parts, chunk_rows, fds),
                         checkpoint.chunk_buffer_bytes(chunk_rows, parts), read)
    done = 0
    try:
        with byte_progress(f"{what} {checkpoint.directory.name}", (stop - start) * width, progress) as advance:
            for (a, b, pieces), buf in reader:
                for piece in pieces:
                    if verify:
                        _check_piece(checkpoint, piece, buf, read)
                    if dest is not None:
                        rows = buf[piece.at + piece.skip: piece.at + piece.skip + piece.rows * piece.row_bytes]
                        dest[a - start + piece.row: a - start + piece.row + piece.rows,
                             piece.column: piece.column + piece.row_bytes] = rows.reshape(piece.rows, piece.row_bytes)
                reader.release(buf)
                advance((b - a) * width)
                done += (b - a) * width
                if on_chunk is not None:
                    on_chunk(done)
    finally:
        reader.stop()
        for fd in fds:
            os.close(fd)


def _check_piece(checkpoint: Checkpoint, piece: Piece, buf: np.ndarray, read: Callable[..., None]) -> None:
    """A piece's pages against their checksums; a bad page is read once more, then ``ChecksumError``."""
    view = buf[piece.at: piece.at + piece.pages * PAGE]
    want = checkpoint.page_sums[piece.first_sum: piece.first_sum + piece.pages]
    for i in np.flatnonzero(page_sums(view, PAGE) != want).tolist():
        page = view[i * PAGE: (i + 1) * PAGE]
        span = piece.span
        read(span.fd, page, span.offset + i * PAGE, span.path, max(0, min(PAGE, span.valid - i * PAGE)))
        if page_sums(page, PAGE)[0] != want[i]:
            raise checkpoint.page_error(piece.first_sum + i)


def verify_checkpoint(header: CheckpointHeader, progress: bool | None = None) -> CheckpointHeader:
    """Read every Engram page of an opened checkpoint and check it against its sidecar; its header."""
    assert header.checkpoint is not None
    load_rows(header.checkpoint, 0, header.layout.num_rows, None, progress=progress, what="verifying")
    return header


# ---------------------------------------------------------------------------------------- indexing
def index_checkpoint(directory: str | os.PathLike[str], config: EngramConfig, out: str | os.PathLike[str] | None = None,
                     *, progress: bool | None = None) -> tuple[Path, dict[str, float]]:
    """Write the sidecar of the checkpoint in ``directory`` (at ``out``, default beside its shards):
    one pass over its Engram pages. Returns the sidecar's path and ``{"bytes", "seconds"}`` of the pass."""
    directory = Path(directory).absolute()
    target = Path(out).absolute() if out is not None else directory / SIDECAR_NAME
    if not os.access(target.parent, os.W_OK):
        hint = "write it elsewhere with --out SIDECAR" if out is None else "give another --out"
        raise PermissionError(f"cannot write the index into {target.parent} (read-only or not yours): {hint}")
    shard_paths, layer_parts = find_parts(directory, config)
    before = [shard_identity(p) for p in shard_paths]
    total = sum(p.pages for ps in layer_parts.values() for p in ps)
    checkpoint = Checkpoint(directory, target, config, before, layer_parts, np.zeros(total, np.uint32))
    everything = tuple(range(len(checkpoint.part_bytes)))
    # the table convert writes, and (with scales) the scales' table a direct tier holds resident
    tables = {kept: table_layout(checkpoint, kept) for kept in (everything, (1,))[: len(everything)]}
    rb = config.row_bytes
    whole_pages = int(np.lcm.reduce([t.rows_per_page for t in tables.values()]))
    chunk_rows = max(1, LOAD_CHUNK_BYTES // (rb * whole_pages)) * whole_pages  # whole pages of every table a chunk
    rows = np.empty((chunk_rows, rb), np.uint8)  # [chunk_rows, row_bytes]
    packed = np.zeros(max(-(-chunk_rows // t.rows_per_page) * t.page_bytes for t in tables.values()), np.uint8)
    fds = checkpoint.open_files()
    reader = ChunkReader(checkpoint.chunks(0, config.num_rows, everything, chunk_rows, fds),
                         checkpoint.chunk_buffer_bytes(chunk_rows, everything))
    checkpoint.table_sums = {parts: np.zeros(t.num_pages, np.uint32) for parts, t in tables.items()}
    started = time.perf_counter()
    try:
        with byte_progress(f"indexing {directory.name}", config.num_rows * rb, progress) as advance:
            for (a, b, pieces), buf in reader:
                for piece in pieces:  # the shard's pages: boundary pages twice, the same sum
                    checkpoint.page_sums[piece.first_sum: piece.first_sum + piece.pages] = \
                        page_sums(buf[piece.at: piece.at + piece.pages * PAGE], PAGE)
                    src = buf[piece.at + piece.skip: piece.at + piece.skip + piece.rows * piece.row_bytes]
                    rows[piece.row: piece.row + piece.rows, piece.column: piece.column + piece.row_bytes] = \
                        src.reshape(piece.rows, piece.row_bytes)
                reader.release(buf)
                for parts, layout in tables.items():
                    sums = _table_sums(rows[: b - a], checkpoint, parts, layout, packed)
                    checkpoint.table_sums[parts][a // layout.rows_per_page: a // layout.rows_per_page + len(sums)] = sums
                advance((b - a) * rb)
    finally:
        reader.stop()
        for fd in fds:
            os.close(fd)
    seconds = time.perf_counter() - started
    for path, ident in zip(shard_paths, before):
        if shard_identity(path) != ident:
            raise TableFormatError(f"{path} changed while it was indexed: index {directory} again once it is whole")
    write_sidecar(checkpoint)
    return target, {"bytes": float(config.num_rows * rb), "seconds": seconds}


def _table_sums(rows: np.ndarray, checkpoint: Checkpoint, parts: tuple[int, ...], layout: TableLayout,
                packed: np.ndarray) -> np.ndarray:
    """Page sums of the table of ``parts`` over ``rows`` (``uint8 [k, row_bytes]``, from a page's first
    row): its pages laid out in ``packed`` (rows back to back, then zeros)."""
    k, rpp, width = len(rows), layout.rows_per_page, layout.row_bytes
    pages, full, rest = -(-k // rpp), k // rpp, k % rpp
    held = packed[: pages * layout.page_bytes].reshape(pages, layout.page_bytes)  # [pages, page_bytes]
    held[:, rpp * width:] = 0
    cells = held[:, : rpp * width].reshape(pages, rpp, width)  # a view: [pages, rpp, width]
    columns = np.concatenate([np.arange(checkpoint.columns[p], checkpoint.columns[p] + checkpoint.part_bytes[p])
                              for p in parts])
    src = rows if width == rows.shape[1] else rows[:, columns]  # [k, width]
    cells[:full] = src[: full * rpp].reshape(full, rpp, width)
    if rest:
        cells[full, :rest] = src[full * rpp:]
        cells[full, rest:] = 0
    return page_sums(held, layout.page_bytes)
