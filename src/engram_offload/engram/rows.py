"""Row formats (SPEC section 5): how one embedding row of ``head_dim`` values is stored.

Every format has a fixed byte layout per row, so a table file is a flat array of
``[num_rows, row_bytes]`` bytes and any row can be read on its own:

- ``fp32``, ``bf16``, ``fp16``: ``head_dim`` little-endian values.
- ``fp8_e4m3_ue8m0``: ``head_dim`` bytes of float8_e4m3fn, then ``head_dim / 32``
  ue8m0 scale bytes (value = fp8 * 2**(byte - 127); as in vLLM, byte 0 decodes to a
  scale of 0.0 and byte 255 to inf).
- ``int8``: ``head_dim`` int8 values, then one float32 scale (value = int8 * scale).

``encode`` turns float rows ``[n, d]`` into raw bytes ``[n, row_bytes]``; ``decode``
turns raw bytes back into float rows. fp8 round trip error bound, per element:
``|x - decode(encode(x))| <= max(|x| * 2**-4, scale * 2**-10)`` where ``scale`` is the
power-of-two block scale (3 mantissa bits; subnormal spacing 2**-9 of the scale).
int8: ``|x - x'| <= amax(row) / 254``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._native import native_disabled
from ..buffers.recycle import RecycledArrays
from ..buffers.rowcopy import move_rows

__all__ = [
    "ROW_FORMATS",
    "RowFormat",
    "get_row_format",
    "row_bytes",
    "encode_rows",
    "decode_rows",
    "fp8_decode_path",
    "quantize_fp8_ue8m0",
    "dequantize_fp8_ue8m0",
    "dequantize_fp8_blocks",
    "ue8m0_exponents",
    "ue8m0_scales",
]

FP8_MAX = 448.0
FP8_BLOCK = 32
UE8M0_BIAS = 127


@dataclass(frozen=True)
class RowFormat:
    """A row layout: its name and how many bytes one row of ``head_dim`` values takes."""

    name: str
    description: str

    def row_bytes(self, head_dim: int) -> int:
        if self.name == "fp32":
            return 4 * head_dim
        if self.name in ("bf16", "fp16"):
            return 2 * head_dim
        if self.name == "fp8_e4m3_ue8m0":
            _check_fp8_dim(head_dim)
            return head_dim + head_dim // FP8_BLOCK
        if self.name == "int8":
            return head_dim + 4
        raise AssertionError(self.name)


ROW_FORMATS: dict[str, RowFormat] = {
    f.name: f
    for f in (
        RowFormat("fp32", "float32 values"),
        RowFormat("bf16", "bfloat16 values"),
        RowFormat("fp16", "float16 values"),
        RowFormat("fp8_e4m3_ue8m0", "float8_e4m3fn values with a ue8m0 scale per 32"),
        RowFormat("int8", "int8 values with one float32 scale per row"),
    )
}

_PLAIN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def get_row_format(name: str) -> RowFormat:
    """Look up a row format by name; raise ``ValueError`` listing the known ones."""
    try:
        return ROW_FORMATS[name]
    except KeyError:
        known = ", ".join(ROW_FORMATS)
        raise ValueError(f"unknown row format {name!r}; choose one of: {known}") from None


def row_bytes(name: str, head_dim: int) -> int:
    """Bytes one row of ``head_dim`` values takes in format ``name``."""
    return get_row_format(name).row_bytes(head_dim)


def _check_fp8_dim(head_dim: int) -> None:
    if head_dim % FP8_BLOCK:
        raise ValueError(
            f"fp8_e4m3_ue8m0 needs head_dim divisible by {FP8_BLOCK}, got {head_dim}"
        )


def ue8m0_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Per-block scale exponents ``e`` for block maxima ``amax``: the smallest power of two
    ``2**e`` with ``amax / 2**e <= 448``; ``-127`` (scale byte 0) for an all-zero block."""
    mantissa, exponent = torch.frexp(amax / FP8_MAX)  # amax/448 = m * 2**e, m in [0.5, 1)
    # ceil(log2(amax/448)): e, except e-1 when the ratio is an exact power of two.
    exp = exponent - (mantissa == 0.5).to(exponent.dtype)
    # byte 0 decodes to a scale of 0.0 (vLLM), so a non-zero block takes at least byte 1
    exp = exp.clamp(1 - UE8M0_BIAS, UE8M0_BIAS)
    return torch.where(amax > 0, exp, torch.full_like(exp, -UE8M0_BIAS))


