"""Converting safetensors checkpoints (V4.1 fp8 and demo fp32 names) into tables."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engram_offload import cli
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.rows import encode_rows
from engram_offload.serving.store import open_table
from engram_offload.table.convert import convert_checkpoint

HF_CONFIG = {
    "engram_layer_ids": [1, 3], "engram_max_ngram_size": 3, "engram_n_heads": 2,
    "engram_head_dim": 64, "engram_vocab_size": 300, "hidden_size": 128, "hc_mult": 4,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
}


def v41_checkpoint(directory, scale_dtype=torch.uint8, rows_delta=0):
    """Two shards, one Engram layer each (plus an unrelated tensor); returns the expected raw rows."""
    config = EngramConfig.from_hf_config(HF_CONFIG)
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    expected = []
    for shard, layer in enumerate(config.layer_ids):
        n = config.rows_per_layer[layer] + rows_delta
        raw = encode_rows(torch.randn(n, 64) * 3, "fp8_e4m3_ue8m0")  # [n, 66]
        expected.append(raw)
        scale = raw[:, 64:].contiguous()
        if scale_dtype != torch.uint8:
            scale = scale.view(scale_dtype)
        save_file({
            f"model.layers.{layer}.engram.embed.weight": raw[:, :64].contiguous().view(torch.float8_e4m3fn),
            f"model.layers.{layer}.engram.embed.weight_scale_inv": scale,
            f"model.layers.{layer}.mlp.weight": torch.zeros(4, 4),
        }, str(directory / f"model-0000{shard + 1}-of-00002.safetensors"))
    return config, torch.cat(expected)


@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu],
                         ids=["uint8", "e8m0"])
def test_convert_v41(tmp_path, scale_dtype):
    config, expected = v41_checkpoint(tmp_path / "ckpt", scale_dtype)
    out = convert_checkpoint(tmp_path / "ckpt", tmp_path / "t.tbl", config)
    with open_table(out, "memory") as store:
        assert store.config == config and store.config.row_format == "fp8_e4m3_ue8m0"
        assert torch.equal(store.tier.rows, expected)


def test_convert_cli_reads_config_json(tmp_path, capsys):
    config, expected = v41_checkpoint(tmp_path / "ckpt")
    assert cli.main(["convert", str(tmp_path / "ckpt"), "--out", str(tmp_path / "t.tbl")]) == 0
    assert "wrote" in capsys.readouterr().out
    with open_table(tmp_path / "t.tbl", "mmap") as store:
        assert torch.equal(store.read_raw(np.arange(store.num_rows)), expected)


def test_convert_wrong_row_count_is_clear(tmp_path, capsys):
    v41_checkpoint(tmp_path / "ckpt", rows_delta=-1)
    assert cli.main(["convert", str(tmp_path / "ckpt"), "--out", str(tmp_path / "t.tbl")]) == 1
    err = capsys.readouterr().err
    assert "rows, but the config derives" in err and "layer 1" in err
    assert not (tmp_path / "t.tbl").exists()


def test_convert_demo_names_with_flags(tmp_path):
    config = EngramConfig(layer_ids=(1, 15), max_ngram_size=3, n_heads=2, head_dim=32,
                          prime_starts=(200, 200))
    ckpt = tmp_path / "demo"
    ckpt.mkdir()
    weights = {i: torch.randn(config.rows_per_layer[i], 32) for i in config.layer_ids}
    save_file({f"layers.{i}.engram.multi_head_embedding.embedding.weight": w for i, w in weights.items()},
              str(ckpt / "model.safetensors"))
    args = ["convert", str(ckpt), "--out", str(tmp_path / "d.tbl"), "--layer-ids", "1,15",
            "--max-ngram-size", "3", "--n-heads", "2", "--head-dim", "32", "--prime-start", "200"]
    assert cli.main(args) == 0
    with open_table(tmp_path / "d.tbl", "memory") as store:
        assert store.config == config
        assert torch.equal(store.gather(np.arange(store.num_rows)), torch.cat([weights[1], weights[15]]))
    # the same weights stored as bf16
    assert cli.main(args[:3] + [str(tmp_path / "b.tbl")] + args[4:] + ["--row-format", "bf16"]) == 0
    with open_table(tmp_path / "b.tbl", "memory") as store:
        assert store.config.row_format == "bf16"
        assert torch.equal(store.gather([0]), weights[1][:1].to(torch.bfloat16).float())


def test_convert_layer_mismatch_and_no_tensors(tmp_path):
    config, _ = v41_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"Engram layers \[1, 3\] do not match the config's \[1, 4\]"):
        convert_checkpoint(tmp_path / "ckpt", tmp_path / "t.tbl", config.replace(layer_ids=(1, 4)))
    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({"model.layers.0.mlp.weight": torch.zeros(2, 2)}, str(empty / "model.safetensors"))
    with pytest.raises(ValueError, match="no Engram embedding tensors"):
        convert_checkpoint(empty, tmp_path / "t.tbl", config)
    assert cli.main(["convert", str(empty), "--out", str(tmp_path / "x.tbl")]) == 1


def test_convert_float32_power_of_two_scales_with_bias_127(tmp_path):
    # scales stored as float32 powers of two 2**(byte - 127): a bias of 126 would move every byte by one
    config = EngramConfig.from_hf_config(HF_CONFIG)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    expected = []
    for layer in config.layer_ids:
        raw = encode_rows(torch.randn(config.rows_per_layer[layer], 64) * 3, "fp8_e4m3_ue8m0")
        expected.append(raw)
        exponents = raw[:, 64:].to(torch.float32) - 127
        save_file({
            f"layers.{layer}.engram.embed.weight": raw[:, :64].contiguous().view(torch.float8_e4m3fn),
            f"layers.{layer}.engram.embed.scale": torch.ldexp(torch.ones_like(exponents), exponents),
        }, str(ckpt / f"layer{layer}.safetensors"))
    out = convert_checkpoint(ckpt, tmp_path / "t.tbl", config)
    with open_table(out, "memory") as store:
        assert torch.equal(store.tier.rows, torch.cat(expected))


@pytest.mark.parametrize("weight,scale", [("embed.weight", "embed.scale"),
                                          ("embed_tokens.weight", "embed_tokens.weight_scale_inv")])
def test_convert_reads_the_released_and_the_engine_names(tmp_path, weight, scale):
    config = EngramConfig.from_hf_config(HF_CONFIG)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    expected = []
    for layer in config.layer_ids:
        raw = encode_rows(torch.randn(config.rows_per_layer[layer], 64), "fp8_e4m3_ue8m0")
        expected.append(raw)
        save_file({f"layers.{layer}.engram.{weight}": raw[:, :64].contiguous().view(torch.float8_e4m3fn),
                   f"layers.{layer}.engram.{scale}": raw[:, 64:].contiguous().view(torch.float8_e8m0fnu)},
                  str(ckpt / f"layer{layer}.safetensors"))
    out = convert_checkpoint(ckpt, tmp_path / "t.tbl", config)
    with open_table(out, "memory") as store:
        assert torch.equal(store.tier.rows, torch.cat(expected))


def test_convert_fp8_without_scales_names_the_names_tried(tmp_path):
    config = EngramConfig.from_hf_config(HF_CONFIG)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({f"layers.{i}.engram.embed.weight": torch.zeros(config.rows_per_layer[i], 64).to(torch.float8_e4m3fn)
               for i in config.layer_ids}, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layer 1 has no ue8m0 scales: tried layers\.1\.engram\.embed\.scale, "
                                         r"layers\.1\.engram\.embed\.weight_scale_inv, "
                                         r"layers\.1\.engram\.embed_tokens\.weight_scale_inv"):
        convert_checkpoint(ckpt, tmp_path / "t.tbl", config)
    assert not (tmp_path / "t.tbl").exists()
