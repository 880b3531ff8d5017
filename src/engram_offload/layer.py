"""``EngramLayer``: fuse an Engram layer's rows into the hidden state (SPEC section 4).

Two variants share the row lookup and differ in the fusion:

- ``demo``: DeepSeek's ``engram_demo_v1.py`` module, with its state-dict names; returns
  the gated value plus its short convolution (the block adds it to the residual).
- ``v4.1``: DeepSeek-V4.1's layer: fp8 rows, ``wkv``, ``q_weight``/``k_weight``, dead-token
  masks; returns the new hidden state (the residual is inside).

Rows come from the layer's own in-memory table (``table=True``, the default), or are handed
in already gathered (``rows=``), which is how a store or prefetcher feeds the layer.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import EngramConfig
from .hashing import NgramHasher
from .rows import dequantize_fp8_ue8m0

__all__ = ["EngramLayer", "ShortConv", "signed_sqrt"]

GATE_CLAMP = 1e-6


def signed_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sign(x) * sqrt(max(|x|, 1e-6))``."""
    return x.abs().clamp_min(GATE_CLAMP).sqrt() * x.sign()


class ShortConv(nn.Module):
    """The demo's causal depthwise convolution over hyper-connection branches."""

    def __init__(self, hidden_size: int, kernel_size: int, dilation: int, hc_mult: int, norm_eps: float = 1e-5):
        super().__init__()
        channels = hidden_size * hc_mult
        self.kernel_size, self.dilation = kernel_size, dilation
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False,
                              padding=(kernel_size - 1) * dilation, dilation=dilation)
        self.norms = nn.ModuleList(nn.RMSNorm(hidden_size, eps=norm_eps) for _ in range(hc_mult))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, T, hc, D]
        b, t, hc, d = x.shape
        normed = torch.cat([self.norms[i](x[:, :, i]) for i in range(hc)], dim=-1)  # [B, T, hc*D]
        y = self.conv(normed.transpose(1, 2))[..., :t]  # [B, hc*D, T]
        return F.silu(y).transpose(1, 2).reshape(b, t, hc, d)


class _DemoEmbedding(nn.Module):
    """Holds the demo's ``multi_head_embedding`` names: a ``[rows, d]`` table plus head offsets."""

    def __init__(self, rows: int, head_dim: int, offsets: tuple[int, ...]):
        super().__init__()
        self.embedding = nn.Embedding(rows, head_dim)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.int64))


