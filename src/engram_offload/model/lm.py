"""``EngramLM``: a small decoder-only language model with V4.1-variant Engram layers.

The backbone is ``backbone.Block`` (pre-norm attention + SiLU MLP) over a reduced vocabulary
(the ``K`` most frequent DeepSeek tokens of the training text, id 0 for every other token).
Hidden states carry ``hc_mult`` hyper-connection branches ``[B, T, hc, D]``; a block reads
their mean and adds its update to each. At an Engram layer id, the layer's ``EngramLayer``
(V4.1: ``wkv``, ``q_weight``/``k_weight``, branch gates) runs first, before attention.

Engram rows are hashed from the raw DeepSeek ids (through the tokenizer compression) and
come from a ``RowsFor`` callback: the trainer's float tables, a ``TableStore``, or, by
default, each layer's own fp8 table (as loaded from a checkpoint).
"""

from __future__ import annotations

from typing import Callable, cast

import numpy as np
import torch
from torch import nn

from ..bench.backbone import Block
from ..engram.config import EngramConfig
from ..engram.hashing import NgramHasher
from ..engram.layer import EngramLayer

__all__ = ["EngramLM", "ProbedEngramLayer", "RowsFor", "UNKNOWN"]

# layer_id, layer-global row ids [B, T, C] -> rows [B, T, C, d]
RowsFor = Callable[[int, torch.Tensor], torch.Tensor]
UNKNOWN = 0  # the model id of every DeepSeek token outside the model's vocabulary


class ProbedEngramLayer(EngramLayer):
    """An ``EngramLayer`` whose gates can be recorded and scaled.

    ``gate_scale`` (None, a number, or a tensor broadcastable to ``[B, T, hc]``) multiplies the
    gate: 0 zeroes the layer's contribution (the output is the input hidden state). After a
    forward, ``last_gate`` holds the gates used, ``[B, T, hc]`` float32 (with their graph while training).
    """

    gate_scale: float | torch.Tensor | None = None
    last_gate: torch.Tensor | None = None

    def gate(self, h: torch.Tensor, key: torch.Tensor, dead_mask: torch.Tensor | None = None) -> torch.Tensor:
        g = super().gate(h, key, dead_mask)  # [B, T, hc]
        if self.gate_scale is not None:
            g = g * self.gate_scale
        self.last_gate = g if self.training and torch.is_grad_enabled() else g.detach()
        return g


class DecoderLayer(nn.Module):
    """One backbone layer: an optional Engram layer, then a ``Block``."""

    def __init__(self, block: Block, engram: ProbedEngramLayer | None) -> None:
        super().__init__()
        self.block = block
        self.engram = engram


