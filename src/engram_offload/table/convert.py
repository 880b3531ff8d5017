"""Converting a checkpoint's Engram embeddings (safetensors shards) into one table file.

Recognised tensors (``checkpoint.py`` has the names; the layer id follows ``layers.``):

- V4.1: ``layers.{L}.engram.embed.weight`` float8_e4m3fn ``[rows, d]`` with its ue8m0 scales
  ``[rows, d/32]``, stored as ``embed.scale`` (the released shards), ``embed.weight_scale_inv``
  or ``embed_tokens.weight_scale_inv`` (uint8 or float8_e8m0fnu bytes, or float powers of two).
- demo: ``...layers.{L}...multi_head_embedding.embedding.weight`` float ``[rows, d]``.

With ``model.safetensors.index.json`` only the shards holding these tensors are opened. Rows
are streamed in chunks through ``safe_open(...).get_slice``; for an fp8 table the value and
scale bytes are copied unchanged, so the table's raw rows equal the checkpoint's bytes.

What cannot be stored as it means is refused with the tensor and row named, before or while
writing (the table is written atomically, so nothing is left): scales beside a weight that is
not F8_E4M3, integer weights, NaN or infinite values (fp8 bytes 0x7F/0xFF), ue8m0 byte 0xFF,
and float scales that are not 0 or a power of two in [2^-126, 2^127].
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engram.checkpoint import (
    DEMO_EMBED_NAME,
    EMBED_SCALE_NAMES,
    EMBED_WEIGHT_NAMES,
    CheckpointIndex,
    missing_message,
    open_shard,
    pick,
)
from ..engram.config import EngramConfig
from ..engram.rows import UE8M0_BIAS, dequantize_fp8_ue8m0, encode_rows
from .writer import TableWriter

__all__ = ["convert_checkpoint", "find_engram_tensors", "EngramTensors"]

CHUNK_ROWS = 1 << 16


@dataclass
class EngramTensors:
    """Where one layer's embedding lives: shard, weight name, optional scale name."""

    layer_id: int
    shard: Path
    weight: str
    scale: str | None = None
    scale_shard: Path | None = None


def find_engram_tensors(checkpoint: str | os.PathLike[str]) -> dict[int, EngramTensors]:
    """Each Engram layer's embedding (and scale) tensors, from the index or the shard headers."""
    index = CheckpointIndex.open(checkpoint)
    found: dict[int, EngramTensors] = {}
    for layer, tensors in sorted(index.engram_layers().items()):
        v41, demo = pick(tensors, EMBED_WEIGHT_NAMES), tensors.get(DEMO_EMBED_NAME)
        if v41 and demo:
            raise ValueError(f"layer {layer} has two Engram embeddings: {v41} and {demo}")
        weight = v41 or demo
        scale = pick(tensors, EMBED_SCALE_NAMES)
        if weight is None:
            if scale is not None:
                raise ValueError(f"{scale} has no matching embed.weight in {index.root}")
            continue
        found[layer] = EngramTensors(layer, index.shard_of[weight], weight, scale,
                                     index.shard_of[scale] if scale else None)
    if not found:
        raise ValueError(
            f"no Engram embedding tensors in {index.root} (looked for '...layers.L.engram.embed.weight' "
            "and '...layers.L...multi_head_embedding.embedding.weight')"
        )
    return found


# safetensors dtype names of the embedding scales this reader takes (SPEC section 4)
_SCALE_DTYPES = ("F8_E8M0", "U8", "F64", "F32", "F16", "BF16")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def _check_dtypes(t: EngramTensors, weight_dtype: str, scale_dtype: str | None) -> None:
    """Refuse an embedding whose stored types cannot mean what the config says (before any row
    is written): scales beside a weight that is not e4m3, integer weights, odd scale types."""
    if scale_dtype is not None and weight_dtype != "F8_E4M3":
        raise ValueError(
            f"{t.weight} is {weight_dtype} but has ue8m0 scales {t.scale}: only a float8_e4m3fn (F8_E4M3) "
            "embedding takes scales, so its values would be read wrongly; re-export the checkpoint "
            "(the weight's type was changed or the scale belongs to another tensor)"
        )
    if weight_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{t.weight} is {weight_dtype}: an Engram embedding is float (F32, BF16, F16, ...) or "
                         "F8_E4M3 with ue8m0 scales; re-export the checkpoint")
    if scale_dtype is not None and scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"{t.scale} is {scale_dtype}: ue8m0 scales are F8_E8M0 or U8 bytes, or float powers "
                         "of two; re-export the checkpoint")


def _first_bad(bad: torch.Tensor) -> int:
    """The index of the first row of ``bad`` [k, ...] (bool) holding a True."""
    return int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0, 0])


