"""A checkpoint in the released DeepSeek-V4.1 on-disk format: convert it, load a layer from it,
and check both against the bytes written and a float64 reading of the SPEC."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from engram_offload import EngramLayer, NgramHasher, Prefetcher, open_table
from engram_offload.engram.config import EngramConfig
from engram_offload.table.convert import convert_checkpoint

from reference import reference_v41_output
from released_checkpoint import IMAGE_TOKEN, LAYERS, SHARDS, inputs, write_released_checkpoint

TIERS = ("memory", "pinned", "mmap", "direct")


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return write_released_checkpoint(tmp_path_factory.mktemp("released") / "DeepSeek-V4.1-tiny")


@pytest.fixture(scope="module")
def table(released, tmp_path_factory):
    return convert_checkpoint(released.path, tmp_path_factory.mktemp("table") / "t.tbl", released.config,
                              progress=False)


def _header(path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def test_the_checkpoint_is_in_the_released_format(released):
    index = json.loads((released.path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(SHARDS)
    headers = {shard: _header(released.path / shard) for shard in SHARDS}
    for name, shard in index.items():
        assert name in headers[shard]
    h1, h2 = headers[SHARDS[0]], headers[SHARDS[1]]
    assert h1["layers.1.engram.embed.weight"]["dtype"] == "F8_E4M3"
    assert h1["layers.1.engram.embed.scale"]["dtype"] == "F8_E8M0"
    assert h2["layers.3.engram.wkv.weight"] == {**h2["layers.3.engram.wkv.weight"], "dtype": "F8_E4M3",
                                                "shape": [120, 256]}
    assert h2["layers.3.engram.wkv.scale"]["dtype"] == "F8_E8M0"
    assert h2["layers.3.engram.wkv.scale"]["shape"] == [4, 8]  # ceil(120/32), 256/32
    assert not any("engram" in name for name in headers[SHARDS[2]])


def test_from_hf_config_reads_the_nested_released_config(released):
    config = EngramConfig.from_hf_config(released.path)
    assert config == released.config
    assert config.row_format == "fp8_e4m3_ue8m0" and config.variant == "v4.1"
    assert (config.hidden_size, config.hc_mult, config.rms_norm_eps) == (40, 2, 1e-20)
    assert config.image_token_id == IMAGE_TOKEN


def test_convert_copies_every_row_byte_for_byte(released, table):
    with open_table(table, "mmap") as store:
        assert store.config == released.config
        for layer in LAYERS:
            base, rows = released.config.layer_row_base(layer), released.config.rows_per_layer[layer]
            expected = released.raw_rows(layer)
            got = store.read_raw(np.arange(base, base + rows))
            assert torch.equal(got, expected), layer
            assert torch.equal(store.read_raw([base]), expected[:1])  # first row
            assert torch.equal(store.read_raw([base + rows - 1]), expected[-1:])  # last row


def test_convert_and_load_never_open_a_shard_without_engram_tensors(released, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(released.path, copy)
    (copy / SHARDS[2]).write_bytes(b"not a safetensors file")  # listed in the index, never opened
    convert_checkpoint(copy, tmp_path / "t.tbl", released.config, progress=False)
    EngramLayer.from_checkpoint(copy, 3, token_map=released.token_map)
    (copy / SHARDS[1]).unlink()  # layer 1's tensors all sit in the first shard
    EngramLayer.from_checkpoint(copy, 1, token_map=released.token_map)


@pytest.mark.parametrize("layer_id", LAYERS)
def test_layer_from_checkpoint_equals_the_float64_reference(released, layer_id):
    layer = EngramLayer.from_checkpoint(released.path, layer_id, token_map=released.token_map)
    h, ids = inputs()
    with torch.no_grad():
        out = layer(h, ids)  # the dead mask comes from the image tokens in ids
    tensors = {name: released.engram(layer_id, name) for name in
               ("embed.weight", "embed.scale", "wkv.weight", "wkv.scale", "q_weight", "k_weight")}
    ref = reference_v41_output(released.config, released.token_map, layer_id, tensors, h.numpy(), ids.numpy())
    scale = float(np.abs(ref).max())
    torch.testing.assert_close(out.double(), torch.from_numpy(ref), rtol=1e-5, atol=1e-6 * scale)
    dead = ids == IMAGE_TOKEN
    assert dead.sum() == 3 and torch.equal(out[dead], h[dead])  # gates shut at image tokens
    assert not torch.equal(out[~dead], h[~dead])


def test_loaded_wkv_is_the_block_dequantized_fp8(released):
    layer = EngramLayer.from_checkpoint(released.path, 1, table=False)
    w = released.engram(1, "wkv.weight").float()  # [120, 256]
    scale = released.engram(1, "wkv.scale").view(torch.uint8).double()  # [4, 8]
    o, i = 100, 200  # row block 3 (the partial one), column block 6
    expected = float(w[o, i]) * 2.0 ** (float(scale[o // 32, i // 32]) - 127)
    assert layer.wkv.weight.dtype == torch.float32 and float(layer.wkv.weight.detach()[o, i]) == expected
    assert not any(k.startswith("embed") for k in layer.state_dict())


@pytest.mark.parametrize("tier", TIERS)
def test_rows_from_every_tier_give_the_layers_own_output(released, table, tier):
    own = EngramLayer.from_checkpoint(released.path, 3, token_map=released.token_map)
    bare = EngramLayer.from_checkpoint(released.path, 3, table=False)
    h, ids = inputs(seed=4)
    hasher = NgramHasher(released.config, released.token_map)
    flat = hasher.table_ids(hasher.hash_all(ids))[:, :, LAYERS.index(3)]  # [B, T, C]
    with open_table(table, tier) as store:
        rows = store.gather(flat.reshape(-1)).reshape(*flat.shape, -1)  # [B, T, C, d]
    with torch.no_grad():
        assert torch.equal(bare(h, ids, rows=rows), own(h, ids))


def test_the_prefetcher_treats_image_tokens_as_dead_by_default(released, table):
    hasher = NgramHasher(released.config, released.token_map)
    _, ids = inputs(seed=2, batch=1, tokens=9)
    ids[0, 4] = IMAGE_TOKEN
    own = EngramLayer.from_checkpoint(released.path, 1, token_map=released.token_map)
    with open_table(table, "memory") as store, Prefetcher(store, hasher) as prefetcher:
        prefill = prefetcher.begin_step([0], [ids[0, :6]])
        first = prefetcher.rows(1, prefill)
        decode = [prefetcher.begin_step([0], [ids[0, t:t + 1]]) for t in range(6, 9)]
        rest = [prefetcher.rows(1, step) for step in decode]
    rows = torch.cat([first, *rest])  # [T, C, d]
    expected = own.lookup(own.row_ids(ids))[0]  # the image token's mask derived from ids
    assert torch.equal(rows, expected)
    live = own.lookup(own.row_ids(ids, torch.zeros_like(ids, dtype=torch.bool)))[0]
    assert not torch.equal(rows[4:7], live[4:7])  # the dead token changed these positions' rows