class EngramLM(nn.Module):
    """``num_layers`` decoder layers of width ``config.hidden_size`` over ``vocab_ids``.

    ``vocab_ids`` int64 ``[K]``: the DeepSeek ids of model tokens ``1..K`` (0 is the rest).
    ``token_map``: the DeepSeek tokenizer's compression map, for the Engram hash.
    ``table=False`` builds the Engram layers without their fp8 tables (rows come from outside).
    ``engram=False`` builds the twin without Engram layers: the same backbone (the same initial
    weights under the same seed), no table; ``config`` then only names the layers it lacks.
    """

    vocab_ids: torch.Tensor  # buffer, int64 [K]
    model_id_of: torch.Tensor  # buffer, int64 [DeepSeek vocabulary]: model id of each DeepSeek id

    def __init__(self, config: EngramConfig, vocab_ids: torch.Tensor, token_map: np.ndarray,
                 num_layers: int, attention_heads: int, *, table: bool = True, engram: bool = True) -> None:
        super().__init__()
        if config.variant != "v4.1":
            raise ValueError(f"EngramLM uses the v4.1 Engram variant, got {config.variant!r}")
        beyond = [i for i in config.layer_ids if i >= num_layers]
        if beyond:
            raise ValueError(f"Engram layers {beyond} are beyond the model's {num_layers} layers")
        self.config = config
        self.hasher = NgramHasher(config, token_map)
        d = config.hidden_size
        vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.int64)
        self.vocab_size = int(vocab_ids.numel()) + 1
        self.register_buffer("vocab_ids", vocab_ids.clone())
        model_id = torch.full((self.hasher.vocab_size,), UNKNOWN, dtype=torch.int64)
        model_id[vocab_ids] = torch.arange(1, self.vocab_size)
        self.register_buffer("model_id_of", model_id, persistent=False)  # DeepSeek id -> model id
        # the backbone first, so that a model with Engram and its twin without start from the same weights
        self.embed = nn.Embedding(self.vocab_size, d)
        blocks = [Block(d, attention_heads) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, self.vocab_size, bias=False)
        self.layers = nn.ModuleList(
            DecoderLayer(block, ProbedEngramLayer(config, i, table=table) if engram and i in config.layer_ids else None)
            for i, block in enumerate(blocks)
        )
        self.has_engram = engram
        self.num_layers, self.attention_heads = num_layers, attention_heads

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers, typed (``nn.ModuleList`` items are plain ``Module``)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def engram_layers(self) -> dict[int, ProbedEngramLayer]:
        """The Engram layers by layer id (none for a twin without Engram)."""
        if not self.has_engram:
            return {}
        layers = self.decoder_layers()
        out: dict[int, ProbedEngramLayer] = {}
        for i in self.config.layer_ids:
            engram = layers[i].engram
            assert engram is not None, f"layer {i} is in config.layer_ids, so it has an Engram layer"
            out[i] = engram
        return out

    def to_model_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """DeepSeek ids ``[B, T]`` -> model ids ``[B, T]`` (0 for tokens outside the vocabulary)."""
        return self.model_id_of[input_ids]

    def row_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """DeepSeek ids ``[B, T]`` -> layer-global row ids ``[B, T, L, C]``."""
        return self.hasher.hash_all(input_ids)

    def forward(self, input_ids: torch.Tensor, rows_for: RowsFor | None = None,
                row_ids: torch.Tensor | None = None) -> torch.Tensor:
        """DeepSeek ids ``[B, T]`` -> logits ``[B, T, K+1]`` over the model vocabulary.

        ``rows_for`` defaults to each Engram layer's own table; ``row_ids`` (``[B, T, L, C]``)
        may be passed when already hashed.
        """
        if row_ids is None and self.has_engram:
            row_ids = self.row_ids(input_ids)
        hc = self.config.hc_mult
        h = self.embed(self.to_model_ids(input_ids)).unsqueeze(2).expand(-1, -1, hc, -1)  # [B, T, hc, D]
        for i, layer in enumerate(self.decoder_layers()):
            if layer.engram is not None:
                assert row_ids is not None
                ids = row_ids[:, :, self.config.layer_ids.index(i)]  # [B, T, C]
                rows = rows_for(i, ids) if rows_for is not None else layer.engram.lookup(ids)
                h = layer.engram(h, rows=rows)  # [B, T, hc, D]
            h = h + layer.block(h.mean(dim=2)).unsqueeze(2)
        return self.head(self.norm(h.mean(dim=2)))  # [B, T, K+1]

    def set_gate_scale(self, scale: float | torch.Tensor | dict[int, torch.Tensor] | None) -> None:
        """Scale every Engram layer's gate (0: contribution zeroed; None: as trained); a dict
        gives one value per layer id."""
        for i, engram in self.engram_layers().items():
            engram.gate_scale = scale.get(i) if isinstance(scale, dict) else scale

    def gates(self) -> dict[int, torch.Tensor]:
        """The gates of the last forward, per Engram layer id: ``[B, T, hc]``."""
        out: dict[int, torch.Tensor] = {}
        for i, e in self.engram_layers().items():
            if e.last_gate is None:
                raise RuntimeError(f"Engram layer {i} has no gates yet: run a forward before reading gates()")
            out[i] = e.last_gate
        return out
