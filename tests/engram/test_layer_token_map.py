"""``EngramLayer.from_checkpoint(folder, layer_id)`` without ``token_map`` is ready to run: it
hashes with the folder's tokenizer.json when there is one, else DeepSeek's packaged tokenizer,
and one that does not fit the config is refused with the reason, not used."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload import EngramLayer
from engram_offload.engram.tokenizer import cached_token_map

from released_checkpoint import TOKEN_MAP, inputs, write_released_checkpoint, write_tokenizer


def test_without_a_token_map_the_layer_hashes_with_the_folders_tokenizer(tmp_path):
    checkpoint = write_released_checkpoint(tmp_path / "ck")
    write_tokenizer(checkpoint.path / "tokenizer.json")  # its compression is the checkpoint's TOKEN_MAP
    hidden, ids = inputs()
    layer = EngramLayer.from_checkpoint(checkpoint.path, 1)
    assert layer.hasher is not None and np.array_equal(layer.hasher.token_map, TOKEN_MAP)
    given = EngramLayer.from_checkpoint(checkpoint.path, 1, token_map=TOKEN_MAP)
    assert torch.equal(layer(hidden, ids), given(hidden, ids))


def test_without_a_tokenizer_json_deepseeks_is_used_or_refused_with_the_reason(tmp_path):
    checkpoint = write_released_checkpoint(tmp_path / "ck")  # declares 37 compressed ids: not DeepSeek's
    hidden, ids = inputs()
    layer = EngramLayer.from_checkpoint(checkpoint.path, 1)
    with pytest.raises(ValueError, match=r"DeepSeek's tokenizer \(no tokenizer.json in .*\) compresses to 99,092 ids "
                                         "but the config declares engram_compressed_vocab_size 37"):
        layer(hidden, ids)
    rows = layer.lookup(torch.from_numpy(TOKEN_MAP[ids.numpy()])[..., None].expand(*ids.shape, layer.config.cols_per_layer) % 5)
    assert layer(hidden, ids, rows=rows).shape == hidden.shape  # rows given: no token map needed
    # a config that declares no compressed size: DeepSeek's map, ready to hash
    import json

    config = json.loads((checkpoint.path / "config.json").read_text())
    config.get("text_config", config).pop("engram_compressed_vocab_size", None)
    (checkpoint.path / "config.json").write_text(json.dumps(config))
    deepseek = EngramLayer.from_checkpoint(checkpoint.path, 1)
    assert deepseek.hasher is not None and np.array_equal(deepseek.hasher.token_map, cached_token_map())
    assert torch.equal(deepseek(hidden, ids), EngramLayer.from_checkpoint(
        checkpoint.path, 1, token_map=cached_token_map())(hidden, ids))
