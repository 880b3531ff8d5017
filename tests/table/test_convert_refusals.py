"""``convert`` refuses what it cannot store as it means, in one line naming the tensor (and row):
scales beside a weight that is not e4m3, non-finite values, ue8m0 byte 0xFF, out-of-range
float scales, one tensor in two shards without an index, an index that is not an index.
Each case runs the real command on a checkpoint in the released V4.1 format."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engram_offload import cli
from engram_offload.serving.store import open_table

from released_checkpoint import SHARDS, write_released_checkpoint

WEIGHT, SCALE = "layers.1.engram.embed.weight", "layers.1.engram.embed.scale"


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return write_released_checkpoint(tmp_path_factory.mktemp("released") / "ckpt")


@pytest.fixture
def ckpt(released, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(released.path, copy)
    return copy


def _edit(ckpt, **changes: torch.Tensor) -> None:
    """Rewrite the first shard (layer 1's Engram tensors) with some tensors replaced."""
    shard = ckpt / SHARDS[0]
    tensors = load_file(str(shard))
    tensors.update({name.replace("__", "."): t for name, t in changes.items()})
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _convert(ckpt, tmp_path, capsys) -> tuple[int, str]:
    out = tmp_path / "t.tbl"
    code = cli.main(["convert", str(ckpt), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    if code != 0:
        assert not out.exists(), "a refused conversion leaves no table"
        assert err.count("\n") == 1, err  # one line
    return code, err


def _scale(released) -> torch.Tensor:
    return released.engram(1, "embed.scale")


@pytest.mark.parametrize("relabel", ["e5m2", "bf16", "int8"])
def test_a_scale_beside_a_weight_that_is_not_e4m3_is_refused(released, ckpt, tmp_path, capsys, relabel):
    w = released.engram(1, "embed.weight")
    weight = {"e5m2": w.view(torch.uint8).view(torch.float8_e5m2), "bf16": w.float().bfloat16(),
              "int8": w.view(torch.int8)}[relabel]
    _edit(ckpt, **{WEIGHT.replace(".", "__"): weight})
    code, err = _convert(ckpt, tmp_path, capsys)
    assert code == 1
    assert f"{WEIGHT} is { {'e5m2': 'F8_E5M2', 'bf16': 'BF16', 'int8': 'I8'}[relabel]} but has ue8m0 scales " \
           f"{SCALE}: only a float8_e4m3fn (F8_E4M3) embedding takes scales" in err


def test_an_integer_weight_without_scales_is_refused(released, ckpt, tmp_path, capsys):
    tensors = load_file(str(ckpt / SHARDS[0]))
    tensors[WEIGHT] = tensors[WEIGHT].view(torch.int8)
    del tensors[SCALE]
    save_file(tensors, str(ckpt / SHARDS[0]))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][SCALE]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = _convert(ckpt, tmp_path, capsys)
    assert code == 1 and f"{WEIGHT} is I8: an Engram embedding is float" in err


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0, 2.0 ** 128, 2.0 ** -127, 0.75])
def test_float_scales_that_are_no_ue8m0_value_are_refused(released, ckpt, tmp_path, capsys, bad):
    scales = torch.pow(2.0, _scale(released).view(torch.uint8).double() - 127)  # float64 powers of two
    scales[5, 1] = bad
    _edit(ckpt, **{SCALE.replace(".", "__"): scales})
    code, err = _convert(ckpt, tmp_path, capsys)
    assert code == 1
    assert f"{SCALE} row 5 holds scale {bad!r}: a ue8m0 scale is 0 or a power of two from 2^-126 to 2^127" in err


def test_float_scales_at_the_ends_of_the_range_are_stored_exactly(released, ckpt, tmp_path, capsys):
    raw = _scale(released).view(torch.uint8).clone()
    raw[0, 0], raw[1, 1], raw[2, 0] = 254, 1, 0  # 2^127, 2^-126, and 0 (byte 0 decodes to 0.0)
    scales = torch.pow(2.0, raw.double() - 127)
    scales[2, 0] = 0.0
    _edit(ckpt, **{SCALE.replace(".", "__"): scales})
    code, _ = _convert(ckpt, tmp_path, capsys)
    assert code == 0
    expected = torch.cat([released.engram(1, "embed.weight").view(torch.uint8), raw], dim=1)
    with open_table(tmp_path / "t.tbl", "mmap") as store:
        assert torch.equal(store.read_raw(range(expected.shape[0])), expected)


def test_ue8m0_byte_ff_is_refused(released, ckpt, tmp_path, capsys):
    raw = _scale(released).view(torch.uint8).clone()
    raw[7, 0] = 0xFF
    _edit(ckpt, **{SCALE.replace(".", "__"): raw.view(torch.float8_e8m0fnu)})
    code, err = _convert(ckpt, tmp_path, capsys)
    assert code == 1 and f"{SCALE} row 7 holds scale byte 0xFF (NaN in ue8m0)" in err


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
def test_fp8_nan_weights_are_refused(released, ckpt, tmp_path, capsys, byte):
    raw = released.engram(1, "embed.weight").view(torch.uint8).clone()
    raw[11, 3] = byte
    _edit(ckpt, **{WEIGHT.replace(".", "__"): raw.view(torch.float8_e4m3fn)})
    code, err = _convert(ckpt, tmp_path, capsys)
    assert code == 1 and f"{WEIGHT} row 11 holds a NaN or infinite value" in err


def test_one_tensor_in_two_shards_without_an_index_is_refused(ckpt, tmp_path, capsys):
    (ckpt / "model.safetensors.index.json").unlink()
    tensors = load_file(str(ckpt / SHARDS[0]))
    stale = {WEIGHT: tensors[WEIGHT].view(torch.uint8).flip(0).contiguous().view(torch.float8_e4m3fn)}
    save_file(stale, str(ckpt / "model-00000-stale.safetensors"))  # sorts before the real shard
    code, err = _convert(ckpt, tmp_path, capsys)
    assert code == 1
    assert (f"tensor {WEIGHT} is in two shards, model-00000-stale.safetensors and {SHARDS[0]}, and {ckpt} has "
            "no model.safetensors.index.json to say which is meant") in err


@pytest.mark.parametrize("content, found", [
    (b"\xff\xfe\x00binary", "not UTF-8 text"),
    (b'["model-00001-of-00003.safetensors"]', "a JSON list, expected an object with a weight_map"),
    (b'{"weight_map": {"layers.1.engram.embed.weight": "../elsewhere.safetensors"}}', "maps to '../"),
])
def test_an_index_that_is_no_index_is_refused(ckpt, tmp_path, capsys, content, found):
    index = ckpt / "model.safetensors.index.json"
    index.write_bytes(content)
    code, err = _convert(ckpt, tmp_path, capsys)
    assert code == 1 and f"{index} is not a safetensors index" in err and found in err
    assert "unexpected" not in err