def quantize_fp8_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float rows ``[n, d]`` to (fp8 values ``[n, d]``, ue8m0 scale bytes ``[n, d/32]``).

    Each block of 32 gets the smallest power-of-two scale with ``amax / scale <= 448``.
    """
    n, d = x.shape
    _check_fp8_dim(d)
    blocks = x.detach().to(torch.float32).reshape(n, d // FP8_BLOCK, FP8_BLOCK)
    exp = ue8m0_exponents(blocks.abs().amax(dim=-1))  # [n, d/32]
    scaled = torch.ldexp(blocks, (-exp).unsqueeze(-1).to(torch.float32))
    values = scaled.clamp(-FP8_MAX, FP8_MAX).reshape(n, d).to(torch.float8_e4m3fn)
    scales = (exp + UE8M0_BIAS).to(torch.uint8)
    return values, scales


def ue8m0_scales(scales: torch.Tensor) -> torch.Tensor:
    """ue8m0 scale bytes (uint8 or float8_e8m0fnu) -> float32 scales ``2**(byte - 127)``.

    Computed as vLLM does, by placing the byte in a float32's exponent field: byte 0 gives
    0.0 and byte 255 gives inf (neither occurs in a quantized tensor).
    """
    if scales.dtype != torch.uint8:
        scales = scales.view(torch.uint8)  # float8_e8m0fnu and uint8 share the bytes
    return (scales.to(torch.int32) << 23).view(torch.float32)


def dequantize_fp8_ue8m0(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """fp8 values ``[n, d]`` and ue8m0 scale bytes ``[n, d/32]`` -> float rows ``[n, d]``."""
    n, d = values.shape
    blocks = values.to(torch.float32).reshape(n, d // FP8_BLOCK, FP8_BLOCK)
    out = blocks * ue8m0_scales(scales).unsqueeze(-1)  # exact: a power-of-two scale
    return out.reshape(n, d).to(dtype)


def dequantize_fp8_blocks(
    weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A block-quantized fp8 matrix ``[out, in]`` with ue8m0 scales
    ``[ceil(out/bo), ceil(in/bi)]`` -> ``dtype`` ``[out, in]``:
    element ``(o, i) = fp8 * 2**(scales[o // bo, i // bi] - 127)``.
    """
    rows, cols = weight.shape
    bo, bi = block
    want = (-(-rows // bo), -(-cols // bi))
    if tuple(scales.shape) != want:
        raise ValueError(
            f"block scales for a [{rows}, {cols}] weight with {bo}x{bi} blocks must be "
            f"{list(want)}, got {list(scales.shape)}"
        )
    full = ue8m0_scales(scales).repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    return (weight.to(torch.float32) * full).to(dtype)


_FP8_TABLES: dict[torch.dtype, torch.Tensor] = {}
_FP8_TABLES_LOCK = threading.Lock()
_FP8_TABLE_BITS: dict[torch.dtype, tuple[torch.Tensor, np.ndarray]] = {}  # (the table, its bits)
_BITS = {2: (np.int16, torch.int16), 4: (np.int32, torch.int32), 8: (np.int64, torch.int64)}  # by element size


def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """Every decoded value: ``[65536]`` of ``dtype``, entry ``(scale byte << 8) | fp8 byte``.

    Built once per dtype by the reference ``dequantize_fp8_ue8m0`` itself, so a lookup is
    bit-for-bit what the reference computes (rounding, subnormals, inf and NaN included).
    """
    table = _FP8_TABLES.get(dtype)
    if table is None:
        with _FP8_TABLES_LOCK:
            table = _FP8_TABLES.get(dtype)
            if table is None:
                values = torch.arange(256, dtype=torch.uint8).repeat(256).view(256, 256)  # [scale, byte]
                scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 256 // FP8_BLOCK)
                table = dequantize_fp8_ue8m0(values.view(torch.float8_e4m3fn), scales, dtype).reshape(-1)
                _FP8_TABLES[dtype] = table
    return table


_NUMPY_OUT = {torch.float32: np.float32, torch.float16: np.float16}  # decoded dtypes NumPy has
_DECODED_BITS = {torch.float32: np.int32, torch.float16: np.int16, torch.bfloat16: np.int16}  # what the C helper writes


def _fp8_table_bits(dtype: torch.dtype) -> np.ndarray:
    """``_fp8_table(dtype)``'s values as plain integers, a NumPy view (made once per dtype)."""
    table = _fp8_table(dtype)
    cached = _FP8_TABLE_BITS.get(dtype)
    if cached is None or cached[0] is not table:
        cached = _FP8_TABLE_BITS[dtype] = (table, table.view(_BITS[table.element_size()][1]).numpy())
    return cached[1]


def _native_decode() -> Any:
    """The C decoder (``_rowdecode.decode_fp8``), or None (not built, or ``native_disabled``)."""
    if native_disabled():
        return None
    try:
        from . import _rowdecode  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _rowdecode.decode_fp8


ARITHMETIC_AUTO = 1
"""The C helper's float32 decode: vector arithmetic, the widest the CPU has (0 asks for
lookups only, 2 for AVX2 even where AVX-512 is there: its tests compare them)."""
STORES_AUTO = 0
"""The C helper's float32 stores: streaming (bypassing the caches) for a decode's output from
4 MiB on, which is not read again from them (1: always cached, 2: always streaming)."""


def fp8_decode_path(dtype: torch.dtype = torch.float32) -> str:
    """How a host decode of fp8 rows into ``dtype`` runs here, for benchmark records:
    "avx512" or "avx2" (the C helper's vector arithmetic, float32 only), "table" (its
    lookups) or "numpy" (no C helper)."""
    native = _native_decode()
    if native is None or dtype not in _DECODED_BITS:
        return "numpy"
    if dtype != torch.float32:
        return "table"
    from . import _rowdecode  # type: ignore[attr-defined]

    return str(_rowdecode.arithmetic_path(ARITHMETIC_AUTO))


def _decode_fp8(raw: torch.Tensor | np.ndarray, head_dim: int, dtype: torch.dtype, picks: np.ndarray | None = None,
                lead: tuple[int, ...] | None = None, picks_base: int = 0, native: Any = None,
                buffers: RecycledArrays | None = None, slots: np.ndarray | None = None) -> torch.Tensor:
    """fp8 rows by table lookup: one gather of ``(scale << 8) | value`` per element.

    Same values as ``dequantize_fp8_ue8m0`` (about 3x faster on a CPU: no float pow, no
    intermediate float32 tensors). NumPy on the CPU (single-threaded, so it leaves the
    cores to the model when it runs in a prefetch worker): the C helper ``_rowdecode`` (a
    256-entry slice of the table per 32-value block), else NumPy; torch elsewhere.
    ``picks``: decode the rows ``raw[picks - picks_base]`` (the C helper only; any shape and
    strides, read in C order); with ``slots``, position p is the raw row ``slots[p]`` (the C
    helper only). ``lead``: the result's
    leading dimensions (default ``[n]``). ``raw`` may be a NumPy array (host rows). ``native``:
    the C decoder as the caller found it (``_native_decode()``), looked up once per decode.
    ``buffers``: allocates the C decoder's result (default: a new array).
    """
    n = picks.size if picks is not None else raw.shape[0] if slots is None else slots.size
    shape = (*(lead or (n,)), head_dim)
    blocks = head_dim // FP8_BLOCK
    host = isinstance(raw, np.ndarray) or raw.device.type == "cpu"
    if host and native is not None and dtype in _DECODED_BITS:
        # NumPy buffers and no torch op on the way: each would let go of the GIL, a thread
        # switch when another thread waits for it
        out = (buffers.empty if buffers is not None else np.empty)(shape, _NUMPY_OUT.get(dtype, _DECODED_BITS[dtype]))
        raw_np = raw if isinstance(raw, np.ndarray) else raw.numpy()
        float32 = dtype == torch.float32
        native(raw_np, head_dim, _fp8_table_bits(dtype), out.reshape(n, head_dim), picks,
               ARITHMETIC_AUTO if float32 else 0, picks_base, STORES_AUTO if float32 else 1, slots)
        return torch.from_numpy(out) if dtype in _NUMPY_OUT else torch.from_numpy(out).view(dtype)
    assert picks is None and slots is None, "a decode with picks or slots goes through the C helper only"
    raw = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw
    table = _fp8_table(dtype)
    if raw.device.type != "cpu" or table.element_size() not in _BITS:
        values = raw[:, :head_dim].reshape(n, blocks, FP8_BLOCK).to(torch.int32)
        lut = (raw[:, head_dim:].to(torch.int32) << 8).unsqueeze(-1) | values  # [n, blocks, 32]
        return table.to(raw.device)[lut.reshape(n, head_dim)].view(shape)
    out_t = torch.empty(shape, dtype=dtype)
    _, bits = _BITS[table.element_size()]  # move the values' bits as plain integers
    a = raw.numpy()
    lut = np.left_shift(a[:, head_dim:], 8, dtype=np.uint16)[:, :, None]  # [n, blocks, 1]
    lut = np.bitwise_or(lut, a[:, :head_dim].reshape(n, blocks, FP8_BLOCK))  # [n, blocks, 32]
    np.take(table.view(bits).numpy(), lut.reshape(n, head_dim), out=out_t.view(bits).numpy().reshape(n, head_dim),
            mode="wrap")
    return out_t


def encode_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Float rows ``[n, d]`` -> raw bytes ``uint8 [n, row_bytes]`` in format ``fmt``."""
    get_row_format(fmt)
    if x.dim() != 2:
        raise ValueError(f"rows must be [n, head_dim], got shape {tuple(x.shape)}")
    n, d = x.shape
    if fmt in _PLAIN_DTYPES:
        return x.detach().to(_PLAIN_DTYPES[fmt]).contiguous().view(torch.uint8).reshape(n, -1)
    if fmt == "fp8_e4m3_ue8m0":
        values, scales = quantize_fp8_ue8m0(x)
        return torch.cat([values.view(torch.uint8), scales], dim=1)
    # int8 row-wise
    xf = x.detach().to(torch.float32)
    amax = xf.abs().amax(dim=1, keepdim=True)  # [n, 1]
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(xf / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)


def decode_rows(
    raw: torch.Tensor | np.ndarray, fmt: str, head_dim: int, dtype: torch.dtype = torch.float32, *,
    index: np.ndarray | None = None, index_base: int = 0, shape: tuple[int, ...] | None = None,
    buffers: RecycledArrays | None = None, slots: np.ndarray | None = None,
) -> torch.Tensor:
    """Raw bytes ``uint8 [n, row_bytes]`` -> float rows ``[n, head_dim]`` of ``dtype``.

    With ``index`` (int64 of any shape, k entries: positions in ``raw`` plus ``index_base``):
    the rows ``raw[index.reshape(-1) - index_base]``, ``[k, head_dim]``, gathered and decoded
    in one pass on the host (no gathered copy of the raw or decoded rows in between; the C
    decoder reads a strided index in place). ``slots`` (int64 ``[u]``): position p is the raw
    row ``raw[slots[p]]`` instead (rows a host cache left pinned in its arena: ``Lease.in_place``;
    without an index, the rows ``raw[slots]``). ``shape``: the result's leading dimensions
    instead of ``[n]`` (or ``[k]``), e.g. ``[T, C]``. ``raw`` may be a NumPy array (host rows).
    ``buffers``: where the C decoder's results are allocated (arrays used again once
    nobody holds them; see ``recycle``), instead of a new array each call.
    """
    rb = row_bytes(fmt, head_dim)
    ok_dtype = raw.dtype == np.uint8 if isinstance(raw, np.ndarray) else raw.dtype == torch.uint8
    if not ok_dtype or raw.ndim != 2 or raw.shape[1] != rb:
        raise ValueError(
            f"raw rows for {fmt} at head_dim {head_dim} must be uint8 [n, {rb}], "
            f"got {raw.dtype} {tuple(raw.shape)}"
        )
    if isinstance(raw, np.ndarray):
        raw = np.ascontiguousarray(raw)
    elif not raw.is_contiguous():
        raw = raw.contiguous()
    count = int(np.size(index)) if index is not None else raw.shape[0] if slots is None else int(np.size(slots))
    if shape is not None and math.prod(shape) != count:
        raise ValueError(f"shape {tuple(shape)} holds {math.prod(shape)} rows, not the {count} decoded")
    if fmt == "fp8_e4m3_ue8m0":
        native = _native_decode()
        if index is not None or slots is not None:
            host = isinstance(raw, np.ndarray) or raw.device.type == "cpu"
            if native is not None and host and dtype in _DECODED_BITS:
                index = None if index is None else np.asarray(index, np.int64)  # read in place, strides and all
                slots = None if slots is None else np.asarray(slots, np.int64)
            else:
                raw = _picked(torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw,
                              _positions(index, index_base, slots, raw.shape[0]))
                index, index_base, slots = None, 0, None
        return _decode_fp8(raw, head_dim, dtype, index, shape, index_base, native, buffers, slots)
    raw = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw
    if index is not None or slots is not None:
        raw = _picked(raw, _positions(index, index_base, slots, raw.shape[0]))
    if fmt in _PLAIN_DTYPES:
        rows = raw.view(_PLAIN_DTYPES[fmt]).to(dtype)
    else:  # int8 row-wise
        q = raw[:, :head_dim].contiguous().view(torch.int8).to(torch.float32)
        scale = raw[:, head_dim:].contiguous().view(torch.float32)  # [n, 1]
        rows = (q * scale).to(dtype)
    return rows if shape is None else rows.view(*shape, head_dim)


def _positions(index: np.ndarray | None, base: int, slots: np.ndarray | None, rows: int) -> np.ndarray:
    """``index`` (int64, any shape) less ``base``, as a flat contiguous array; with ``slots``,
    the slots at those positions (every slot without an index), each checked against the
    ``rows`` raw rows."""
    if index is not None:
        flat = np.ascontiguousarray(index, np.int64).reshape(-1)
        flat = flat - base if base else flat
        if slots is None:
            return flat
        slots = np.asarray(slots, np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= slots.size):
            bad = int(flat[(flat < 0) | (flat >= slots.size)][0]) + base
            raise IndexError(f"index {bad} is outside the {slots.size} slots")
        picked = slots[flat]
    else:
        assert slots is not None, "positions need an index or slots"
        picked = np.asarray(slots, np.int64).reshape(-1)
    if picked.size and (picked.min() < 0 or picked.max() >= rows):
        raise IndexError(f"slot {int(picked[(picked < 0) | (picked >= rows)][0])} is outside the {rows} raw rows")
    return picked


def _picked(raw: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """The rows ``raw[index]`` as a new contiguous tensor ``[k, row_bytes]``."""
    picked = torch.empty((index.size, raw.shape[1]), dtype=torch.uint8, device=raw.device)
    move_rows(raw, index, picked, None)
    return picked
