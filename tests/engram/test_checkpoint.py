"""``CheckpointIndex``: where a checkpoint's Engram tensors are, from its index or its shards'
headers, and the messages for what is wrong with either."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engram_offload.engram.checkpoint import (
    DEMO_EMBED_NAME,
    INDEX_FILE,
    CheckpointIndex,
    engram_suffix,
    missing_message,
    pick,
)


def shard(path, *names):
    save_file({name: torch.zeros(2) for name in names}, str(path))
    return path


@pytest.mark.parametrize("name, found", [
    ("layers.12.engram.embed.weight", (12, "embed.weight")),
    ("model.layers.3.engram.wkv.scale", (3, "wkv.scale")),
    (f"model.layers.7.demo.{DEMO_EMBED_NAME}", (7, DEMO_EMBED_NAME)),
    (f"layers.40.{DEMO_EMBED_NAME}", (40, DEMO_EMBED_NAME)),
    ("layers.2.attn.wq.weight", None),
    ("xlayers.2.engram.embed.weight", None),
    ("embed.weight", None),
])
def test_engram_tensor_names_give_their_layer_and_name_within_the_module(name, found):
    assert engram_suffix(name) == found


def test_without_an_index_every_shards_header_is_read(tmp_path):
    a = shard(tmp_path / "a.safetensors", "layers.1.engram.embed.weight", "layers.1.attn.w")
    b = shard(tmp_path / "b.safetensors", "layers.14.engram.embed.weight", "layers.14.engram.embed.scale")
    index = CheckpointIndex.open(tmp_path)
    assert index.root == tmp_path
    assert index.shard_of == {"layers.1.engram.embed.weight": a, "layers.1.attn.w": a,
                              "layers.14.engram.embed.weight": b, "layers.14.engram.embed.scale": b}
    assert index.engram_layers() == {1: {"embed.weight": "layers.1.engram.embed.weight"},
                                     14: {"embed.weight": "layers.14.engram.embed.weight",
                                          "embed.scale": "layers.14.engram.embed.scale"}}
    assert set(index.read(["layers.14.engram.embed.scale"])) == {"layers.14.engram.embed.scale"}
    with pytest.raises(KeyError) as err:
        index.layer_tensors(5)
    assert err.value.args[0] == (f"{tmp_path} has no Engram tensors for layer 5 (looked for "
                                 "'layers.5.engram.*'); its Engram layers: [1, 14]")


def test_a_tensor_in_two_shards_without_an_index_is_refused_naming_both(tmp_path):
    shard(tmp_path / "a.safetensors", "layers.1.engram.embed.weight")
    shard(tmp_path / "b.safetensors", "layers.1.engram.embed.weight")
    with pytest.raises(ValueError) as err:
        CheckpointIndex.open(tmp_path)
    assert str(err.value) == (f"tensor layers.1.engram.embed.weight is in two shards, a.safetensors and "
                              f"b.safetensors, and {tmp_path} has no {INDEX_FILE} to say which is meant: remove "
                              "the stale shard or add the checkpoint's index")


def test_a_folder_without_shards_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        CheckpointIndex.open(tmp_path)
    assert str(err.value) == f"no *.safetensors shards and no {INDEX_FILE} in {tmp_path}"


def test_two_names_of_one_engram_tensor_are_refused(tmp_path):
    shard(tmp_path / "a.safetensors", "layers.1.engram.embed.weight", "model.layers.1.engram.embed.weight")
    with pytest.raises(ValueError) as err:
        CheckpointIndex.open(tmp_path).engram_layers()
    assert str(err.value) in (
        "layer 1 has two Engram tensors named embed.weight: layers.1.engram.embed.weight and "
        "model.layers.1.engram.embed.weight",
        "layer 1 has two Engram tensors named embed.weight: model.layers.1.engram.embed.weight and "
        "layers.1.engram.embed.weight")


def test_the_index_says_where_each_tensor_is(tmp_path):
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"layers.1.engram.embed.weight": "s1.safetensors",
                                                                  "layers.1.attn.w": "s2.safetensors"}}))
    index = CheckpointIndex.open(tmp_path)
    assert index.root == tmp_path
    assert index.shard_of == {"layers.1.engram.embed.weight": tmp_path / "s1.safetensors",
                              "layers.1.attn.w": tmp_path / "s2.safetensors"}


@pytest.mark.parametrize("content, found", [
    ({"metadata": {}}, "(no weight_map object, expected an object with a weight_map)"),
    ([1, 2], "(a JSON list, expected an object with a weight_map)"),
    ({"weight_map": [1]}, "(no weight_map object, expected an object with a weight_map)"),
])
def test_an_index_without_a_weight_map_object_is_refused_saying_what_it_holds(tmp_path, content, found):
    (tmp_path / INDEX_FILE).write_text(json.dumps(content))
    with pytest.raises(ValueError) as err:
        CheckpointIndex.open(tmp_path)
    assert str(err.value) == f"{tmp_path / INDEX_FILE} is not a safetensors index {found}: re-download it or remove it"


def test_an_index_that_is_not_json_is_refused_with_the_parsers_words(tmp_path):
    (tmp_path / INDEX_FILE).write_text("{weight_map")
    with pytest.raises(ValueError, match=rf"^{tmp_path / INDEX_FILE} is not a safetensors index \(not valid JSON: "
                                         r"Expecting property name .*\): re-download it or remove it$"):
        CheckpointIndex.open(tmp_path)


@pytest.mark.parametrize("name", [".", "..", "", "a/b.safetensors", "a\\b.safetensors", "a\0b", 7, None])
def test_an_index_naming_anything_but_a_plain_file_of_its_folder_is_refused(tmp_path, name):
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "s.safetensors", "t": name}}))
    with pytest.raises(ValueError) as err:
        CheckpointIndex.open(tmp_path)
    assert str(err.value) == (f"{tmp_path / INDEX_FILE} is not a safetensors index: tensor t maps to {name!r}, not "
                              f"a shard file name in {tmp_path}: re-download it or remove it")


def test_pick_takes_the_first_name_present_and_missing_message_lists_every_name_tried():
    tensors = {"embed.scale": "layers.1.engram.embed.scale", "embed.weight_scale_inv": "x"}
    assert pick(tensors, ("embed.weight_scale_inv", "embed.scale")) == "x"
    assert pick(tensors, ("embed.scale", "embed.weight_scale_inv")) == "layers.1.engram.embed.scale"
    assert pick(tensors, ("wkv.scale",)) is None
    assert missing_message(("wkv.scale", "wkv.weight_scale_inv"), "wkv scales", 14) == (
        "layer 14 has no wkv scales: tried layers.14.engram.wkv.scale, layers.14.engram.wkv.weight_scale_inv")
