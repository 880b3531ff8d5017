"""Writing tables: a streaming writer (rows in chunks, any size) and ``write_table``.

Writes are atomic: the table is written under a temporary name in the target directory,
fsynced, renamed over the target and the directory fsynced, so a reader sees either the
old file or the whole new one.

A temporary file is named ``.NAME.<boot id>.<pid>.<random>.tmp``: a later write can tell
whether the writer that left it is still alive (same boot, pid running). A new write to
``NAME`` removes dead writers' leftovers for ``NAME``; ``clean_temp_files`` (``verify --clean``)
removes them for a whole directory.
"""

from __future__ import annotations

import os
import re
import struct
import uuid
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
import xxhash

from ..atomic import fsync_dir
from ..engram.config import EngramConfig
from ..engram.rows import encode_rows
from .format import TableLayout, encode_header
from .pagesum import page_sums
from .progress import byte_progress

__all__ = ["TableWriter", "write_table", "as_raw_rows", "temp_path", "dead_temp_files", "clean_temp_files"]

ENCODE_CHUNK_ROWS = 1 << 16
RowSource = torch.Tensor | np.ndarray | Iterable[torch.Tensor | np.ndarray]


def as_raw_rows(rows: torch.Tensor | np.ndarray, config: EngramConfig) -> np.ndarray:
    """Float rows ``[n, head_dim]`` (encoded to the config's format) or raw ``uint8 [n, row_bytes]``
    -> raw bytes, a C-contiguous ``np.uint8 [n, row_bytes]``."""
    t = torch.from_numpy(np.ascontiguousarray(rows)) if isinstance(rows, np.ndarray) else rows
    if t.dim() != 2:
        raise ValueError(f"rows must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype == torch.uint8:
        if t.shape[1] != config.row_bytes:
            raise ValueError(
                f"raw uint8 rows must be [n, {config.row_bytes}] ({config.row_format} at head_dim "
                f"{config.head_dim}), got {tuple(t.shape)}"
            )
        return t.detach().cpu().contiguous().numpy()
    if not t.is_floating_point():
        raise ValueError(f"rows must be float [n, head_dim] or uint8 [n, row_bytes], got {t.dtype}")
    if t.shape[1] != config.head_dim:
        raise ValueError(f"float rows must be [n, {config.head_dim}], got {tuple(t.shape)}")
    return encode_rows(t.detach().cpu(), config.row_format).contiguous().numpy()


BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<boot>[0-9a-f]{32})\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.tmp$")


def boot_id() -> str:
    """This boot's id (32 hex digits), or zeros where the system has none."""
    try:
        return open(BOOT_ID_FILE).read().strip().replace("-", "")[:32].ljust(32, "0")
    except OSError:
        return "0" * 32


def temp_path(path: Path) -> Path:
    """A fresh temporary name beside ``path``, naming this process and boot."""
    return path.parent / f".{path.name}.{boot_id()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def _writer_alive(boot: str, pid: int) -> bool:
    if boot != boot_id() or pid < 1:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def dead_temp_files(directory: str | os.PathLike[str], target: str | None = None) -> list[Path]:
    """Temporary table files in ``directory`` (for ``target`` only, when given) whose writer
    is gone: it ran in an earlier boot, or its pid is no longer running."""
    dead = []
    for entry in sorted(Path(directory).iterdir()):
        m = _TEMP_NAME.match(entry.name)
        if m and (target is None or m["target"] == target) and entry.is_file() \
                and not _writer_alive(m["boot"], int(m["pid"])):
            dead.append(entry)
    return dead


def clean_temp_files(directory: str | os.PathLike[str], target: str | None = None) -> list[Path]:
    """Remove the temporary files ``dead_temp_files`` finds; return the paths removed."""
    removed = []
    for path in dead_temp_files(directory, target):
        try:
            path.unlink()
        except FileNotFoundError:  # another cleaner got there first
            continue
        removed.append(path)
    return removed


