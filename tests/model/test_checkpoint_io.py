"""The shipped model is in the released DeepSeek-V4.1 on-disk format, and loads unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from engram_offload.engram.checkpoint import CheckpointIndex
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.layer import EngramLayer
from engram_offload.engram.rows import dequantize_fp8_blocks, dequantize_fp8_ue8m0
from engram_offload.model.checkpoint_io import quantize_fp8_blocks, twin_dir
from engram_offload.serving.store import open_table
from engram_offload.table.convert import convert_checkpoint


def test_quantize_fp8_blocks_inverts_dequantize():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 45, generator=g) * torch.logspace(-3, 2, 45)  # blocks of very different scales
    values, scales = quantize_fp8_blocks(w)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (70, 45)
    assert scales.dtype == torch.uint8 and scales.shape == (3, 2)  # ceil(70/32), ceil(45/32)
    back = dequantize_fp8_blocks(values, scales)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for values in the normal range
    big = w.abs() > w.abs().amax() * 2**-6
    assert ((back - w).abs() <= w.abs() * 2**-4 + 1e-12)[big].all()
    assert torch.equal(quantize_fp8_blocks(back)[0].view(torch.uint8), values.view(torch.uint8))  # exact fixpoint


def test_quantize_fp8_blocks_zero_block_gets_smallest_scale():
    w = torch.zeros(32, 64)
    w[:, 32:] = 1.0
    values, scales = quantize_fp8_blocks(w)
    assert scales[0, 0] == 0 and scales[0, 1] > 0
    assert torch.equal(dequantize_fp8_blocks(values, scales), w)


def test_shipped_model_is_in_the_released_layout(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    text = config["text_config"]
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    assert "engram_layer_ids" not in config and text["hc_mult"] > 1
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 2
    twin = twin_dir(model_dir)
    size = sum(f.stat().st_size for folder in (model_dir, twin) for f in folder.iterdir())
    assert size < 20e6  # the model and its twin without Engram, shipped together
    assert json.loads((twin / "config.json").read_text())["text_config"]["engram_in_model"] is False
    assert (model_dir / "seen_ngrams.npy").is_file() and (model_dir / "written_rows.npy").is_file()
    dtypes = {}
    for shard in shards:
        with safe_open(str(model_dir / shard), "pt") as f:
            dtypes.update((k, f.get_slice(k).get_dtype()) for k in f.keys())
    assert set(dtypes) == set(index["weight_map"])
    for layer in text["engram_layer_ids"]:
        p = f"layers.{layer}.engram."
        assert dtypes[p + "embed.weight"] == "F8_E4M3" and dtypes[p + "embed.scale"] == "F8_E8M0"
        assert dtypes[p + "wkv.weight"] == "F8_E4M3" and dtypes[p + "wkv.scale"] == "F8_E8M0"
        assert dtypes[p + "q_weight"] == "F32"
    assert dtypes["embed.weight"] == "BF16" and dtypes["head.weight"] == "BF16"


def test_engram_layer_from_checkpoint_and_convert_read_it_unchanged(model_dir, tmp_path):
    config = EngramConfig.from_hf_config(model_dir)
    index = CheckpointIndex.open(model_dir)
    table = convert_checkpoint(model_dir, tmp_path / "model.engram", config, progress=False)
    with open_table(table, "memory") as store:
        for layer in config.layer_ids:
            tensors = index.read([f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"])
            weight, scale = tensors.values()
            plain = EngramLayer.from_checkpoint(model_dir, layer)
            assert plain.config.variant == "v4.1"
            assert torch.equal(plain.embed.weight.view(torch.uint8), weight.view(torch.uint8))
            assert torch.equal(plain.embed.scale, scale.view(torch.uint8))
            base = config.layer_row_base(layer)
            ids = torch.arange(0, config.rows_per_layer[layer], 997)
            raw = store.read_raw((ids + base).numpy())
            assert torch.equal(raw, torch.cat([weight.view(torch.uint8), scale.view(torch.uint8)], 1)[ids])
            assert torch.equal(store.gather((ids + base).numpy()), dequantize_fp8_ue8m0(weight[ids], scale[ids]))


@pytest.mark.parametrize("table", [True, False])
def test_load_model_rebuilds_every_weight(model_dir, table):
    from engram_offload.model.checkpoint_io import load_model

    model = load_model(model_dir, table=table)
    config = EngramConfig.from_hf_config(model_dir)
    assert sorted(model.engram_layers()) == list(config.layer_ids)
    with safe_open(str(model_dir / "model-00001-of-00002.safetensors"), "pt") as f:
        head = f.get_tensor("head.weight")
    assert torch.equal(model.head.weight.detach(), head.float())
    assert all(e.has_table == table for e in model.engram_layers().values())
