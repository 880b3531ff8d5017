"""The row gathers: check arguments on the host, then run the Triton kernel or the reference.

A call runs the Triton kernel when any tensor it touches is on a CUDA device, or when
``TRITON_INTERPRET=1`` is set (Triton's interpreter then runs the same kernel on CPU tensors;
that is how the tests check it); otherwise CPU tensors go to the pure-torch reference.

Tables are packed rows ``uint8 [R, row_bytes]`` in one of the formats of
``engram_offload.engram.rows``; a table may live in device memory, in pinned host memory (read by
the GPU over UVA), or in ordinary host memory (reference only). Ids on the host are checked
before launch and an out-of-range id raises ``IndexError``; ids already on the device are not
checked (that would wait for the device): the row of an out-of-range device id is written as
zeros, as vLLM's lookup does, so validate device ids where they are made.

Without Triton, CUDA tensors take the same references on the device (``index_select`` and
the torch decode; out-of-range device ids give zero rows there too). On sm_89 and later
the fp8 rows decode through the hardware fp8 convert (``HW_FP8``), elsewhere (older GPUs,
ROCm, the interpreter) through integer operations; both are exact.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

from ..engram import rows
from ..engram.config import EngramConfig
from . import reference
from .sync import kernel_access

__all__ = ["gather_raw", "gather_rows", "dequant_rows", "tiered_gather", "runs_triton", "head_dim_of"]

BLOCK_R = 16  # rows per tile
MAX_BLOCK = 256  # columns per tile step
INTERPRETER_PROGRAMS = 4  # the persistent grid under TRITON_INTERPRET (each program costs ms there)
# Programs per SM on a GPU: one 4-warp program an SM keeps too few loads in flight for HBM
# (about 3 MB are needed); more fit where the kernel's registers allow. Tuned on hardware
# (benchmarks/gpu_smoke.py, bandwidth); 1 until measured.
PROGRAMS_PER_SM = 1

_FORMAT_CODES = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8_e4m3_ue8m0": 3, "int8": 4}
_ELEMENT_VIEW = {"fp32": torch.int32, "bf16": torch.int16, "fp16": torch.int16,
                 "fp8_e4m3_ue8m0": torch.uint8, "int8": torch.uint8}
_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OUT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.float16}
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


HW_FP8: bool | None = None  # None: the fp8 hardware convert where the device has it (sm_89+, CUDA)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _have_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def runs_triton(*tensors: torch.Tensor | None) -> bool:
    """Whether a call over ``tensors`` runs the Triton kernel (else the torch reference, on
    the tensors' device: the CPU, or a CUDA device without Triton installed)."""
    return _interpreting() or (_have_triton() and any(t is not None and t.is_cuda for t in tensors))


def _kernels() -> Any:
    try:
        from . import _triton_kernels
    except ImportError as exc:
        raise ImportError(
            "the GPU gathers need Triton: install it with `pip install 'engram-offload[gpu]'`"
        ) from exc
    return _triton_kernels


@functools.lru_cache(maxsize=None)
def _hw_fp8(device_index: int) -> bool:
    """Whether CUDA device ``device_index`` converts fp8 e4m3 in hardware (sm_89 and later, not ROCm)."""
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _use_hw_fp8(device: torch.device) -> bool:
    if HW_FP8 is not None:
        return HW_FP8
    if device.type != "cuda" or _interpreting():
        return False
    return _hw_fp8(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _grid(device: torch.device, rows_to_do: int, background: bool) -> int:
    """Persistent grid: ``PROGRAMS_PER_SM`` programs per SM (half as many in the background),
    never more than tiles."""
    if device.type == "cuda":
        programs = PROGRAMS_PER_SM * _sm_count(device.index if device.index is not None
                                               else torch.cuda.current_device())
    else:
        programs = INTERPRETER_PROGRAMS
    if background:
        programs = max(1, programs // 2)
    return max(1, min(programs, -(-rows_to_do // BLOCK_R)))


def _block(width: int) -> int:
    return min(MAX_BLOCK, 1 << max(0, (width - 1).bit_length()))


# ------------------------------------------------------------------ argument checks
def _format_of(config_or_format: EngramConfig | str) -> str:
    if isinstance(config_or_format, EngramConfig):
        return config_or_format.row_format
    rows.get_row_format(config_or_format)
    return config_or_format


def head_dim_of(fmt: str, row_bytes: int) -> int:
    """The ``head_dim`` whose rows take ``row_bytes`` bytes in format ``fmt``."""
    per_value = {"fp32": 4, "bf16": 2, "fp16": 2}
    if fmt in per_value:
        head_dim = row_bytes // per_value[fmt]
    elif fmt == "fp8_e4m3_ue8m0":
        head_dim = row_bytes * rows.FP8_BLOCK // (rows.FP8_BLOCK + 1)
    else:
        head_dim = row_bytes - 4
    try:
        fits = head_dim >= 1 and rows.row_bytes(fmt, head_dim) == row_bytes
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{row_bytes}-byte rows are not rows of format {fmt} at any head_dim")
    return head_dim


def _check_table(table: torch.Tensor, name: str) -> None:
    if table.dtype != torch.uint8 or table.dim() != 2 or (table.shape[1] > 1 and table.stride(1) != 1):
        raise ValueError(
            f"{name} must be packed rows uint8 [rows, row_bytes] with contiguous rows, "
            f"got {table.dtype} shape {tuple(table.shape)} strides {table.stride()}"
        )


def _check_ids(ids: torch.Tensor, num_rows: int, device: torch.device) -> torch.Tensor:
    """1-D integer ids, range-checked when on the host, moved to ``device``."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be a 1-D integer tensor, got {ids.dtype} shape {tuple(ids.shape)}")
    if ids.device.type == "cpu" and ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_rows:
            bad = low if low < 0 else high
            raise IndexError(f"row id {bad} is outside the table's {num_rows} rows [0, {num_rows})")
    if ids.dtype not in (torch.int64, torch.int32):
        ids = ids.to(torch.int64)
    if ids.device != device:
        ids = ids.to(device)  # host ids given to a device gather: a blocking copy (the fetch path uploads)
    return ids.contiguous()


def _check_slots(slot_of_row: torch.Tensor, capacity: int) -> None:
    """Slots of a host slot map must name a slot of the cache (or be -1); a device slot map is
    not read back (a slot beyond the cache reads as a miss in the kernel)."""
    if slot_of_row.device.type == "cpu" and slot_of_row.numel():
        high = int(slot_of_row.max())
        if high >= capacity:
            raise IndexError(f"slot {high} is outside the cache's {capacity} slots")


def _output(out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or (shape[1] > 1 and out.stride(1) != 1):
        raise ValueError(
            f"out must be {dtype} {list(shape)} with contiguous rows, "
            f"got {out.dtype} {list(out.shape)} strides {out.stride()}"
        )
    return out


def _device_of(*tensors: torch.Tensor) -> torch.device:
    """Where the kernel runs and the output lives: the first CUDA tensor's device, else the CPU."""
    for t in tensors:
        if t.is_cuda:
            return t.device
    return torch.device("cpu")


def _word_view(*tensors: torch.Tensor) -> torch.dtype:
    """The widest word that evenly divides every row width, row stride and base address."""
    for word in _WORDS:
        size = torch.empty(0, dtype=word).element_size()
        if all(t.shape[1] % size == 0 and t.stride(0) % size == 0 and t.data_ptr() % size == 0
               for t in tensors):
            return word
    return torch.uint8


def _on_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` where the torch reference on ``device`` can read it: a pinned host table seen
    through its UVA view (the fallback without Triton)."""
    if device.type != "cuda" or table.is_cuda:
        return table
    from ..buffers.hostmem import uva_view

    return uva_view(table, device)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.view(dtype)


# ------------------------------------------------------------------ launches
def _launch_words(table, ids, slot_of_row, cache, out, *, background: bool, by_position: bool = False) -> None:
    tiered = slot_of_row is not None
    word = _word_view(table, out, *([cache] if tiered else []))
    src, dst = _as(table, word), _as(out, word)
    store = _as(cache, word) if tiered else src
    width, n = dst.shape[1], ids.shape[0]
    kernels = _kernels()
    grid = _grid(out.device, n, background)
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext(), \
            kernel_access([table, ids, slot_of_row, cache], [out], "gather_words_kernel"):
        kernels.gather_words_kernel[(grid,)](
            src, ids, slot_of_row if tiered else ids, store, dst, n, table.shape[0], store.shape[0], width,
            src.stride(0), store.stride(0), dst.stride(0), grid,
            TIERED=tiered, BLOCK_R=BLOCK_R, BLOCK_W=_block(width), SLOT_BY_POS=by_position,
        )


def _launch_decode(table, ids, slot_of_row, cache, out, fmt: str, head_dim: int, *, background: bool,
                   by_position: bool = False) -> None:
    view = _ELEMENT_VIEW[fmt]
    src = _as(table, view)
    tiered = slot_of_row is not None
    store = _as(cache, view) if tiered else src
    dst = _as(out, _OUT_VIEW[out.dtype])
    n = out.shape[0]
    kernels = _kernels()
    grid = _grid(out.device, n, background)
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext(), \
            kernel_access([table, ids, slot_of_row, cache], [out], "gather_decode_kernel"):
        kernels.gather_decode_kernel[(grid,)](
            src, ids if ids is not None else src, slot_of_row if tiered else src, store, dst,
            n, table.shape[0], store.shape[0], head_dim, src.stride(0), store.stride(0), dst.stride(0), grid,
            FMT=_FORMAT_CODES[fmt], OUT=_OUT_CODES[out.dtype], INDEXED=ids is not None, TIERED=tiered,
            HW_FP8=fmt == "fp8_e4m3_ue8m0" and _use_hw_fp8(out.device), BLOCK_R=BLOCK_R, BLOCK_D=_block(head_dim),
            SLOT_BY_POS=by_position,
        )


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _OUT_CODES:
        raise ValueError(f"output dtype must be one of {list(_OUT_CODES)}, got {dtype}")


# ------------------------------------------------------------------ public gathers
def gather_raw(table: torch.Tensor, ids: torch.Tensor, *, out: torch.Tensor | None = None,
               background: bool = False) -> torch.Tensor:
    """Rows ``ids [n]`` of ``table uint8 [R, row_bytes]`` as they are stored -> ``uint8 [n, row_bytes]``.

    ``background`` halves the grid to leave SMs to work running beside the gather.
    """
    _check_table(table, "table")
    device = out.device if out is not None else _device_of(ids, table)
    ids = _check_ids(ids, table.shape[0], device)
    out = _output(out, (ids.shape[0], table.shape[1]), torch.uint8, device)
    if ids.shape[0] == 0:
        return out
    if not runs_triton(table, ids, out):
        return out.copy_(reference.gather_raw_ref(_on_device(table, device), ids, zero_bad=ids.is_cuda))
    _launch_words(table, ids, None, None, out, background=background)
    return out


def gather_rows(table: torch.Tensor, ids: torch.Tensor, config_or_format: EngramConfig | str, *,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                background: bool = False) -> torch.Tensor:
    """Rows ``ids [n]`` of ``table uint8 [R, row_bytes]`` dequantized -> ``[n, head_dim]`` of ``dtype``."""
    _check_table(table, "table")
    fmt = _format_of(config_or_format)
    head_dim = head_dim_of(fmt, table.shape[1])
    dtype = out.dtype if out is not None else dtype
    _check_dtype(dtype)
    device = out.device if out is not None else _device_of(ids, table)
    ids = _check_ids(ids, table.shape[0], device)
    out = _output(out, (ids.shape[0], head_dim), dtype, device)
    if ids.shape[0] == 0:
        return out
    if not runs_triton(table, ids, out):
        raw = reference.gather_raw_ref(_on_device(table, device), ids, zero_bad=ids.is_cuda)
        return out.copy_(reference.dequant_rows_ref(raw, fmt, head_dim, dtype))
    _launch_decode(table, ids, None, None, out, fmt, head_dim, background=background)
    return out


def dequant_rows(raw: torch.Tensor, config_or_format: EngramConfig | str, *, out: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16, background: bool = False) -> torch.Tensor:
    """Packed rows ``uint8 [n, row_bytes]`` -> values ``[n, head_dim]`` of ``dtype``."""
    _check_table(raw, "raw")
    fmt = _format_of(config_or_format)
    head_dim = head_dim_of(fmt, raw.shape[1])
    dtype = out.dtype if out is not None else dtype
    _check_dtype(dtype)
    out = _output(out, (raw.shape[0], head_dim), dtype, out.device if out is not None else raw.device)
    if raw.shape[0] == 0:
        return out
    if not runs_triton(raw, out):
        return out.copy_(reference.dequant_rows_ref(raw, fmt, head_dim, dtype))
    _launch_decode(raw, None, None, None, out, fmt, head_dim, background=background)
    return out


def tiered_gather(host_table: torch.Tensor, hbm_slots: torch.Tensor, slot_of_row: torch.Tensor,
                  ids: torch.Tensor, out: torch.Tensor, *, config_or_format: EngramConfig | str | None = None,
                  background: bool = False, slots_by_position: bool = False) -> torch.Tensor:
    """Rows ``ids [n]`` in one launch: from ``hbm_slots[slot_of_row[id]]`` where that slot is >= 0
    (an HBM hit), else from ``host_table[id]`` (pinned host memory over UVA).

    ``slots_by_position``: ``slot_of_row`` is ``[n]``, the slot (or -1) of each position ``i``
    (a step's slots, known on the host), instead of a map over every table row.
    ``out`` is ``uint8 [n, row_bytes]`` for the raw rows, or ``[n, head_dim]`` float32, bfloat16
    or float16 for dequantized rows (then ``config_or_format`` names the row format).
    """
    _check_table(host_table, "host_table")
    _check_table(hbm_slots, "hbm_slots")
    if hbm_slots.shape[1] != host_table.shape[1]:
        raise ValueError(f"hbm_slots rows are {hbm_slots.shape[1]} bytes, the table's {host_table.shape[1]}")
    map_rows = ids.shape[0] if slots_by_position else host_table.shape[0]
    if slot_of_row.dim() != 1 or slot_of_row.shape[0] != map_rows or slot_of_row.dtype not in (torch.int32, torch.int64):
        what = "one slot or -1 per id" if slots_by_position else "one slot or -1 per table row"
        raise ValueError(f"slot_of_row must be int32 or int64 [{map_rows}] ({what}), "
                         f"got {slot_of_row.dtype} {tuple(slot_of_row.shape)}")
    _check_slots(slot_of_row, hbm_slots.shape[0])
    ids = _check_ids(ids, host_table.shape[0], out.device)
    raw = out.dtype == torch.uint8
    if raw:
        _output(out, (ids.shape[0], host_table.shape[1]), torch.uint8, out.device)
    else:
        if config_or_format is None:
            raise ValueError("a dequantizing tiered_gather needs config_or_format (the row format)")
        fmt = _format_of(config_or_format)
        head_dim = head_dim_of(fmt, host_table.shape[1])
        _check_dtype(out.dtype)
        _output(out, (ids.shape[0], head_dim), out.dtype, out.device)
    if ids.shape[0] == 0:
        return out
    if not runs_triton(host_table, hbm_slots, slot_of_row, ids, out):
        gathered = reference.tiered_gather_ref(_on_device(host_table, out.device), hbm_slots, slot_of_row, ids,
                                               slots_by_position=slots_by_position)
        return out.copy_(gathered if raw else reference.dequant_rows_ref(gathered, fmt, head_dim, out.dtype))
    if raw:
        _launch_words(host_table, ids, slot_of_row, hbm_slots, out, background=background,
                      by_position=slots_by_position)
    else:
        _launch_decode(host_table, ids, slot_of_row, hbm_slots, out, fmt, head_dim, background=background,
                       by_position=slots_by_position)
    return out
