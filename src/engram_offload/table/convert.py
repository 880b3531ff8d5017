"""Converting a checkpoint's Engram embeddings (safetensors shards) into one table file.

Recognised tensor names (the layer id is the number after ``layers.``):

- V4.1: ``model.layers.{L}.engram.embed.weight`` float8_e4m3fn ``[rows, d]`` with
  ``...engram.embed.weight_scale_inv`` ue8m0 ``[rows, d/32]`` (uint8 or float8_e8m0fnu
  bytes, or float32 powers of two).
- demo: ``...layers.{L}...multi_head_embedding.embedding.weight`` float ``[rows, d]``.

Shards are streamed: rows are read in chunks through ``safe_open(...).get_slice``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import EngramConfig
from ..rows import UE8M0_BIAS, dequantize_fp8_ue8m0, encode_rows
from .format import DEFAULT_BLOCK_SIZE
from .writer import TableWriter

__all__ = ["convert_checkpoint", "find_engram_tensors", "EngramTensors"]

CHUNK_ROWS = 1 << 16
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_V41 = re.compile(r"\.engram\.embed\.weight$")
_DEMO = re.compile(r"multi_head_embedding\.embedding\.weight$")


@dataclass
class EngramTensors:
    """Where one layer's embedding lives: shard, weight name, optional scale name."""

    layer_id: int
    shard: Path
    weight: str
    scale: str | None = None
    scale_shard: Path | None = None


def find_engram_tensors(checkpoint: str | os.PathLike[str]) -> dict[int, EngramTensors]:
    """Scan every ``*.safetensors`` shard's header for Engram embedding tensors, by layer."""
    from safetensors import safe_open

    root = Path(checkpoint)
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors shards in {root}")
    found: dict[int, EngramTensors] = {}
    scales: dict[int, tuple[Path, str]] = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                m = _LAYER.search(name)
                if not m:
                    continue
                layer = int(m.group(1))
                if name.endswith(".engram.embed.weight_scale_inv"):
                    scales[layer] = (shard, name)
                elif _V41.search(name) or _DEMO.search(name):
                    if layer in found:
                        raise ValueError(
                            f"layer {layer} has two Engram embeddings: {found[layer].weight} and {name}"
                        )
                    found[layer] = EngramTensors(layer, shard, name)
    for layer, (shard, name) in scales.items():
        if layer not in found:
            raise ValueError(f"{name} has no matching embed.weight in {root}")
        found[layer].scale, found[layer].scale_shard = name, shard
    if not found:
        raise ValueError(
            f"no Engram embedding tensors in {root} (looked for '...layers.L.engram.embed.weight' "
            "and '...layers.L...multi_head_embedding.embedding.weight')"
        )
    return found


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales as stored (uint8, float8_e8m0fnu, or float powers of two) -> uint8 bytes."""
    if scale.dtype == torch.uint8:
        return scale
    if str(scale.dtype) == "torch.float8_e8m0fnu":
        return scale.view(torch.uint8)
    if scale.is_floating_point():
        exp = torch.log2(scale.to(torch.float32))
        if not torch.equal(exp, exp.round()):
            raise ValueError("weight_scale_inv holds values that are not powers of two; not ue8m0")
        return (exp.round() + UE8M0_BIAS).clamp(0, 254).to(torch.uint8)
    raise ValueError(f"unsupported weight_scale_inv dtype {scale.dtype}")


def _raw_chunks(t: EngramTensors, config: EngramConfig, rows: int):
    """Yield a layer's rows, ``CHUNK_ROWS`` at a time, as raw bytes in ``config.row_format``."""
    from safetensors import safe_open

    d = config.head_dim
    with safe_open(t.shard, framework="pt") as f:
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
        scale_file = safe_open(t.scale_shard, framework="pt") if t.scale else None
        scale = scale_file.get_slice(t.scale) if scale_file is not None else None
        if scale is not None and list(scale.get_shape()) != [rows, d // 32]:
            raise ValueError(f"{t.scale} has shape {list(scale.get_shape())}; expected [{rows}, {d // 32}]")
        for start in range(0, rows, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, rows)
            w = weight[start:stop]  # [k, d]
            if w.dtype == torch.float8_e4m3fn:
                if scale is None:
                    raise ValueError(f"{t.weight} is float8_e4m3fn but has no weight_scale_inv tensor")
                s = _scale_bytes(scale[start:stop])  # [k, d/32] uint8
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
    block_size: int = DEFAULT_BLOCK_SIZE,
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
    with TableWriter(out, config, block_size=block_size, progress=progress) as writer:
        for layer in config.layer_ids:
            for chunk in _raw_chunks(tensors[layer], config, config.rows_per_layer[layer]):
                writer.write(chunk)
    return writer.path
