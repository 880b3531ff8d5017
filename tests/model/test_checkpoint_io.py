"""The shipped model is in the released DeepSeek-V4.1 on-disk format, and loads unchanged."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_saving_the_shipped_model_again_writes_the_same_files(model_dir, tmp_path):
    """Load, then save with the same tables, training record and written rows: the backbone
    shard, the index, the config and the records come back byte for byte; the Engram shard holds
    the same tensors, whose values dequantize the same (a block whose largest value sits on a
    power-of-two boundary may take the other of two exact scales)."""
    import numpy as np
    from safetensors.torch import load_file

    from engram_offload.model.checkpoint_io import load_model, save_model, written_rows

    model = load_model(model_dir)
    tables = {i: dequantize_fp8_ue8m0(e.embed.weight, e.embed.scale) for i, e in model.engram_layers().items()}
    extra = json.loads((model_dir / "training.json").read_text())
    written = written_rows(model_dir)
    assert written is not None and written.dtype == bool and written.all()  # training wrote every row
    assert written.size == EngramConfig.from_hf_config(model_dir).num_rows
    out = save_model(model, tables, tmp_path / "m", extra=extra, written=torch.from_numpy(written))
    assert out == tmp_path / "m"
    for name in ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                 "training.json", "written_rows.npy"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert np.array_equal(written_rows(out), written) and written_rows(tmp_path) is None
    shipped, saved = (load_file(str(d / "model-00002-of-00002.safetensors")) for d in (model_dir, out))
    assert {k: (v.dtype, v.shape) for k, v in saved.items()} == {k: (v.dtype, v.shape) for k, v in shipped.items()}
    for layer in model.engram_layers():
        p = f"layers.{layer}.engram."
        for weight, scale, dequantize in (("embed.weight", "embed.scale", dequantize_fp8_ue8m0),
                                          ("wkv.weight", "wkv.scale", dequantize_fp8_blocks)):
            got = dequantize(saved[p + weight], saved[p + scale].view(torch.uint8))
            assert torch.equal(got, dequantize(shipped[p + weight], shipped[p + scale].view(torch.uint8))), p + weight
        for name in ("q_weight", "k_weight"):
            assert torch.equal(saved[p + name], shipped[p + name])
    assert torch.equal(load_model(out)(torch.arange(3, 40)[None]), model(torch.arange(3, 40)[None]))


def test_saving_the_twin_again_writes_the_same_files(model_dir, tmp_path):
    from engram_offload.model.checkpoint_io import load_model, save_model

    twin = load_model(twin_dir(model_dir))
    assert not twin.has_engram and twin.engram_layers() == {}
    out = save_model(twin, {}, tmp_path / "t", extra=json.loads((twin_dir(model_dir) / "training.json").read_text()))
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in twin_dir(model_dir).iterdir())
    for f in twin_dir(model_dir).iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert not (out / "written_rows.npy").exists()
    # over a model already there, or into folders still to be made; the record's keys sorted
    again = save_model(twin, {}, out, extra={"z": 1, "a": {"y": 2, "b": 3}})
    assert (again / "training.json").read_text() == json.dumps({"a": {"b": 3, "y": 2}, "z": 1}, indent=2) + "\n"
    nested = save_model(twin, {}, tmp_path / "new" / "twin")
    assert (nested / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_load_model_defaults_to_the_shipped_model_and_refuses_a_foreign_checkpoint(model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from engram_offload.model.checkpoint_io import load_model

    default = load_model()
    assert torch.equal(default.head.weight, load_model(model_dir).head.weight) and default.has_engram
    def twin_without(name: str, folder: Path) -> Path:
        """A copy of the twin checkpoint in ``folder`` without tensor ``name`` (and its index entry)."""
        shutil.copytree(twin_dir(model_dir), folder)
        tensors = load_file(str(folder / "model.safetensors"))
        del tensors[name]
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        del index["weight_map"][name]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return folder

    foreign = twin_without("vocab_ids", tmp_path / "foreign")
    with pytest.raises(ValueError, match=f"{foreign} has no vocab_ids tensor: is it an EngramLM checkpoint"):
        load_model(foreign)
    # a backbone tensor missing: refused, not left at its initial value
    lacking = twin_without("norm.weight", tmp_path / "lacking")
    with pytest.raises(ValueError, match=r"does not match the model: missing \['norm.weight'\], unexpected \[\]"):
        load_model(lacking)
