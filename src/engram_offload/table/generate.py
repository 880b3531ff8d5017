"""Seeded random rows for benchmark tables: valid, finite values, generated as raw bytes.

The same (config, seed) always gives the same bytes. Generation is far faster than disk
writes, so writing a GiB table is I/O bound. ``make_random_checkpoint`` writes the same rows
as a checkpoint in the released DeepSeek-V4.1 layout (for ``index`` and ``convert``).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np

from ..atomic import atomic_path, write_json_atomic
from ..engram.config import EngramConfig
from ..engram.rows import FP8_BLOCK
from .progress import byte_progress
from .writer import write_table

__all__ = ["random_rows", "make_random_table", "make_random_checkpoint", "released_config"]

CHUNK_ROWS = 1 << 16


def random_rows(config: EngramConfig, seed: int = 0, chunk_rows: int = CHUNK_ROWS) -> Iterator[np.ndarray]:
    """Yield raw rows ``uint8 [k, row_bytes]`` in chunks, ``config.num_rows`` in all."""
    rng = np.random.default_rng(seed)
    d, fmt = config.head_dim, config.row_format
    for start in range(0, config.num_rows, chunk_rows):
        k = min(chunk_rows, config.num_rows - start)
        yield _chunk(rng, fmt, k, d)


def _chunk(rng: np.random.Generator, fmt: str, k: int, d: int) -> np.ndarray:
    if fmt == "fp8_e4m3_ue8m0":
        # fp8 e4m3fn byte = sign | 4-bit exponent | 3-bit mantissa. Clearing the top exponent
        # bit keeps |value| <= 1.875 and rules out NaN (0x7F/0xFF); scales 2**-7 .. 1.
        values = np.frombuffer(rng.bytes(k * d), np.uint8).reshape(k, d) & np.uint8(0xBF)
        scales = np.uint8(127) - (np.frombuffer(rng.bytes(k * d // FP8_BLOCK), np.uint8) & np.uint8(7))
        return np.concatenate([values, scales.reshape(k, d // FP8_BLOCK)], axis=1)
    if fmt == "int8":
        values = np.frombuffer(rng.bytes(k * d), np.uint8).reshape(k, d)
        scales = (rng.random(k, dtype=np.float32) * 1e-3 + 1e-4).astype("<f4")
        return np.concatenate([values, scales.view(np.uint8).reshape(k, 4)], axis=1)
    x = rng.standard_normal((k, d), dtype=np.float32) * np.float32(0.05)  # [k, d]
    if fmt == "fp32":
        return x.astype("<f4").view(np.uint8)
    if fmt == "fp16":
        return x.astype("<f2").view(np.uint8)
    if fmt == "bf16":  # round-to-nearest-even on the float32 bits
        bits = x.view(np.uint32)
        bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return bits.astype("<u2").view(np.uint8)
    raise ValueError(f"no random generator for row format {fmt!r}")


def make_random_table(
    path: str | os.PathLike[str],
    config: EngramConfig,
    seed: int = 0,
    *,
    progress: bool | None = None,
) -> Path:
    """Write a table of seeded random rows at ``config``'s layout."""
    return write_table(path, config, random_rows(config, seed), progress=progress)


def released_config(config: EngramConfig) -> dict[str, Any]:
    """``config`` as the released DeepSeek-V4.1 ``config.json`` nests it (fp8 rows)."""
    text = {"model_type": "deepseek_v41_text", "hidden_size": config.hidden_size, "hc_mult": config.hc_mult,
            "rms_norm_eps": config.rms_norm_eps, "engram_layer_ids": list(config.layer_ids),
            "engram_num_embeddings": [config.rows_per_layer[i] for i in config.layer_ids],
            "engram_vocab_size": list(config.prime_starts), "engram_n_heads": config.n_heads,
            "engram_head_dim": config.head_dim, "engram_max_ngram_size": config.max_ngram_size,
            "engram_pad_token_id": config.pad_id, "engram_compressed_vocab_size": config.compressed_vocab_size}
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "image_token_id": config.image_token_id, "text_config": text,
            "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}}


def make_random_checkpoint(directory: str | os.PathLike[str], config: EngramConfig, seed: int = 0, *,
                           progress: bool | None = None) -> EngramConfig:
    """Write ``random_rows(config, seed)`` (fp8 rows) as a checkpoint in the released layout: a shard
    per Engram layer (``layers.L.engram.q_weight``/``k_weight`` F32, then ``embed.weight`` F8_E4M3
    ``[rows, d]`` starting 4000 bytes into a page, so every 16th row straddles two, then
    ``embed.scale`` F8_E8M0 ``[rows, d/32]`` ending inside a page), the index, ``config.json``.
    Returns the config ``config.json`` reads back as."""
    if config.row_format != "fp8_e4m3_ue8m0":
        raise ValueError(f"a released checkpoint holds fp8_e4m3_ue8m0 rows, not {config.row_format}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    d, n = config.head_dim, len(config.layer_ids)
    rows = random_rows(config, seed)
    pending = np.empty((0, config.row_bytes), np.uint8)
    weight_map = {}
    with byte_progress(f"writing {folder.name}", config.num_rows * config.row_bytes, progress) as advance:
        for k, layer in enumerate(config.layer_ids):
            count, name = config.rows_per_layer[layer], f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            p = f"layers.{layer}.engram."
            small = np.zeros((config.hc_mult, config.hidden_size), "<f4")  # [hc, D]
            tensors = [(p + "q_weight", "F32", list(small.shape), small.nbytes),
                       (p + "k_weight", "F32", list(small.shape), small.nbytes),
                       (p + "embed.weight", "F8_E4M3", [count, d], count * d),
                       (p + "embed.scale", "F8_E8M0", [count, d // FP8_BLOCK], count * d // FP8_BLOCK)]
            scales = []
            with atomic_path(folder / name) as tmp, open(tmp, "wb") as f:
                _safetensors_header(f, tensors, weight_at=4000)
                f.write(small.tobytes() * 2)
                left = count
                while left:
                    if not len(pending):
                        pending = next(rows)
                    take, pending = pending[:left], pending[left:]
                    f.write(np.ascontiguousarray(take[:, :d]).tobytes())
                    scales.append(take[:, d:].copy())
                    left -= len(take)
                    advance(take.nbytes)
                f.write(np.concatenate(scales).tobytes())
            weight_map.update({t[0]: name for t in tensors})
    write_json_atomic(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    write_json_atomic(folder / "config.json", released_config(config))
    return EngramConfig.from_hf_config(folder / "config.json")


def _safetensors_header(f: BinaryIO, tensors: list[tuple[str, str, list[int], int]], weight_at: int) -> None:
    """Write a safetensors header for ``tensors`` (name, dtype, shape, bytes; stored in this order),
    padded with spaces so the third tensor starts ``weight_at`` bytes into a 4 KiB page."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, dtype, shape, nbytes in tensors:
        meta[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    body = json.dumps(meta).encode()
    before = 8 + len(body) + meta[tensors[2][0]]["data_offsets"][0]
    body += b" " * ((weight_at - before) % 4096)
    f.write(struct.pack("<Q", len(body)) + body)
