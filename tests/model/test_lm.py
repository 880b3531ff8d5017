"""EngramLM's construction: what it refuses, its defaults, its buffers and head."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engram_offload.engram.config import EngramConfig
from engram_offload.engram.tokenizer import cached_token_map
from engram_offload.model.lm import EngramLM


@pytest.fixture(scope="module")
def token_map() -> np.ndarray:
    return cached_token_map()


@pytest.fixture(scope="module")
def config(token_map) -> EngramConfig:
    return EngramConfig(layer_ids=(1,), max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=(211, 211),
                        pad_id=2, hidden_size=32, hc_mult=2, variant="v4.1", row_format="fp8_e4m3_ue8m0",
                        compressed_vocab_size=int(token_map.max()) + 1)


VOCAB = np.arange(3, 66, dtype=np.int32)  # int32 on purpose: the model keeps int64 ids


def test_another_variant_and_engram_layers_beyond_the_model_are_refused_in_one_line(config, token_map):
    with pytest.raises(ValueError) as caught:
        EngramLM(dataclasses.replace(config, variant="demo"), VOCAB, token_map, 2, 2)
    assert str(caught.value) == "EngramLM uses the v4.1 Engram variant, got 'demo'"
    with pytest.raises(ValueError) as caught:
        EngramLM(config, VOCAB, token_map, 1, 2)  # layer 1 of a one-layer model
    assert str(caught.value) == "Engram layers [1] are beyond the model's 1 layers"
    assert list(EngramLM(config, VOCAB, token_map, 2, 2).engram_layers()) == [1]  # layer 1 of two: its last


def test_by_default_the_engram_layers_hold_their_tables_and_table_false_leaves_them_out(config, token_map):
    full, bare = EngramLM(config, VOCAB, token_map, 2, 2), EngramLM(config, VOCAB, token_map, 2, 2, table=False)
    assert full.has_engram and list(full.engram_layers()) == [1]
    assert {"layers.1.engram.embed.weight", "layers.1.engram.embed.scale"} <= full.state_dict().keys()
    assert not any(".engram.embed." in key for key in bare.state_dict())
    assert list(bare.engram_layers()) == [1]


def test_ids_are_int64_the_id_map_is_not_saved_and_the_head_has_no_bias(config, token_map):
    model = EngramLM(config, VOCAB, token_map, 2, 2, table=False)
    assert model.vocab_ids.dtype == torch.int64 and torch.equal(model.vocab_ids, torch.arange(3, 66))
    assert model.vocab_size == 64 and model.model_id_of.dtype == torch.int64
    assert "vocab_ids" in model.state_dict() and "model_id_of" not in model.state_dict()  # rebuilt from vocab_ids
    assert torch.equal(model.to_model_ids(torch.tensor([[3, 65, 66, 0]])), torch.tensor([[1, 63, 0, 0]]))
    assert model.head.bias is None and model.head.weight.shape == (64, 32)


def test_gate_scales_go_to_every_layer_or_one_each_and_gates_need_a_forward(config, token_map):
    two = dataclasses.replace(config, layer_ids=(0, 1))
    torch.manual_seed(1)
    model = EngramLM(two, VOCAB, token_map, 2, 2)
    with pytest.raises(RuntimeError) as caught:
        model.gates()
    assert str(caught.value) == "Engram layer 0 has no gates yet: run a forward before reading gates()"
    model.set_gate_scale(0.5)
    assert [layer.gate_scale for layer in model.engram_layers().values()] == [0.5, 0.5]
    half = torch.tensor(0.25)
    model.set_gate_scale({1: half})  # a layer the dict leaves out is as trained
    assert [layer.gate_scale for layer in model.engram_layers().values()] == [None, half]
    ids = torch.tensor([[5, 9, 17, 40, 3, 9]])
    model.set_gate_scale(None)
    model(ids)
    trained = model.gates()
    assert sorted(trained) == [0, 1] and all(g.shape == (1, 6, 2) for g in trained.values())
    model.set_gate_scale({1: half})
    model(ids)
    scaled = model.gates()
    assert torch.equal(scaled[0], trained[0]) and torch.allclose(scaled[1], trained[1] * 0.25)
