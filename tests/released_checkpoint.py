"""A tiny checkpoint written exactly in the released DeepSeek-V4.1 on-disk format.

- ``config.json`` nested as released: ``engram_*``, ``hidden_size``, ``hc_mult`` and
  ``rms_norm_eps`` under ``text_config``; ``quantization_config`` (fp8, 32x32 blocks, ue8m0)
  and ``image_token_id`` at the top level;
- three shards plus ``model.safetensors.index.json``; tensors named ``layers.{L}.engram.*``
  (bare, as released): ``embed.weight`` F8_E4M3 ``[rows, d]``, ``embed.scale`` F8_E8M0
  ``[rows, d/32]``, ``wkv.weight`` F8_E4M3 ``[(hc+1)*D, (N-1)*H*d]`` = ``[120, 256]`` (120 is
  not a multiple of 32) with ``wkv.scale`` F8_E8M0 ``[4, 8]``, ``q_weight``/``k_weight`` F32;
- non-Engram tensors around them (``embed.weight``, ``layers.L.attn_norm.weight``, ...);
  shard 1 holds layer 1's Engram tensors and one of layer 3's, shard 2 the rest of layer 3's,
  shard 3 none at all.

Values are random bytes (finite fp8, scale bytes near 127), so a reader that reinterprets,
reorders or rescales any of them gives other numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from engram_offload.engram.config import EngramConfig

LAYERS = (1, 3)
HIDDEN, HC, HEAD_DIM, N, HEADS = 40, 2, 64, 3, 2
VOCAB = 50
IMAGE_TOKEN = 47
TOKEN_MAP = np.array([i % 37 for i in range(VOCAB)], dtype=np.int64)  # 37 compressed ids
SHARDS = ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
          "model-00003-of-00003.safetensors")

TEXT_CONFIG = {
    "model_type": "deepseek_v41_text",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 4,
    "rms_norm_eps": 1e-20,
    "hc_mult": HC,
    "engram_layer_ids": list(LAYERS),
    "engram_max_ngram_size": N,
    "engram_vocab_size": 60,
    "engram_n_heads": HEADS,
    "engram_head_dim": HEAD_DIM,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": int(TOKEN_MAP.max()) + 1,
}
CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "image_token_id": IMAGE_TOKEN,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "weight_block_size": [32, 32], "scale_fmt": "ue8m0"},
    "text_config": TEXT_CONFIG,
}


@dataclass
class ReleasedCheckpoint:
    """The folder written, its layout, and every Engram tensor as saved (by full name)."""

    path: Path
    config: EngramConfig
    tensors: dict[str, torch.Tensor]
    token_map: np.ndarray = field(default_factory=TOKEN_MAP.copy)

    def engram(self, layer_id: int, name: str) -> torch.Tensor:
        return self.tensors[f"layers.{layer_id}.engram.{name}"]

    def raw_rows(self, layer_id: int) -> torch.Tensor:
        """The layer's rows as the table stores them: fp8 bytes then scale bytes, uint8."""
        return torch.cat([self.engram(layer_id, "embed.weight").view(torch.uint8),
                          self.engram(layer_id, "embed.scale").view(torch.uint8)], dim=1)


