"""``EngramLayer``: fuse an Engram layer's rows into the hidden state (SPEC section 4).

Two variants share the row lookup and differ in the fusion:

- ``demo``: DeepSeek's ``engram_demo_v1.py`` module, with its state-dict names; returns
  the gated value plus its short convolution (the block adds it to the residual).
- ``v4.1``: DeepSeek-V4.1's layer: fp8 rows, ``wkv``, ``q_weight``/``k_weight``, dead-token
  masks; returns the new hidden state (the residual is inside). Its gate follows the
  serving engines: ``ssqrt`` (+1e-3 at exactly 0) and ``q_weight * k_weight`` in float32.

Rows come from the layer's own in-memory table (``table=True``, the default), or are handed
in already gathered (``rows=``), which is how a store or prefetcher feeds the layer.
``EngramLayer.from_checkpoint`` builds a layer from a checkpoint folder, reading only that
layer's Engram tensors.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import (
    DEMO_EMBED_NAME,
    EMBED_SCALE_NAMES,
    EMBED_WEIGHT_NAMES,
    WKV_SCALE_NAMES,
    CheckpointIndex,
    missing_message,
)
from .config import EngramConfig
from .hashing import NgramHasher
from .rows import dequantize_fp8_blocks, dequantize_fp8_ue8m0

__all__ = ["EngramLayer", "ShortConv", "signed_sqrt", "ssqrt"]

GATE_CLAMP = 1e-6


def signed_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The demo's ``sign(x) * sqrt(max(|x|, 1e-6))`` (``torch.sign(0) = 0``)."""
    return x.abs().clamp_min(GATE_CLAMP).sqrt() * x.sign()


def ssqrt(x: torch.Tensor) -> torch.Tensor:
    """The engines' V4.1 ``(x < 0 ? -1 : +1) * sqrt(max(|x|, 1e-6))``: +1e-3 at exactly 0."""
    root = x.abs().clamp_min(GATE_CLAMP).sqrt()
    return torch.where(x < 0, -root, root)