class _Fp8Embedding(nn.Module):
    """V4.1's ``embed``: float8_e4m3fn rows ``[rows, d]`` and ue8m0 scale bytes ``[rows, d/32]``."""

    def __init__(self, rows: int, head_dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, head_dim, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_inv", torch.full((rows, head_dim // 32), 127, dtype=torch.uint8))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        key = prefix + "weight_scale_inv"
        scale = state_dict.get(key)
        if scale is not None and scale.dtype != torch.uint8:
            state_dict[key] = scale.view(torch.uint8)  # float8_e8m0fnu and uint8 share the bytes
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize_fp8_ue8m0(self.weight[flat], self.weight_scale_inv[flat], dtype)
        return rows.reshape(*ids.shape, -1)


class EngramLayer(nn.Module):
    """One Engram layer of ``config`` at backbone layer ``layer_id``.

    ``token_map`` (from ``compress_tokenizer``) lets the layer hash ``input_ids`` itself.
    ``table=False`` builds the layer without its row table; rows must then be passed in.
    """

    def __init__(self, config: EngramConfig, layer_id: int, token_map: np.ndarray | torch.Tensor | None = None,
                 *, table: bool = True):
        super().__init__()
        config.head_sizes(layer_id)  # validates the layer id
        self.config, self.layer_id = config, layer_id
        self.layer_index = config.layer_ids.index(layer_id)
        self.hasher = NgramHasher(config, token_map) if token_map is not None else None
        cols, d, D, hc = config.cols_per_layer, config.head_dim, config.hidden_size, config.hc_mult
        rows = config.rows_per_layer[layer_id]
        self.has_table = table
        if config.variant == "demo":
            if table:
                self.multi_head_embedding = _DemoEmbedding(rows, d, config.head_offsets(layer_id))
            self.value_proj = nn.Linear(cols * d, D)
            self.key_projs = nn.ModuleList(nn.Linear(cols * d, D) for _ in range(hc))
            self.norm1 = nn.ModuleList(nn.RMSNorm(D) for _ in range(hc))
            self.norm2 = nn.ModuleList(nn.RMSNorm(D) for _ in range(hc))
            self.short_conv = ShortConv(D, config.kernel_size, config.max_ngram_size, hc)
        else:
            if table:
                self.embed = _Fp8Embedding(rows, d)
            self.wkv = nn.Linear(cols * d, (hc + 1) * D, bias=False)
            self.q_weight = nn.Parameter(torch.ones(hc, D))
            self.k_weight = nn.Parameter(torch.ones(hc, D))

    # ------------------------------------------------------------------ rows
    def row_ids(self, input_ids: torch.Tensor, dead_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T]`` raw ids -> ``[B, T, C]`` row ids, global within this layer."""
        if self.hasher is None:
            raise ValueError("this EngramLayer has no token map: pass token_map=..., or pass rows=")
        return self.hasher.hash_all(input_ids, dead_mask)[:, :, self.layer_index]

    def lookup(self, row_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Row ids ``[..., C]`` -> rows ``[..., C, d]`` from the layer's own table."""
        if not self.has_table:
            raise ValueError("this EngramLayer was built with table=False: pass rows= to forward")
        if self.config.variant == "demo":
            return self.multi_head_embedding.embedding(row_ids).to(dtype)
        return self.embed(row_ids, dtype)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        *,
        rows: torch.Tensor | None = None,
        dead_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states ``[B, T, hc, D]``; rows ``[B, T, C, d]`` (or ``[B, T, C*d]``) if given.

        Returns ``[B, T, hc, D]``: the Engram output (demo) or the new hidden state (V4.1).
        """
        b, t = hidden_states.shape[:2]
        if rows is None:
            if input_ids is None:
                raise ValueError("EngramLayer.forward needs input_ids or rows")
            rows = self.lookup(self.row_ids(input_ids, dead_mask), torch.float32)
        e = rows.reshape(b, t, -1)  # [B, T, C*d]
        expected = self.config.cols_per_layer * self.config.head_dim
        if e.shape[-1] != expected:
            raise ValueError(f"rows give {e.shape[-1]} values per position, the layer needs {expected}")
        if self.config.variant == "demo":
            return self._fuse_demo(hidden_states, e.to(self.value_proj.weight.dtype))
        return self._fuse_v41(hidden_states, e.to(self.wkv.weight.dtype), dead_mask)

    def _fuse_demo(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        # h: [B, T, hc, D]; e: [B, T, C*d]
        scale = math.sqrt(self.config.hidden_size)
        gates = []
        for i in range(self.config.hc_mult):
            key = self.norm1[i](self.key_projs[i](e))  # [B, T, D]
            query = self.norm2[i](h[:, :, i])  # [B, T, D]
            gate = (key * query).sum(dim=-1) / scale  # [B, T]
            gates.append(signed_sqrt(gate).sigmoid().unsqueeze(-1))
        value = torch.stack(gates, dim=2) * self.value_proj(e).unsqueeze(2)  # [B, T, hc, D]
        return value + self.short_conv(value)

    def _fuse_v41(self, h: torch.Tensor, e: torch.Tensor, dead_mask: torch.Tensor | None) -> torch.Tensor:
        # h: [B, T, hc, D]; e: [B, T, C*d]
        hc, dim, eps = self.config.hc_mult, self.config.hidden_size, self.config.rms_norm_eps
        kv = self.wkv(e).float()  # [B, T, (hc+1)*D]
        key = kv[..., : hc * dim].unflatten(-1, (hc, dim))  # [B, T, hc, D]
        value = kv[..., hc * dim:]  # [B, T, D]
        h32 = h.float()
        rstd = torch.rsqrt(h32.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)  # [B, T, hc]
        weight = (self.q_weight * self.k_weight).float()  # [hc, D]
        dot = (h32 * weight * key).sum(-1) * rstd / math.sqrt(dim)  # [B, T, hc]
        gate = signed_sqrt(dot).sigmoid()
        if dead_mask is not None:
            gate = gate.masked_fill(torch.as_tensor(dead_mask, dtype=torch.bool).unsqueeze(-1), 0.0)
        return (h32 + gate.unsqueeze(-1) * value.unsqueeze(2)).to(h.dtype)
