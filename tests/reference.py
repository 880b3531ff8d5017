"""Independent, position-by-position readings of the SPEC (the hash of section 3, the V4.1
layer of section 4 in float64), used as test oracles."""

from __future__ import annotations

import math

import numpy as np
import torch

from engram_offload.engram.config import EngramConfig


def reference_row_ids(config: EngramConfig, token_map: np.ndarray, ids: list[int],
                      dead: list[bool] | None = None) -> np.ndarray:
    """One sequence of raw ids -> int64 [T, L, C] global row ids, with Python integers."""
    vprime = int(max(token_map)) + 1
    pad = int(token_map[config.pad_id])
    comp = [int(token_map[t]) if t >= 0 else t for t in ids]
    dead = dead or [False] * len(ids)
    n = config.max_ngram_size
    out = np.zeros((len(ids), len(config.layer_ids), config.cols_per_layer), np.int64)
    for li, layer in enumerate(config.layer_ids):
        mult = [int(m) for m in config.multipliers(layer, vprime)]
        primes = config.primes[layer]
        offsets = config.head_offsets(layer)
        for p in range(len(ids)):
            c, reached = [], False
            for k in range(n):
                q = p - k
                reached = reached or (q >= 0 and dead[q])
                c.append(pad if q < 0 or reached else comp[q])
            col = 0
            for order in range(2, n + 1):
                mix = 0
                for k in range(order):
                    mix ^= c[k] * mult[k]
                for prime in primes[order - 2]:
                    out[p, li, col] = mix % prime + offsets[col]
                    col += 1
    return out


def fp8_e4m3_value(byte: int) -> float:
    """One float8_e4m3fn byte as a float, from its bits (sign, 4 exponent bits with bias 7,
    3 mantissa bits; exponent 0 is subnormal; 0x7F and 0xFF are NaN)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, mant = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and mant == 0x7:
        return math.nan
    if exp == 0:
        return sign * mant / 8 * 2.0**-6
    return sign * (1 + mant / 8) * 2.0 ** (exp - 7)


FP8_VALUES = np.array([fp8_e4m3_value(b) for b in range(256)], dtype=np.float64)


def ue8m0_value(byte: np.ndarray) -> np.ndarray:
    """ue8m0 bytes -> float64 scales ``2**(byte - 127)``."""
    return np.ldexp(1.0, byte.astype(np.int64) - 127)


def reference_v41_output(config: EngramConfig, token_map: np.ndarray, layer_id: int,
                         tensors: dict, hidden: np.ndarray, ids: np.ndarray,
                         dead: np.ndarray | None = None) -> np.ndarray:
    """SPEC section 4's V4.1 layer in float64, one position and branch at a time.

    ``tensors``: the layer's checkpoint tensors by their on-disk names within the Engram
    module (``embed.weight``, ``embed.scale``, ``wkv.weight``, ``wkv.scale``, ``q_weight``,
    ``k_weight``), torch tensors as saved. ``dead`` defaults to the image tokens.
    """
    def raw(name):
        return tensors[name].contiguous().view(torch.uint8).numpy()

    li = config.layer_ids.index(layer_id)
    hc, dim, d, eps = config.hc_mult, config.hidden_size, config.head_dim, config.rms_norm_eps
    table = FP8_VALUES[raw("embed.weight")] * np.repeat(ue8m0_value(raw("embed.scale")), 32, axis=1)
    w = raw("wkv.weight")
    block = ue8m0_value(raw("wkv.scale"))
    wkv = FP8_VALUES[w] * np.repeat(np.repeat(block, 32, 0)[: w.shape[0]], 32, 1)[:, : w.shape[1]]
    qk = tensors["q_weight"].double().numpy() * tensors["k_weight"].double().numpy()  # [hc, D]
    if dead is None:
        dead = ids == config.image_token_id if config.image_token_id is not None else np.zeros(ids.shape, bool)
    out = np.empty(hidden.shape, np.float64)
    for b in range(ids.shape[0]):
        row_ids = reference_row_ids(config, token_map, ids[b].tolist(), dead[b].tolist())[:, li]  # [T, C]
        for t in range(ids.shape[1]):
            e = np.concatenate([table[r] for r in row_ids[t]])  # [C*d]
            assert e.size == config.cols_per_layer * d
            kv = wkv @ e
            value = kv[hc * dim:]
            for i in range(hc):
                key, h = kv[i * dim:(i + 1) * dim], hidden[b, t, i].astype(np.float64)
                dot = float((h * qk[i] * key).sum())
                dot /= math.sqrt((h**2).mean() + eps) * math.sqrt((key**2).mean() + eps) * math.sqrt(dim)
                root = math.sqrt(max(abs(dot), 1e-6))
                gate = 0.0 if dead[b, t] else 1 / (1 + math.exp(root if dot < 0 else -root))
                out[b, t, i] = h + gate * value
    return out
