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