def _scale_bytes(scale: torch.Tensor, name: str, start: int) -> torch.Tensor:
    """ue8m0 scales as stored (uint8, float8_e8m0fnu, or float powers of two) -> uint8 bytes
    ``[k, d/32]``; rows from ``start`` of the tensor ``name`` (for the messages).

    Byte 255 is NaN in ue8m0 and is refused; byte 0 is kept (it decodes to 0.0, as in vLLM).
    A float scale must be 0 or a power of two in [2^-126, 2^127] (bytes 0..254); an infinite,
    NaN, negative or out-of-range one is refused, never clamped."""
    if scale.dtype == torch.uint8 or scale.dtype == torch.float8_e8m0fnu:
        raw = scale.view(torch.uint8)
        if bool((raw == 0xFF).any()):
            row = start + _first_bad(raw == 0xFF)
            raise ValueError(f"{name} row {row:,} holds scale byte 0xFF (NaN in ue8m0): the checkpoint is "
                             "damaged; re-download or re-export it")
        return raw
    values = scale.to(torch.float64)
    exp = torch.log2(values)
    usable = (values == 0) | (torch.isfinite(exp) & (exp == exp.round()) & (exp >= 1 - UE8M0_BIAS)
                              & (exp <= UE8M0_BIAS))
    if not bool(usable.all()):
        row = start + _first_bad(~usable)
        value = float(values[row - start][~usable[row - start]][0])
        raise ValueError(f"{name} row {row:,} holds scale {value!r}: a ue8m0 scale is 0 or a power of two "
                         f"from 2^-126 to 2^127; re-export the checkpoint")
    return torch.where(values == 0, 0.0, exp + UE8M0_BIAS).to(torch.uint8)


def _check_finite(w: torch.Tensor, name: str, start: int) -> None:
    """Refuse NaN or infinite embedding values (fp8 e4m3 bytes 0x7F/0xFF are NaN)."""
    bad = (w.view(torch.uint8) & 0x7F) == 0x7F if w.dtype == torch.float8_e4m3fn else ~torch.isfinite(w.float())
    if bool(bad.any()):
        raise ValueError(f"{name} row {start + _first_bad(bad):,} holds a NaN or infinite value: the checkpoint "
                         "is damaged; re-download or re-export it")


def _raw_chunks(t: EngramTensors, config: EngramConfig, rows: int):
    """Yield a layer's rows, ``CHUNK_ROWS`` at a time, as raw bytes in ``config.row_format``."""
    d = config.head_dim
    with open_shard(t.shard) as f, ExitStack() as scales:
        weight = f.get_slice(t.weight)
        shape = list(weight.get_shape())
        if len(shape) != 2 or shape[1] != d:
            raise ValueError(f"{t.weight} has shape {shape}; expected [{rows}, {d}] (head_dim {d})")
        if shape[0] != rows:
            raise ValueError(
                f"{t.weight} has {shape[0]:,} rows, but the config derives {rows:,} rows for layer "
                f"{t.layer_id} from its primes: check the config (engram_vocab_size, n_heads, "
                "max_ngram_size) matches the checkpoint"
            )
        scale = None
        if t.scale:
            assert t.scale_shard is not None, "a scale tensor is found with its shard"
            scale = scales.enter_context(open_shard(t.scale_shard)).get_slice(t.scale)
        _check_dtypes(t, weight.get_dtype(), None if scale is None else scale.get_dtype())
        if scale is not None and list(scale.get_shape()) != [rows, d // 32]:
            raise ValueError(f"{t.scale} has shape {list(scale.get_shape())}; expected [{rows}, {d // 32}]")
        for start in range(0, rows, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, rows)
            w = weight[start:stop]  # [k, d]
            _check_finite(w, t.weight, start)
            if w.dtype == torch.float8_e4m3fn:
                if scale is None:
                    raise ValueError(f"{t.weight} is float8_e4m3fn but "
                                     + missing_message(EMBED_SCALE_NAMES, "ue8m0 scales", t.layer_id))
                s = _scale_bytes(scale[start:stop], t.scale or "", start)  # [k, d/32] uint8
                if config.row_format == "fp8_e4m3_ue8m0":
                    yield torch.cat([w.view(torch.uint8), s], dim=1)
                else:
                    yield encode_rows(dequantize_fp8_ue8m0(w, s), config.row_format)
            else:
                yield encode_rows(w.to(torch.float32), config.row_format)


def convert_checkpoint(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    config: EngramConfig,
    *,
    progress: bool | None = None,
) -> Path:
    """Write the Engram embeddings of ``checkpoint`` as one table at ``out`` (atomically)."""
    tensors = find_engram_tensors(checkpoint)
    extra = sorted(set(tensors) - set(config.layer_ids))
    missing = [i for i in config.layer_ids if i not in tensors]
    if missing or extra:
        raise ValueError(
            f"the checkpoint's Engram layers {sorted(tensors)} do not match the config's "
            f"{list(config.layer_ids)}"
        )
    with TableWriter(out, config, progress=progress) as writer:
        for layer in config.layer_ids:
            for chunk in _raw_chunks(tensors[layer], config, config.rows_per_layer[layer]):
                writer.write(chunk)
    return writer.path