def _first_key(state: dict, prefix: str, names: tuple[str, ...]) -> str | None:
    """The first of ``prefix + name`` present in a state dict, or None."""
    return next((prefix + n for n in names if prefix + n in state), None)


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
    """V4.1's ``embed``: float8_e4m3fn rows ``[rows, d]`` and ue8m0 scale bytes ``[rows, d/32]``
    (the checkpoint's ``embed.weight`` and ``embed.scale``)."""

    weight: torch.Tensor  # registered buffers
    scale: torch.Tensor

    def __init__(self, rows: int, head_dim: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, head_dim, dtype=torch.float8_e4m3fn))
        self.register_buffer("scale", torch.full((rows, head_dim // 32), 127, dtype=torch.uint8))

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = dequantize_fp8_ue8m0(self.weight[flat], self.scale[flat], dtype)
        return rows.reshape(*ids.shape, -1)


class EngramLayer(nn.Module):
    """One Engram layer of ``config`` at backbone layer ``layer_id``.

    ``token_map`` (from ``compress_tokenizer``) lets the layer hash ``input_ids`` itself.
    ``table=False`` builds the layer without its row table; rows must then be passed in.

    V4.1 state dicts load under the checkpoint's own names (``checkpoint.py``): the row
    scales as ``embed.scale``, ``embed.weight_scale_inv`` or ``embed_tokens.weight_scale_inv``;
    ``wkv.weight`` either plain floats or float8_e4m3fn with ue8m0 block scales ``wkv.scale``
    (``[ceil(out/32), ceil(in/32)]``). An fp8 ``wkv`` is dequantized once, at load, into the
    module's float ``wkv.weight``, so the forward is a plain matmul: for V4.1-Flash
    (25,600 x 6,144) that is 629 MB per layer in float32 or 315 MB after ``.bfloat16()``
    (exact: every fp8 value times a power of two fits bf16), against 157 MB kept as fp8
    and dequantized on every call.
    """

    def __init__(self, config: EngramConfig, layer_id: int, token_map: np.ndarray | torch.Tensor | None = None,
                 *, table: bool = True):
        super().__init__()
        config.head_sizes(layer_id)  # validates the layer id
        self.config, self.layer_id = config, layer_id
        self.layer_index = config.layer_ids.index(layer_id)
        self.hasher = NgramHasher(config, token_map) if token_map is not None else None
        self._no_map_reason: str | None = None  # why from_checkpoint found no token map
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

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint_dir: str | os.PathLike[str],
        layer_id: int,
        *,
        table: bool = True,
        token_map: np.ndarray | torch.Tensor | None = None,
    ) -> "EngramLayer":
        """A ready layer from a checkpoint folder: ``config.json`` plus safetensors shards.

        Only the shards holding this layer's Engram tensors are opened (by
        ``model.safetensors.index.json`` when present) and only those tensors are read;
        ``table=False`` skips the embedding too (``[rows, d]``: 98 GB per V4.1-Flash layer)
        and leaves the rows to a store (``forward(hidden, rows=...)``). A layer whose
        tensors use the demo's names is built as the demo variant. Without ``token_map`` the
        layer hashes with the folder's ``tokenizer.json`` when it has one, else DeepSeek's
        packaged tokenizer (as ``engram-offload hash`` does); when that tokenizer does not fit
        the config (its compressed vocabulary size), the layer is built without one and says
        so when asked to hash.
        """
        root = Path(checkpoint_dir)
        config = EngramConfig.from_hf_config(root / "config.json")
        why_no_map = None
        if token_map is None:
            token_map, why_no_map = _default_token_map(root, config)
        index = CheckpointIndex.open(root)
        tensors = index.layer_tensors(layer_id)
        if DEMO_EMBED_NAME in tensors or any(k.startswith("value_proj.") for k in tensors):
            config = config.replace(variant="demo", row_format="fp32")
        embed = ("multi_head_embedding.",) if config.variant == "demo" else ("embed.", "embed_tokens.")
        wanted = {k: v for k, v in tensors.items() if table or not k.startswith(embed)}
        read = index.read(wanted.values())
        state = {k: read[name] for k, name in wanted.items()}
        with torch.device("meta"):  # no memory until the checkpoint's tensors are assigned
            layer = cls(config, layer_id, token_map, table=table)
        layer.load_state_dict(state, strict=True, assign=True)
        layer._no_map_reason = why_no_map
        return layer

    # ------------------------------------------------------------------ loading
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):  # type: ignore[override]
        if self.config.variant == "v4.1":
            self._adapt_v41_state(state_dict, prefix, strict, error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _adapt_v41_state(self, state: dict, prefix: str, strict: bool, error_msgs: list[str]) -> None:
        """Checkpoint spellings -> this module's names: scale aliases, fp8 ``wkv`` dequantized."""
        layer = self.layer_id
        weight = _first_key(state, prefix, EMBED_WEIGHT_NAMES)
        if weight is not None and weight != prefix + "embed.weight":
            state[prefix + "embed.weight"] = state.pop(weight)
        scale = _first_key(state, prefix, EMBED_SCALE_NAMES)
        if scale is not None:
            state[prefix + "embed.scale"] = state.pop(scale).view(torch.uint8)  # e8m0 bytes
        elif self.has_table and weight is not None and strict:
            error_msgs.append(missing_message(EMBED_SCALE_NAMES, "embedding scales", layer))
        wkv = state.get(prefix + "wkv.weight")
        wkv_scale = _first_key(state, prefix, WKV_SCALE_NAMES)
        if wkv is not None and wkv.dtype == torch.float8_e4m3fn:
            if wkv_scale is None:
                error_msgs.append("wkv.weight is float8_e4m3fn but "
                                  + missing_message(WKV_SCALE_NAMES, "block scales", layer))
                return
            state[prefix + "wkv.weight"] = dequantize_fp8_blocks(
                wkv, state.pop(wkv_scale), dtype=self.wkv.weight.dtype)

    # ------------------------------------------------------------------ rows
    def row_ids(self, input_ids: torch.Tensor, dead_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T]`` raw ids -> ``[B, T, C]`` row ids, global within this layer."""
        if self.hasher is None:
            raise ValueError(self._no_map_reason
                             or "this EngramLayer has no token map: pass token_map=..., or pass rows=")
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

        ``dead_mask`` ``[B, T]`` defaults to the config's image tokens in ``input_ids``.
        Returns ``[B, T, hc, D]``: the Engram output (demo) or the new hidden state (V4.1).
        """
        b, t = hidden_states.shape[:2]
        image = self.config.image_token_id
        if dead_mask is None and input_ids is not None and image is not None:
            dead_mask = torch.as_tensor(input_ids) == image  # [B, T]
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
        hc, dim = self.config.hc_mult, self.config.hidden_size
        kv = self.wkv(e).float()  # [B, T, (hc+1)*D]
        key = kv[..., : hc * dim].unflatten(-1, (hc, dim))  # [B, T, hc, D]
        value = kv[..., hc * dim:]  # [B, T, D]
        h32 = h.float()
        gate = self.gate(h32, key, dead_mask)  # [B, T, hc]
        return (h32 + gate.unsqueeze(-1) * value.unsqueeze(2)).to(h.dtype)

    def gate(self, h: torch.Tensor, key: torch.Tensor, dead_mask: torch.Tensor | None = None) -> torch.Tensor:
        """V4.1 branch gates: float32 h and keys ``[B, T, hc, D]`` -> ``[B, T, hc]`` (0 where dead)."""
        dim, eps = self.config.hidden_size, self.config.rms_norm_eps
        rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)  # [B, T, hc]
        weight = self.q_weight.float() * self.k_weight.float()  # [hc, D], float32 as the engines
        dot = (h * weight * key).sum(-1) * rstd / math.sqrt(dim)  # [B, T, hc]
        gate = ssqrt(dot).sigmoid()
        if dead_mask is not None:
            gate = gate.masked_fill(torch.as_tensor(dead_mask, dtype=torch.bool).unsqueeze(-1), 0.0)
        return gate


def _default_token_map(root: Path, config: EngramConfig) -> tuple[np.ndarray | None, str | None]:
    """The token map of ``root/tokenizer.json`` when present, else of DeepSeek's packaged
    tokenizer; (None, why) when it compresses to another vocabulary size than ``config``'s."""
    from .tokenizer import cached_token_map

    own = (root / "tokenizer.json").is_file()
    token_map = cached_token_map(root if own else None)
    compressed, declared = int(token_map.max()) + 1, config.compressed_vocab_size
    if declared is not None and declared != compressed:
        source = f"{root / 'tokenizer.json'}" if own else f"DeepSeek's tokenizer (no tokenizer.json in {root})"
        return None, (f"{source} compresses to {compressed:,} ids but the config declares "
                      f"engram_compressed_vocab_size {declared:,}: put the checkpoint's own tokenizer.json in "
                      "the folder, pass token_map=, or pass rows=")
    return token_map, None
