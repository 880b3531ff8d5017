"""Save and load an ``EngramLM`` in the released DeepSeek-V4.1 on-disk format.

The folder holds a nested ``config.json`` (``engram_*``, ``hidden_size``, ``hc_mult``,
``rms_norm_eps`` under ``text_config``; the fp8 ``quantization_config`` at the top level), two
safetensors shards and ``model.safetensors.index.json``:

- ``model-00001-of-00002.safetensors``: the backbone under its own names (``embed.weight``,
  ``layers.{i}.block.*``, ``norm.weight``, ``head.weight``; matrices bf16, norms fp32) and
  ``vocab_ids`` (int64, the DeepSeek ids of the model's tokens);
- ``model-00002-of-00002.safetensors``: ``layers.{L}.engram.*`` as released: ``embed.weight``
  float8_e4m3fn ``[rows, d]`` with ue8m0 ``embed.scale`` ``[rows, d/32]``, ``wkv.weight``
  float8_e4m3fn with ue8m0 32x32 block scales ``wkv.scale``, ``q_weight``/``k_weight`` fp32.

``EngramLayer.from_checkpoint`` and ``convert`` read the Engram tensors unchanged.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ..atomic import atomic_path, write_json_atomic
from ..engram.checkpoint import INDEX_FILE, CheckpointIndex, engram_suffix
from ..engram.config import EngramConfig
from ..engram.rows import FP8_BLOCK, FP8_MAX, UE8M0_BIAS, quantize_fp8_ue8m0, ue8m0_exponents
from ..engram.tokenizer import cached_token_map
from .lm import EngramLM, ProbedEngramLayer

__all__ = ["save_model", "load_model", "shipped_model_dir", "twin_dir", "written_rows", "quantize_fp8_blocks", "model_config_json"]

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
TWIN_SHARD = "model.safetensors"  # the one shard of a twin without Engram
WRITTEN_ROWS = "written_rows.npy"  # which table rows a training n-gram wrote
DEEPSEEK_VOCAB = 129_280
FP8_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic",
                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "scale_fmt": "ue8m0"}


def shipped_model_dir() -> Path:
    """The small trained model shipped inside the package."""
    return Path(str(resources.files("engram_offload") / "data" / "model"))


def twin_dir(model_dir: str | os.PathLike[str]) -> Path:
    """Where a model's twin without Engram lies: the folder beside it, named ``NAME-no-engram``."""
    root = Path(model_dir).resolve()
    return root.parent / f"{root.name}-no-engram"


def written_rows(model_dir: str | os.PathLike[str]) -> np.ndarray | None:
    """Which table rows (flat, layers back to back) a training n-gram wrote, bool; None when the
    checkpoint does not say."""
    path = Path(model_dir) / WRITTEN_ROWS
    if not path.is_file():
        return None
    config = EngramConfig.from_hf_config(Path(model_dir) / "config.json")
    return np.unpackbits(np.load(path))[: config.num_rows].astype(bool)


def quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix ``[out, in]`` -> (float8_e4m3fn ``[out, in]``, ue8m0 scale bytes
    ``[ceil(out/32), ceil(in/32)]``): each 32x32 block gets the smallest power-of-two scale
    with ``amax / scale <= 448`` (the inverse of ``rows.dequantize_fp8_blocks``)."""
    rows, cols = weight.shape
    bo, bi = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = F.pad(weight.detach().float(), (0, bi * FP8_BLOCK - cols, 0, bo * FP8_BLOCK - rows))
    blocks = padded.reshape(bo, FP8_BLOCK, bi, FP8_BLOCK)  # [bo, 32, bi, 32]
    exp = ue8m0_exponents(blocks.abs().amax(dim=(1, 3)))  # [bo, bi]
    scaled = torch.ldexp(blocks, (-exp)[:, None, :, None].to(torch.float32))
    values = scaled.clamp(-FP8_MAX, FP8_MAX).reshape(bo * FP8_BLOCK, bi * FP8_BLOCK)[:rows, :cols]
    return values.contiguous().to(torch.float8_e4m3fn), (exp + UE8M0_BIAS).to(torch.uint8)


def model_config_json(model: EngramLM) -> dict[str, Any]:
    """The nested ``config.json`` of the model, as the released V4.1 checkpoints lay it out."""
    c = model.config
    text = {
        "model_type": "engram_lm_text",
        "vocab_size": model.hasher.vocab_size,
        "model_vocab_size": model.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.attention_heads,
        "rms_norm_eps": c.rms_norm_eps,
        "hc_mult": c.hc_mult,
        "engram_layer_ids": list(c.layer_ids),
        "engram_max_ngram_size": c.max_ngram_size,
        "engram_vocab_size": c.prime_starts[0],
        "engram_n_heads": c.n_heads,
        "engram_head_dim": c.head_dim,
        "engram_pad_token_id": c.pad_id,
        "engram_compressed_vocab_size": model.hasher.compressed_vocab_size,
        "engram_num_embeddings": [c.rows_per_layer[i] for i in c.layer_ids],
    }
    if not model.has_engram:
        text["engram_in_model"] = False  # the twin: the engram_* fields say what it was trained without
    return {"architectures": ["EngramLM"], "model_type": "engram_lm",
            "quantization_config": FP8_QUANTIZATION, "text_config": text}


def _backbone_tensors(model: EngramLM) -> dict[str, torch.Tensor]:
    """Non-Engram weights: matrices as bf16, vectors (norms) as fp32, ``vocab_ids`` int64."""
    out = {}
    for name, value in model.state_dict().items():
        if ".engram." in name:
            continue
        if value.dtype == torch.int64:
            out[name] = value.contiguous()
        else:
            out[name] = value.detach().to(torch.bfloat16 if value.dim() == 2 else torch.float32).contiguous()
    return out


def _engram_tensors(model: EngramLM, tables: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each Engram layer's tensors in the released names; ``tables`` are float rows ``[rows, d]``."""
    out = {}
    for i, layer in model.engram_layers().items():
        p = f"layers.{i}.engram."
        values, scales = quantize_fp8_ue8m0(tables[i])
        out[p + "embed.weight"] = values.contiguous()
        out[p + "embed.scale"] = scales.view(torch.float8_e8m0fnu).contiguous()
        wkv, wkv_scale = quantize_fp8_blocks(layer.wkv.weight)
        out[p + "wkv.weight"] = wkv
        out[p + "wkv.scale"] = wkv_scale.view(torch.float8_e8m0fnu).contiguous()
        out[p + "q_weight"] = layer.q_weight.detach().float().contiguous()
        out[p + "k_weight"] = layer.k_weight.detach().float().contiguous()
    return out


