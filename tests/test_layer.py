import math

import numpy as np
import pytest
import torch

from engram_offload.config import EngramConfig
from engram_offload.layer import EngramLayer
from engram_offload.rows import encode_rows


def _demo_layer(demo_vectors) -> EngramLayer:
    meta = demo_vectors["meta"]
    config = EngramConfig.from_demo(**meta["config"])
    layer = EngramLayer(config, meta["engram_layer"], demo_vectors["lookup_table"])
    state = {k[len("state."):]: v for k, v in demo_vectors.items() if k.startswith("state.")}
    layer.load_state_dict(state, strict=True)
    return layer


def test_demo_layer_matches_vectors(demo_vectors):
    layer = _demo_layer(demo_vectors)
    with torch.no_grad():
        out = layer(demo_vectors["hidden_states"], demo_vectors["input_ids"])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, demo_vectors["output"], atol=1e-5, rtol=0)


def test_demo_layer_with_rows_handed_in(demo_vectors):
    layer = _demo_layer(demo_vectors)
    ids = layer.row_ids(demo_vectors["input_ids"])  # [B, T, C]
    rows = layer.multi_head_embedding.embedding.weight[ids]  # as a store would gather them
    with torch.no_grad():
        out = layer(demo_vectors["hidden_states"], rows=rows)
    torch.testing.assert_close(out, demo_vectors["output"], atol=1e-5, rtol=0)


def test_layer_without_table_needs_rows(demo_vectors):
    meta = demo_vectors["meta"]
    config = EngramConfig.from_demo(**meta["config"])
    layer = EngramLayer(config, 15, demo_vectors["lookup_table"], table=False)
    assert not any("embedding" in k for k in layer.state_dict())
    with pytest.raises(ValueError, match="table=False"):
        layer(demo_vectors["hidden_states"], demo_vectors["input_ids"])


V41 = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=(60, 60),
                   pad_id=0, hidden_size=16, hc_mult=2, variant="v4.1", row_format="fp8_e4m3_ue8m0",
                   rms_norm_eps=1e-6)


def _v41_layer(seed=0):
    g = torch.Generator().manual_seed(seed)
    token_map = np.arange(40) % 29
    layer = EngramLayer(V41, 3, token_map)
    rows = V41.rows_per_layer[3]
    raw = encode_rows(torch.randn(rows, 32, generator=g), "fp8_e4m3_ue8m0")
    state = {
        "embed.weight": raw[:, :32].contiguous().view(torch.float8_e4m3fn),
        "embed.weight_scale_inv": raw[:, 32:].contiguous().view(torch.float8_e8m0fnu),
        "wkv.weight": torch.randn(3 * 16, 4 * 32, generator=g) * 0.05,
        "q_weight": torch.randn(2, 16, generator=g),
        "k_weight": torch.randn(2, 16, generator=g),
    }
    layer.load_state_dict(state, strict=True)
    return layer, raw


def _v41_reference(layer, raw, h, ids, dead):
    """SPEC section 4, V4.1 variant, one position and branch at a time."""
    from engram_offload.rows import decode_rows

    cfg = layer.config
    row_ids = layer.hasher.hash_all(ids, dead)[:, :, 1]
    out = torch.empty_like(h)
    D, hc = cfg.hidden_size, cfg.hc_mult
    W = layer.wkv.weight.detach()
    for b in range(h.shape[0]):
        for t in range(h.shape[1]):
            e = decode_rows(raw[row_ids[b, t]], "fp8_e4m3_ue8m0", 32).reshape(-1)
            kv = W @ e
            v = kv[hc * D:]
            for i in range(hc):
                key = kv[i * D:(i + 1) * D]
                hi = h[b, t, i]
                dot = (hi * layer.q_weight[i] * layer.k_weight[i] * key).sum()
                dot = dot / math.sqrt((hi ** 2).mean() + cfg.rms_norm_eps) / math.sqrt((key ** 2).mean() + cfg.rms_norm_eps)
                dot = dot / math.sqrt(D)
                s = math.copysign(math.sqrt(max(abs(float(dot)), 1e-6)), float(dot))
                gate = 0.0 if dead[b, t] else 1 / (1 + math.exp(-s))
                out[b, t, i] = hi + gate * v
    return out


def test_v41_layer_matches_spec_reference():
    layer, raw = _v41_layer()
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 7, 2, 16, generator=g)
    ids = torch.randint(0, 40, (2, 7), generator=g)
    dead = torch.zeros(2, 7, dtype=torch.bool)
    dead[1, 3] = True
    with torch.no_grad():
        out = layer(h, ids, dead_mask=dead)
        ref = _v41_reference(layer, raw, h, ids, dead)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1, 3], h[1, 3])  # a dead position's gate is shut
    # bf16 hidden states come back in bf16
    assert layer(h.bfloat16(), ids).dtype == torch.bfloat16


def test_forward_argument_errors(demo_vectors):
    layer = _demo_layer(demo_vectors)
    h = demo_vectors["hidden_states"]
    with pytest.raises(ValueError, match="needs input_ids or rows"):
        layer(h)
    with pytest.raises(ValueError, match="the layer needs 1024"):
        layer(h, rows=torch.zeros(*h.shape[:2], 16, 32))
    no_map = EngramLayer(layer.config, 15)
    with pytest.raises(ValueError, match="no token map"):
        no_map(h, demo_vectors["input_ids"])
