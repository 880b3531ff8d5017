"""``EngramBackbone``: a small real decoder-only transformer with Engram layers, for tests
and benchmarks of the prefetch path.

Blocks are pre-norm causal self-attention plus a SiLU MLP. Hidden states carry the Engram
hyper-connection branches, ``[B, T, hc, D]``; a block reads the mean of the branches and adds
its output to each. At an Engram layer id the block first applies its ``EngramLayer`` with rows
handed in from outside (a store, a prefetcher), as DeepSeek's demo places Engram inside the
block, before attention.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import EngramConfig
from .layer import EngramLayer

__all__ = ["Block", "EngramBackbone", "RowsFor"]

RowsFor = Callable[[int], torch.Tensor]  # layer_id -> rows [B, T, C, d]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP over ``[B, T, D]``."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.heads = heads
        self.norm1 = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, mlp_ratio * hidden, bias=False)
        self.down = nn.Linear(mlp_ratio * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D] -> the block's update [B, T, D]
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)  # [B, T, h, dh]
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        y = self.proj(a.transpose(1, 2).reshape(b, t, d))  # [B, T, D]
        return y + self.down(F.silu(self.up(self.norm2(x + y))))


class EngramBackbone(nn.Module):
    """``num_layers`` blocks of width ``config.hidden_size``; Engram at ``config.layer_ids``."""

    def __init__(self, config: EngramConfig, num_layers: int, vocab_size: int, heads: int = 4) -> None:
        super().__init__()
        missing = [i for i in config.layer_ids if i >= num_layers]
        if missing:
            raise ValueError(f"Engram layers {missing} are beyond the backbone's {num_layers} layers")
        self.config = config
        hidden = config.hidden_size
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(num_layers))
        self.engram = nn.ModuleDict({str(i): EngramLayer(config, i, table=False) for i in config.layer_ids})
        self.norm = nn.RMSNorm(hidden)

    @property
    def first_engram_layer(self) -> int:
        return min(self.config.layer_ids)

    def forward(self, input_ids: torch.Tensor, rows_for: RowsFor) -> torch.Tensor:
        """``input_ids [B, T]``; ``rows_for(layer_id) -> [B, T, C, d]``. Returns ``[B, T, D]``."""
        hc = self.config.hc_mult
        h = self.embed(input_ids).unsqueeze(2).expand(-1, -1, hc, -1).contiguous()  # [B, T, hc, D]
        for i, block in enumerate(self.blocks):
            engram = self.engram[str(i)] if str(i) in self.engram else None
            if engram is not None:
                out = engram(h, rows=rows_for(i))  # [B, T, hc, D]
                h = h + out if self.config.variant == "demo" else out
            h = h + block(h.mean(dim=2)).unsqueeze(2)
        return self.norm(h.mean(dim=2))