class TableWriter:
    """Streams rows into a new table file; ``close()`` publishes it atomically.

    ``write(rows)`` takes float rows ``[n, head_dim]`` or raw ``uint8 [n, row_bytes]``, in
    table row order. Exactly ``config.num_rows`` rows must be written before ``close``.
    Used as a context manager, an exception discards the temporary file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: EngramConfig,
        *,
        progress: bool | None = None,
    ) -> None:
        if not str(path):
            raise ValueError("the output path is empty: give a file name to write the table to")
        self.path = Path(path)
        self.config = config
        self.layout = TableLayout.for_config(config)
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"directory {self.path.parent} does not exist")
        if self.path.is_dir():
            raise IsADirectoryError(f"{self.path} is a directory: give a file name to write the table to")
        try:
            clean_temp_files(self.path.parent, self.path.name)
        except OSError:  # best effort: a leftover that cannot be removed must not stop the write
            pass
        self._tmp = temp_path(self.path)
        self._f = open(self._tmp, "wb", buffering=0)
        try:
            self._f.write(encode_header(self.layout))
        except BaseException:
            self._f.close()
            self._tmp.unlink(missing_ok=True)
            raise
        self._page_sums: list[np.ndarray] = []  # uint32 [pages] per written chunk
        self._pending = np.empty((0, config.row_bytes), np.uint8)
        self.rows_written = 0
        self._progress = byte_progress(f"writing {self.path.name}", self.layout.data_bytes, progress)
        self._advance = self._progress.__enter__()
        self._done = False
        self._aborted = False  # abort() ran: close() must not pretend a file was written

    def write(self, rows: torch.Tensor | np.ndarray) -> None:
        """Append rows (float ``[n, head_dim]`` or raw ``uint8 [n, row_bytes]``)."""
        for start in range(0, len(rows), ENCODE_CHUNK_ROWS):
            self._write_raw(as_raw_rows(rows[start:start + ENCODE_CHUNK_ROWS], self.config))

    def _write_raw(self, raw: np.ndarray) -> None:  # raw: [n, row_bytes] uint8
        n = len(raw)
        if self.rows_written + n > self.config.num_rows:
            self.abort()
            raise ValueError(
                f"too many rows: the table holds {self.config.num_rows:,} rows, got at least "
                f"{self.rows_written + n:,}"
            )
        self.rows_written += n
        if len(self._pending):
            raw = np.concatenate([self._pending, raw])
        rpp = self.layout.rows_per_page
        full = len(raw) // rpp
        if full:
            self._write_pages(raw[: full * rpp], full)
        self._pending = raw[full * rpp:].copy()

    def _write_pages(self, raw: np.ndarray, pages: int) -> None:
        rpp, rb, page = self.layout.rows_per_page, self.config.row_bytes, self.layout.page_bytes
        if rpp * rb == page:
            packed = np.ascontiguousarray(raw).reshape(-1)
        else:
            packed = np.zeros((pages, page), np.uint8)  # [pages, page_bytes]
            packed[:, : len(raw) // pages * rb] = raw.reshape(pages, -1)
        data = memoryview(packed).cast("B")  # type: ignore[arg-type]  # NumPy's stubs lack __buffer__
        self._page_sums.append(page_sums(data, page))
        self._f.write(data)
        self._advance(pages * page)

    def close(self) -> Path:
        """Finish the file (pad, trailer, fsync) and rename it into place; returns the path."""
        if self._aborted:
            raise ValueError(f"this writer of {self.path} was aborted and wrote no file: write the table "
                             "again with a new TableWriter")
        if self._done:
            return self.path
        if self.rows_written != self.config.num_rows:
            self.abort()
            raise ValueError(
                f"the table needs {self.config.num_rows:,} rows, only {self.rows_written:,} were "
                "written; the file was not created"
            )
        try:
            if len(self._pending):
                padded = np.zeros((self.layout.rows_per_page, self.config.row_bytes), np.uint8)
                padded[: len(self._pending)] = self._pending
                self._write_pages(padded, 1)
            sums = np.concatenate(self._page_sums).astype("<u4").tobytes() if self._page_sums else b""
            assert len(sums) == self.layout.page_sums_bytes
            trailer = sums + struct.pack("<Q", xxhash.xxh3_64_intdigest(sums))
            self._f.write(trailer + struct.pack("<Q", xxhash.xxh3_64_intdigest(trailer)))
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self.path)
            fsync_dir(self.path.parent)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._progress.__exit__(None, None, None)
        return self.path

    def abort(self) -> None:
        """Discard the temporary file; the target path is left as it was."""
        if self._done:
            return
        self._done = self._aborted = True
        self._progress.__exit__(None, None, None)
        self._f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "TableWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _chunks(rows: RowSource) -> Iterator[torch.Tensor | np.ndarray]:
    if isinstance(rows, (torch.Tensor, np.ndarray)):
        yield rows
    else:
        yield from rows


def write_table(
    path: str | os.PathLike[str],
    config: EngramConfig,
    rows: RowSource,
    *,
    progress: bool | None = None,
) -> Path:
    """Write a table atomically.

    ``rows``: float rows ``[num_rows, head_dim]`` (encoded with ``rows.encode_rows`` into
    ``config.row_format``), raw ``uint8 [num_rows, row_bytes]``, or an iterator of chunks
    of either, in row order.
    """
    with TableWriter(path, config, progress=progress) as writer:
        for chunk in _chunks(rows):
            writer.write(chunk)
    return writer.path
