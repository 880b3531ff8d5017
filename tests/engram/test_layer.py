import json
import math

import numpy as np
import pytest
import torch

from engram_offload.engram.config import EngramConfig
from engram_offload.engram.layer import EngramLayer, signed_sqrt, ssqrt
from engram_offload.engram.rows import encode_rows


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
    with pytest.raises(ValueError, match=r"^this EngramLayer was built with table=False: pass rows= to forward$"):
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
    from engram_offload.engram.rows import decode_rows

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
    with pytest.raises(ValueError, match=r"^EngramLayer\.forward needs input_ids or rows$"):
        layer(h)
    with pytest.raises(ValueError, match=r"^rows give 512 values per position, the layer needs 1024$"):
        layer(h, rows=torch.zeros(*h.shape[:2], 16, 32))
    no_map = EngramLayer(layer.config, 15)
    with pytest.raises(ValueError, match=r"^this EngramLayer has no token map: pass token_map=\.\.\., or pass rows=$"):
        no_map(h, demo_vectors["input_ids"])


def test_v41_gate_at_exactly_zero_is_the_engines_ssqrt():
    layer, _ = _v41_layer()
    with torch.no_grad():
        layer.q_weight.zero_()  # every dot product is exactly 0
    g = torch.Generator().manual_seed(2)
    h, key = torch.randn(1, 3, 2, 16, generator=g), torch.randn(1, 3, 2, 16, generator=g)
    gate = layer.gate(h, key)
    # ssqrt(0) = +sqrt(1e-6) = 1e-3 (the demo's torch.sign would give sigmoid(0) = 0.5)
    assert torch.equal(gate, torch.full_like(gate, torch.tensor(1e-3).sigmoid().item()))
    assert torch.equal(ssqrt(torch.tensor([0.0, -0.0, -4.0, 1e-8])), torch.tensor([1e-3, 1e-3, -2.0, 1e-3]))
    assert signed_sqrt(torch.tensor(0.0)) == 0  # the demo variant keeps torch.sign


def test_v41_q_times_k_is_taken_in_float32_in_a_bf16_module():
    layer, _ = _v41_layer()
    layer = layer.bfloat16()
    with torch.no_grad():
        layer.q_weight.fill_(1 + 2**-7)  # exact in bf16; q*k = 1 + 2**-6 + 2**-14 is not
        layer.k_weight.fill_(1 + 2**-7)
    h = key = torch.ones(1, 1, 2, 16)
    with torch.no_grad():
        gate = layer.gate(h, key)
    # dot = sqrt(D) * q*k / (1 + eps), in float64 with the exact product
    dot = 4 * (1 + 2**-7) ** 2 / (1 + V41.rms_norm_eps)
    expected = 1 / (1 + math.exp(-math.sqrt(dot)))
    assert gate.dtype == torch.float32
    assert abs(float(gate[0, 0, 0]) - expected) < 1e-6  # a bf16 product would be 6e-6 off


def test_v41_state_dict_accepts_every_scale_spelling_and_names_the_missing_one():
    layer, raw = _v41_layer()
    state = {k: v for k, v in layer.state_dict().items()}
    assert {"embed.weight", "embed.scale", "wkv.weight", "q_weight", "k_weight"} <= set(state)
    for spelling in ("embed.scale", "embed.weight_scale_inv", "embed_tokens.weight_scale_inv"):
        other = EngramLayer(V41, 3, np.arange(40) % 29)
        renamed = {k: v for k, v in state.items() if k != "embed.scale"}
        renamed[spelling] = state["embed.scale"].view(torch.float8_e8m0fnu)
        if spelling.startswith("embed_tokens"):
            renamed["embed_tokens.weight"] = renamed.pop("embed.weight")
        other.load_state_dict(renamed, strict=True)
        assert torch.equal(other.embed.scale, raw[:, 32:])
    missing = {k: v for k, v in state.items() if k != "embed.scale"}
    with pytest.raises(RuntimeError, match=r"layer 3 has no embedding scales: tried layers\.3\.engram\.embed\.scale, "
                                           r"layers\.3\.engram\.embed\.weight_scale_inv, "
                                           r"layers\.3\.engram\.embed_tokens\.weight_scale_inv"):
        EngramLayer(V41, 3, np.arange(40) % 29).load_state_dict(missing, strict=True)