def save_model(model: EngramLM, tables: dict[int, torch.Tensor], directory: str | os.PathLike[str],
               extra: dict[str, Any] | None = None, written: torch.Tensor | None = None) -> Path:
    """Write ``model`` (with its float Engram ``tables``, per layer id) into ``directory``.

    Same model, same bytes. ``extra`` (JSON-able) is written to ``training.json``; ``written``
    (bool, one per table row, layers back to back) to ``written_rows.npy`` (bits packed). A
    twin without Engram is written as one shard, ``model.safetensors``, its config saying
    ``"engram_in_model": false``.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if model.has_engram:
        shards = dict(zip(SHARDS, (_backbone_tensors(model), _engram_tensors(model, tables))))
    else:
        shards = {TWIN_SHARD: _backbone_tensors(model)}
    weight_map: dict[str, str] = {}
    total = 0
    for shard, tensors in shards.items():
        with atomic_path(root / shard) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        weight_map.update((name, shard) for name in tensors)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json_atomic(root / INDEX_FILE, index)
    write_json_atomic(root / "config.json", model_config_json(model))
    if written is not None:
        with atomic_path(root / WRITTEN_ROWS) as tmp, open(tmp, "wb") as f:
            np.save(f, np.packbits(written.numpy().astype(bool)))
    if extra is not None:
        write_json_atomic(root / "training.json", extra, sort_keys=True)
    return root


def load_model(directory: str | os.PathLike[str] | None = None, *, table: bool = True,
               token_map: np.ndarray | None = None) -> EngramLM:
    """An ``EngramLM`` from a folder written by ``save_model`` (default: the shipped model).

    The Engram layers load through ``EngramLayer.from_checkpoint`` (``table=False`` leaves
    their rows to a store); the backbone's bf16 weights load into float32 (exact).
    """
    root = Path(directory) if directory is not None else shipped_model_dir()
    raw = json.loads((root / "config.json").read_text())
    text = raw.get("text_config", raw)
    config = EngramConfig.from_hf_config(raw)
    index = CheckpointIndex.open(root)
    names = [n for n in index.shard_of if engram_suffix(n) is None]
    state = index.read(names)
    if "vocab_ids" not in state:
        raise ValueError(f"{root} has no vocab_ids tensor: is it an EngramLM checkpoint?")
    if token_map is None:
        token_map = cached_token_map()
    engram = text.get("engram_in_model", True) is not False
    model = EngramLM(config, state["vocab_ids"], token_map, int(text["num_hidden_layers"]),
                     int(text["num_attention_heads"]), table=False, engram=engram)
    floats = {k: (v if v.dtype == torch.int64 else v.float()) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(floats, strict=False)
    missing = [k for k in missing if ".engram." not in k]
    if missing or unexpected:
        raise ValueError(f"{root} does not match the model: missing {missing}, unexpected {unexpected}")
    for i in config.layer_ids if engram else ():
        model.layers[i].engram = ProbedEngramLayer.from_checkpoint(root, i, table=table)
    return model.eval()