def _fp8(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random finite float8_e4m3fn bytes (0x7F and 0xFF are NaN)."""
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    raw = torch.where((raw & 0x7F) == 0x7F, raw - 1, raw)
    return raw.to(torch.uint8).view(torch.float8_e4m3fn)


def _e8m0(shape: tuple[int, ...], low: int, high: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=g, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)


def write_released_checkpoint(directory: Path, seed: int = 0) -> ReleasedCheckpoint:
    """Write the checkpoint into ``directory`` (created) and describe it."""
    g = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    config = EngramConfig.from_hf_config(CONFIG)
    rows_declared = [config.rows_per_layer[i] for i in LAYERS]
    released = {**CONFIG, "text_config": {**TEXT_CONFIG, "engram_num_embeddings": rows_declared}}
    (directory / "config.json").write_text(json.dumps(released, indent=2))
    cols = config.cols_per_layer * HEAD_DIM
    out = (HC + 1) * HIDDEN
    engram: dict[str, torch.Tensor] = {}
    for layer in LAYERS:
        rows = config.rows_per_layer[layer]
        p = f"layers.{layer}.engram."
        engram[p + "embed.weight"] = _fp8((rows, HEAD_DIM), g)
        engram[p + "embed.scale"] = _e8m0((rows, HEAD_DIM // 32), 118, 131, g)
        engram[p + "wkv.weight"] = _fp8((out, cols), g)
        engram[p + "wkv.scale"] = _e8m0((math.ceil(out / 32), math.ceil(cols / 32)), 112, 118, g)
        engram[p + "q_weight"] = torch.randn(HC, HIDDEN, generator=g)
        engram[p + "k_weight"] = torch.randn(HC, HIDDEN, generator=g)
    others = {
        "embed.weight": torch.randn(VOCAB, HIDDEN, generator=g).bfloat16(),
        "layers.1.attn_norm.weight": torch.ones(HIDDEN),
        "layers.3.ffn.gate.weight": torch.randn(4, HIDDEN, generator=g).bfloat16(),
        "layers.2.attn.wkv.weight": _fp8((64, HIDDEN), g),
        "norm.weight": torch.ones(HIDDEN),
        "head.weight": torch.randn(VOCAB, HIDDEN, generator=g).bfloat16(),
    }
    shard_of = {name: SHARDS[0] if name.startswith("layers.1.") else SHARDS[1] for name in engram}
    shard_of["layers.3.engram.q_weight"] = SHARDS[0]  # a layer's tensors may span shards
    shard_of.update({"embed.weight": SHARDS[0], "layers.1.attn_norm.weight": SHARDS[0],
                     "layers.3.ffn.gate.weight": SHARDS[1], "layers.2.attn.wkv.weight": SHARDS[2],
                     "norm.weight": SHARDS[2], "head.weight": SHARDS[2]})
    everything = {**engram, **others}
    for shard in SHARDS:
        save_file({k: v for k, v in everything.items() if shard_of[k] == shard}, str(directory / shard),
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in everything.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(shard_of.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return ReleasedCheckpoint(directory, config, engram)


def inputs(seed: int = 1, batch: int = 2, tokens: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states ``[B, T, hc, D]`` and token ids ``[B, T]`` with image-token spans."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, tokens, HC, HIDDEN, generator=g)
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=g)
    ids[ids == IMAGE_TOKEN] = 5
    ids[0, 3:5] = IMAGE_TOKEN
    ids[-1, -1] = IMAGE_TOKEN
    return h, ids


def write_tokenizer(path: Path) -> Path:
    """A word-level ``tokenizer.json`` whose compression is ``TOKEN_MAP`` (i % 37): 37 words, then
    upper-case spellings of the first 13, which the compression folds into them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {**{f"a{i}": i for i in range(37)}, **{f"A{i - 37}": i for i in range(37, VOCAB)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="a0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path))
    return path


def table_rows(checkpoint: ReleasedCheckpoint) -> np.ndarray:
    """Every Engram row of the checkpoint as its table holds them: ``uint8 [num_rows, row_bytes]``."""
    return torch.cat([checkpoint.raw_rows(i) for i in checkpoint.config.layer_ids]).numpy()


def write_indexed_checkpoint(directory: Path, seed: int = 0) -> tuple[ReleasedCheckpoint, np.ndarray]:
    """The checkpoint written and indexed (its sidecar beside the shards), and its table rows."""
    from engram_offload.table.checkpoint import index_checkpoint

    checkpoint = write_released_checkpoint(directory, seed)
    index_checkpoint(directory, checkpoint.config, progress=False)
    return checkpoint, table_rows(checkpoint)
