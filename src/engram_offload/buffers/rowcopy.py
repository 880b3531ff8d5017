"""Row copies of the fetch path: gather, scatter and move rows of raw bytes between buffers.

Every fetch moves rows: out of a cache's slots, out of a page buffer at byte offsets, into
a result at the positions of its misses, into the slots a cache reserved. On the CPU these
copies never go through a multi-threaded tensor op: after each parallel op PyTorch's
OpenMP workers spin on the other cores for a while, which on a serving host takes the
cores the fetch path and the backbone need (measured: 11 us of CPU per direct read
instead of 4). They run in one C call of the native helper ``_rowcopy.move_rows``,
or in NumPy (which copies in the calling thread) when the helper is not built. Rows on
another device are copied with tensor ops there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._native import native_disabled

__all__ = ["move_rows", "native_move_rows"]


_UNRESOLVED = object()
_built: Any = _UNRESOLVED


def _built_move() -> Any:
    """The C copy when the helper ``_rowcopy`` is built, else None (resolved at first use)."""
    global _built
    if _built is _UNRESOLVED:
        try:
            from . import _rowcopy  # type: ignore[attr-defined]
        except ImportError:
            _built = None
        else:
            _built = _rowcopy.move_rows
    return _built


def native_move_rows() -> Any:
    """The C ``move_rows(src, src_offsets, dst, dst_offsets, row_bytes)`` over flat byte buffers
    and int64 byte offsets (no checks beyond its own bounds checks), or None when it is not built
    or switched off (``_native.native_disabled``): for callers that take a lookup apart in C."""
    return None if native_disabled() else _built_move()


def _host_bytes(buf: torch.Tensor | np.ndarray) -> np.ndarray | None:
    """A contiguous host buffer as a flat uint8 NumPy view (None: not on the host, or strided)."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            return None
        buf = buf.numpy()
    if not buf.flags.c_contiguous:
        return None
    return buf.reshape(-1).view(np.uint8)


def move_rows(src: torch.Tensor | np.ndarray, src_rows: np.ndarray | None,
              dst: torch.Tensor | np.ndarray, dst_rows: np.ndarray | None, *,
              src_byte_offsets: bool = False) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for rows of ``dst``'s last dimension in bytes.

    ``src``, ``dst``: uint8 ``[*, row_bytes]`` tensors or arrays (``src`` may be flat bytes
    with ``src_byte_offsets``: ``src_rows`` are then byte offsets into it). ``None`` for
    either index: rows ``0..n-1`` in order. An index out of range raises ``IndexError``
    before anything is copied.
    """
    rb = int(dst.shape[-1])
    if src_rows is None and dst_rows is None:
        raise ValueError("move_rows: give src_rows, dst_rows or both")
    n = len(src_rows) if src_rows is not None else len(dst_rows)  # type: ignore[arg-type]
    if n == 0:
        return
    s, d = _host_bytes(src), _host_bytes(dst)
    if s is None or d is None:
        _move_tensors(src, src_rows, dst, dst_rows, src_byte_offsets)
        return
    src_off = None if src_rows is None else _offsets(src_rows, 1 if src_byte_offsets else rb)
    dst_off = None if dst_rows is None else _offsets(dst_rows, rb)
    native = native_move_rows()
    if native is not None:
        native(s, src_off, d, dst_off, rb)
        return
    _move_numpy(s, src_off, d, dst_off, rb, n)


def _offsets(rows: np.ndarray, unit: int) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.dtype.kind not in "iu":
        raise TypeError(f"row indexes must be integers, got {rows.dtype}")
    return np.ascontiguousarray(rows, np.int64).reshape(-1) * unit


def _move_numpy(s: np.ndarray, src_off: np.ndarray | None, d: np.ndarray, dst_off: np.ndarray | None,
                rb: int, n: int) -> None:
    """``move_rows`` in NumPy: byte windows picked by fancy indexing (bounds checked first)."""
    for name, buf, off in (("src", s, src_off), ("dst", d, dst_off)):
        limit = buf.size - rb
        if off is None:
            if n * rb > buf.size:
                raise IndexError(f"move_rows: {n} rows of {rb} bytes overrun the {buf.size}-byte {name}")
        elif off.size and (off.min() < 0 or off.max() > limit):
            bad = int(off[(off < 0) | (off > limit)][0])
            raise IndexError(f"move_rows: {name} offset {bad} outside 0..{limit}")
    columns = np.arange(rb, dtype=np.int64)
    rows = s[:n * rb].reshape(n, rb) if src_off is None else s[src_off[:, None] + columns]  # [n, rb]
    if dst_off is None:
        d[:n * rb].reshape(n, rb)[:] = rows
    else:
        d[dst_off[:, None] + columns] = rows


def _move_tensors(src: Any, src_rows: np.ndarray | None, dst: Any, dst_rows: np.ndarray | None,
                  src_byte_offsets: bool) -> None:
    """``move_rows`` with tensor ops, for rows on a device (or strided host tensors)."""
    src_t = torch.as_tensor(src)
    dst_t = torch.as_tensor(dst)
    rb = int(dst_t.shape[-1])
    if src_byte_offsets:
        flat = src_t.reshape(-1)  # a view when it can be: strided, then
        windows = flat.unfold(0, rb, 1)  # [N - rb + 1, rb], overlapping, through flat's own stride
        picked = windows.index_select(0, torch.from_numpy(np.asarray(src_rows, np.int64)).to(flat.device))
    elif src_rows is None:
        picked = src_t.reshape(-1, rb)[: len(dst_rows)]  # type: ignore[arg-type]
    else:
        picked = src_t.reshape(-1, rb).index_select(0, torch.from_numpy(np.asarray(src_rows, np.int64)).to(src_t.device))
    picked = picked.to(dst_t.device)
    if dst_rows is None:
        dst_t[: picked.shape[0]].copy_(picked)
    else:
        index = torch.from_numpy(np.asarray(dst_rows, np.int64)).to(dst_t.device)
        dst_t.index_copy_(0, index, picked)
