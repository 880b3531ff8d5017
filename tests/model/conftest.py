"""The shipped trained model and a few held-out windows of real text."""

from __future__ import annotations

import pytest

from engram_offload.engram.tokenizer import load_tokenizer
from engram_offload.model.checkpoint_io import load_model, shipped_model_dir
from engram_offload.model.corpus import corpus_files, split, token_sequences
from engram_offload.model.evaluate import windows


@pytest.fixture(scope="session")
def model_dir():
    path = shipped_model_dir()
    if not (path / "config.json").is_file():
        pytest.fail(f"the trained model is missing from {path}: it ships with the package")
    return path


@pytest.fixture(scope="session")
def held_out_pieces():
    """Windows of 64 tokens from held-out standard-library files (about 3,000 tokens)."""
    files = split(corpus_files())[1]
    return windows(token_sequences(files[:4], load_tokenizer(), 3000), 64)


@pytest.fixture(scope="session")
def model(model_dir):
    return load_model(model_dir)