def test_v41_fp8_wkv_with_block_scales_loads_exactly():
    layer, _ = _v41_layer()
    g = torch.Generator().manual_seed(9)
    out_features, in_features = layer.wkv.weight.shape  # [48, 128]: 48 is not a multiple of 32
    fp8 = (torch.randn(out_features, in_features, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.randint(110, 130, (2, 4), generator=g, dtype=torch.int32).to(torch.uint8)
    state = layer.state_dict() | {"wkv.weight": fp8, "wkv.scale": scale.view(torch.float8_e8m0fnu)}
    layer.load_state_dict(state, strict=True)
    for o, i in [(0, 0), (31, 31), (32, 33), (47, 127), (40, 64)]:
        expected = float(fp8[o, i].float()) * 2.0 ** (int(scale[o // 32, i // 32]) - 127)
        assert float(layer.wkv.weight.detach()[o, i]) == expected
    with pytest.raises(RuntimeError, match=r"float8_e4m3fn but layer 3 has no block scales: tried layers\.3\.engram\.wkv\.scale"):
        layer.load_state_dict({k: v for k, v in state.items() if k != "wkv.scale"}, strict=True)


def test_v41_image_tokens_are_dead_by_default_and_an_explicit_mask_wins():
    config = V41.replace(image_token_id=39)
    layer = EngramLayer(config, 3, np.arange(40) % 29)
    layer.load_state_dict(_v41_layer()[0].state_dict(), strict=True)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(1, 6, 2, 16, generator=g)
    ids = torch.tensor([[4, 8, 39, 39, 15, 16]])
    dead = ids == 39
    with torch.no_grad():
        default = layer(h, ids)
        assert torch.equal(default, layer(h, ids, dead_mask=dead))
        assert torch.equal(default[dead], h[dead])
        live = layer(h, ids, dead_mask=torch.zeros_like(dead))  # the caller's mask is used as given
    assert not torch.equal(live[dead], h[dead])
    assert not torch.equal(live[0, 4:], default[0, 4:])  # lookbacks over the image tokens differ


def test_from_checkpoint_builds_the_demo_variant_from_demo_names(demo_vectors, tmp_path):
    from safetensors.torch import save_file

    meta = demo_vectors["meta"]
    demo = meta["config"]
    hf = {"engram_layer_ids": demo["layer_ids"], "engram_max_ngram_size": demo["max_ngram_size"],
          "engram_n_heads": demo["n_head_per_ngram"],
          "engram_head_dim": demo["n_embed_per_ngram"] // demo["n_head_per_ngram"],
          "engram_vocab_size": demo["engram_vocab_size"], "engram_pad_token_id": demo["pad_id"],
          "hidden_size": demo["hidden_size"], "hc_mult": demo["hc_mult"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    layer_id = meta["engram_layer"]
    state = {f"layers.{layer_id}.engram.{k[len('state.'):]}": v.contiguous()
             for k, v in demo_vectors.items() if k.startswith("state.")}
    save_file(state | {"layers.0.mlp.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    layer = EngramLayer.from_checkpoint(tmp_path, layer_id, token_map=demo_vectors["lookup_table"])
    assert layer.config.variant == "demo"
    with torch.no_grad():
        out = layer(demo_vectors["hidden_states"], demo_vectors["input_ids"])
    torch.testing.assert_close(out, demo_vectors["output"], atol=1e-5, rtol=0)
    with pytest.raises(KeyError, match=r"no Engram tensors for layer 2 .* Engram layers: \[15\]"):
        EngramLayer.from_checkpoint(tmp_path, 2)
    assert layer.config.row_format == "fp32"
    rows = layer.multi_head_embedding.embedding.weight[layer.row_ids(demo_vectors["input_ids"])]  # [B, T, C, d]
    bare = EngramLayer.from_checkpoint(tmp_path, layer_id, table=False)  # the embedding is left out
    assert bare.config.variant == "demo" and not hasattr(bare, "multi_head_embedding")
    without = tmp_path / "without_embedding"  # a demo checkpoint whose rows live elsewhere
    without.mkdir()
    (without / "config.json").write_text(json.dumps(hf))
    save_file({k: v for k, v in state.items() if "multi_head_embedding" not in k}, str(without / "model.safetensors"))
    for loaded in (bare, EngramLayer.from_checkpoint(without, layer_id, table=False)):
        assert loaded.config.variant == "demo" and loaded.config.row_format == "fp32"
        with torch.no_grad():
            out = loaded(demo_vectors["hidden_states"], rows=rows)
        torch.testing.assert_close(out, demo_vectors["output"], atol=1e-5, rtol=0)


def _v41_checkpoint(directory, state: dict, layer_id: int = 3):
    """A V4.1 checkpoint folder holding ``state`` as layer ``layer_id``'s Engram tensors."""
    from safetensors.torch import save_file

    directory.mkdir()
    hf = {"engram_layer_ids": list(V41.layer_ids), "engram_max_ngram_size": V41.max_ngram_size,
          "engram_n_heads": V41.n_heads, "engram_head_dim": V41.head_dim, "engram_vocab_size": list(V41.prime_starts),
          "engram_pad_token_id": V41.pad_id, "hidden_size": V41.hidden_size, "hc_mult": V41.hc_mult,
          "engram_row_format": V41.row_format, "rms_norm_eps": V41.rms_norm_eps}
    (directory / "config.json").write_text(json.dumps(hf))
    save_file({f"layers.{layer_id}.engram.{k}": v.contiguous() for k, v in state.items()},
              str(directory / "model.safetensors"))
    return directory


def test_from_checkpoint_takes_the_embed_tokens_spelling_and_refuses_a_missing_tensor(tmp_path):
    layer, raw = _v41_layer()
    state = {("embed_tokens.weight" if k == "embed.weight" else k): v for k, v in layer.state_dict().items()}
    state["embed_tokens.weight_scale_inv"] = state.pop("embed.scale").view(torch.float8_e8m0fnu)
    path = _v41_checkpoint(tmp_path / "tokens", state)
    g = torch.Generator().manual_seed(4)
    h, ids = torch.randn(1, 5, 2, 16, generator=g), torch.randint(0, 40, (1, 5), generator=g)
    with torch.no_grad():
        want = layer(h, ids)
        own = EngramLayer.from_checkpoint(path, 3, token_map=np.arange(40) % 29)
        assert torch.equal(own(h, ids), want)
        bare = EngramLayer.from_checkpoint(path, 3, table=False)  # the embed_tokens tensors are skipped
        assert not hasattr(bare, "embed")
        assert torch.equal(bare(h, rows=layer.lookup(layer.row_ids(ids))), want)
    lacking = _v41_checkpoint(tmp_path / "lacking", {k: v for k, v in state.items() if k != "k_weight"})
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "k_weight"'):
        EngramLayer.from_checkpoint(lacking, 3, table=False)


def test_loading_keeps_torchs_strict_checks():
    layer, _ = _v41_layer()
    state = layer.state_dict()
    fresh = lambda: EngramLayer(V41, 3, np.arange(40) % 29)  # noqa: E731
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "bogus"'):
        fresh().load_state_dict(state | {"bogus": torch.zeros(1)}, strict=True)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "q_weight"'):
        fresh().load_state_dict({k: v for k, v in state.items() if k != "q_weight"}, strict=True)
    with pytest.raises(RuntimeError, match=r"size mismatch for q_weight"):
        fresh().load_state_dict(state | {"q_weight": torch.zeros(3, 16)}, strict=True)
    # without strict, the projections load alone (the table's tensors reported missing) ...
    result = fresh().load_state_dict({k: v for k, v in state.items() if not k.startswith("embed.")}, strict=False)
    assert sorted(result.missing_keys) == ["embed.scale", "embed.weight"] and result.unexpected_keys == []
    # ... but row weights never load without their scales (torch hands the module strict=True)
    with pytest.raises(RuntimeError, match=r"layer 3 has no embedding scales"):
        fresh().load_state_dict({k: v for k, v in state.items() if k != "embed.scale"}, strict=False)


def test_a_fresh_v41_layer_holds_fp8_rows_and_byte_scales():
    state = EngramLayer(V41, 3).state_dict()
    rows = V41.rows_per_layer[3]
    assert state["embed.weight"].dtype == torch.float8_e4m3fn and state["embed.weight"].shape == (rows, 32)
    assert state["embed.scale"].dtype == torch.uint8 and state["embed.scale"].shape == (rows, 1)


def test_lookup_decodes_to_the_dtype_asked_for(demo_vectors):
    from engram_offload.engram.rows import decode_rows

    layer, raw = _v41_layer()
    ids = torch.tensor([[0, 5], [7, 7]])
    got = layer.lookup(ids, torch.bfloat16)  # [2, 2, d]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, decode_rows(raw[ids.reshape(-1)], "fp8_e4m3_ue8m0", 32, torch.bfloat16).view(2, 2, 32))
    demo = _demo_layer(demo_vectors)
    assert demo.lookup(ids, torch.bfloat16).dtype == torch.bfloat16


def test_a_bf16_layer_takes_float32_rows(demo_vectors):
    layer, _ = _v41_layer()
    g = torch.Generator().manual_seed(6)
    h, ids = torch.randn(1, 4, 2, 16, generator=g), torch.randint(0, 40, (1, 4), generator=g)
    rows = layer.lookup(layer.row_ids(ids))  # float32
    with torch.no_grad():
        want = layer(h, rows=rows)
        got = layer.bfloat16()(h.bfloat16(), rows=rows)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)
    demo = _demo_layer(demo_vectors).bfloat16()
    with torch.no_grad():
        out = demo(demo_vectors["hidden_states"].bfloat16(), demo_vectors["input_ids"])  # float32 rows from its table
    torch.testing.assert_close(out.float(), demo_vectors["output"], atol=0.1, rtol=0.1)


def test_the_gate_of_a_zero_hidden_state_or_key_is_finite():
    """rms norms add eps under the root: an all-zero branch (padding) gates at sigmoid(ssqrt(0))."""
    layer, _ = _v41_layer()
    g = torch.Generator().manual_seed(8)
    h, key = torch.randn(1, 2, 2, 16, generator=g), torch.randn(1, 2, 2, 16, generator=g)
    h[0, 0] = 0.0
    key[0, 1] = 0.0
    with torch.no_grad():
        gate = layer.gate(h, key)
    assert torch.isfinite(gate).all()
    assert torch.equal(gate[0, 0], torch.full((2,), torch.tensor(1e-3).sigmoid().item()))
    assert torch.equal(gate[0, 1], gate[0, 0])


def test_the_gate_takes_a_dead_mask_of_any_integer_or_bool_type():
    layer, _ = _v41_layer()
    g = torch.Generator().manual_seed(10)
    h, key = torch.randn(1, 3, 2, 16, generator=g), torch.randn(1, 3, 2, 16, generator=g)
    with torch.no_grad():
        want = layer.gate(h, key, torch.tensor([[False, True, False]]))
        assert torch.equal(layer.gate(h, key, torch.tensor([[0, 1, 0]])), want)
        assert torch.equal(layer.gate(h, key, [[0, 1, 0]]), want)
    assert (want[0, 1] == 0).all() and (want[0, 0] > 0).all()


def test_an_fp8_wkv_is_dequantized_to_the_modules_dtype():
    layer, _ = _v41_layer()
    g = torch.Generator().manual_seed(9)
    fp8 = (torch.randn(48, 128, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.full((2, 4), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2**0
    state = layer.state_dict() | {"wkv.weight": fp8, "wkv.scale": scale}
    bf16 = EngramLayer(V41, 3).bfloat16()
    bf16.load_state_dict(state, strict=True, assign=True)  # the state's tensors become the module's
    assert bf16.wkv.weight.dtype == torch.bfloat16 and torch.equal(bf16.wkv.weight, fp8.to(torch.bfloat16))
