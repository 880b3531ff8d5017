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

from ..engram.config import EngramConfig
from ..engram.layer import EngramLayer

__all__ = ["Block", "EngramBackbone", "RowsFor", "packed_causal_mask"]

RowsFor = Callable[[int], torch.Tensor]  # layer_id -> rows [B, T, C, d]


def packed_causal_mask(lengths: list[int]) -> torch.Tensor:
    """bool ``[T, T]`` for pieces of ``lengths`` packed back to back (T = their sum): each
    position attends to the earlier positions of its own piece only."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # [T]
    same = segment[:, None] == segment[None, :]
    return same & torch.ones_like(same).tril()


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

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        # x: [B, T, D] -> the block's update [B, T, D]; attn_mask: bool [T, T] (True = may attend)
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)  # [B, T, h, dh]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, h, T, dh]
        if attn_mask is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
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

    def forward(self, input_ids: torch.Tensor, rows_for: RowsFor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [B, T]``; ``rows_for(layer_id) -> [B, T, C, d]``. Returns ``[B, T, D]``.

        ``attn_mask`` (bool ``[T, T]``, True where a position may attend) replaces the causal
        mask, e.g. ``packed_causal_mask`` for several sequences' pieces packed into one row.
        """
        hc = self.config.hc_mult
        h = self.embed(input_ids).unsqueeze(2).expand(-1, -1, hc, -1).contiguous()  # [B, T, hc, D]
        for i, block in enumerate(self.blocks):
            engram = self.engram[str(i)] if str(i) in self.engram else None
            if engram is not None:
                out = engram(h, rows=rows_for(i))  # [B, T, hc, D]
                h = h + out if self.config.variant == "demo" else out
            h = h + block(h.mean(dim=2), attn_mask).unsqueeze(2)
        return self.norm(h.mean(dim=2))
