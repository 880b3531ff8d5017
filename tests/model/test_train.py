"""Training is seeded end to end: the same seed writes the same bytes."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_offload.model.corpus import corpus_files, split
from engram_offload.model.train import TrainSettings, model_vocabulary, plot_losses, train


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """About 60 real standard-library files (the json, email and http packages) with a held-out file."""
    root = tmp_path_factory.mktemp("corpus") / "lib"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for package in ("json", "email", "http", "urllib"):
        for f in sorted((stdlib / package).rglob("*.py")):
            target = root / f.relative_to(stdlib)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
    train_files, held = split(corpus_files([root]))
    assert held and train_files, "the small corpus needs files on both sides of the split"
    return root


def tiny(seed: int, corpus: Path) -> TrainSettings:
    return TrainSettings(seed=seed, steps=3, batch=2, seq_len=32, hidden=32, layers=2, attention_heads=2,
                         engram_layers=(1,), engram_heads=2, prime_start=211, vocab=128, warmup=1,
                         max_train_tokens=20_000, eval_every=2, eval_windows=2, corpus=[str(corpus)])


def _bytes(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def test_same_seed_same_bytes(small_corpus, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = train(tiny(5, small_corpus), tmp_path / "a", progress=False, log=lambda m: None)
        b = train(tiny(5, small_corpus), tmp_path / "b", progress=False, log=lambda m: None)
        c = train(tiny(6, small_corpus), tmp_path / "c", progress=False, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    assert _bytes(a.path) == _bytes(b.path)
    assert _bytes(a.path)["model-00002-of-00002.safetensors"] != _bytes(c.path)["model-00002-of-00002.safetensors"]
    assert [r["step"] for r in a.history] == [1, 2, 3] and "held_out_loss" in a.history[1]
    png = plot_losses(a.history, tmp_path / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_vocabulary_orders_by_count_then_id():
    seqs = [np.array([5, 5, 9, 9, 3, 7, 7, 7]), np.array([3])]
    assert model_vocabulary(seqs, 4).tolist() == [7, 3, 5]  # 7 x3; 3, 5 and 9 x2: lower ids first


def test_held_out_split_is_by_file_and_stable(small_corpus):
    files = corpus_files([small_corpus])
    train_files, held = split(files)
    assert {f.name for f in train_files}.isdisjoint(f.name for f in held)
    assert len(train_files) + len(held) == len(files)
    assert split(corpus_files([small_corpus]))[1] == held


def test_the_twin_without_engram_starts_from_the_same_backbone():
    from engram_offload.engram.config import EngramConfig
    from engram_offload.engram.tokenizer import cached_token_map
    from engram_offload.model.lm import EngramLM

    token_map = cached_token_map()
    config = EngramConfig(layer_ids=(1,), max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=(211, 211),
                          pad_id=2, hidden_size=32, hc_mult=2, variant="v4.1", row_format="fp8_e4m3_ue8m0",
                          compressed_vocab_size=int(token_map.max()) + 1)
    vocab = torch.arange(3, 66)
    torch.manual_seed(3)
    with_engram = EngramLM(config, vocab, token_map, 2, 2, table=False)
    torch.manual_seed(3)
    twin = EngramLM(config, vocab, token_map, 2, 2, table=False, engram=False)
    backbone = {k: v for k, v in with_engram.state_dict().items() if ".engram." not in k}
    assert backbone.keys() == twin.state_dict().keys()
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in backbone.items())
    assert twin.engram_layers() == {} and not twin.has_engram


def test_twin_trains_on_the_same_batches_and_saves_one_shard(small_corpus, tmp_path):
    from engram_offload.model.checkpoint_io import load_model, written_rows

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = train(tiny(5, small_corpus), tmp_path / "m", progress=False, log=lambda m: None)
        settings = tiny(5, small_corpus)
        settings.engram = False
        twin = train(settings, tmp_path / "t", progress=False, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    assert sorted(p.name for p in twin.path.iterdir()) == ["config.json", "model.safetensors",
                                                           "model.safetensors.index.json", "training.json"]
    assert twin.train_tokens == model.train_tokens
    assert twin.history[0]["train_loss"] != model.history[0]["train_loss"]  # the table changes the first batch's loss
    loaded = load_model(twin.path)
    assert not loaded.has_engram and written_rows(twin.path) is None
    written = written_rows(model.path)
    config = load_model(model.path).config
    assert written is not None and written.shape == (config.num_rows,) and 0 < written.sum() < written.size


def test_row_dropout_and_a_zero_table_leave_unwritten_rows_at_zero(small_corpus, tmp_path):
    from engram_offload.model.checkpoint_io import load_model, written_rows

    settings = tiny(5, small_corpus)
    settings.row_dropout, settings.table_init = 0.5, "zero"
    result = train(settings, tmp_path / "m", progress=False, log=lambda m: None)
    model = load_model(result.path)
    written = written_rows(result.path)
    rows = torch.cat([layer.lookup(torch.arange(model.config.rows_per_layer[i]))
                      for i, layer in model.engram_layers().items()])
    assert written is not None and not rows[~torch.from_numpy(written)].any()
    assert rows[torch.from_numpy(written)].any(dim=1).float().mean() > 0.9
    with pytest.raises(ValueError, match="row_dropout"):
        settings.row_dropout = 1.0
        train(settings, tmp_path / "bad", progress=False, log=lambda m: None)
