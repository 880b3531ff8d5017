"""Prefetcher.begin_step's decode form: one token per sequence given as one array."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table
from engram_offload.config import EngramConfig
from engram_offload.hashing import NgramHasher
from engram_offload.prefetch import Prefetcher

CONFIG = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=32,
                      prime_starts=(300, 500), row_format="fp8_e4m3_ue8m0")
VOCAB = 1000


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    x = torch.randn(CONFIG.num_rows, CONFIG.head_dim)
    return write_table(tmp_path_factory.mktemp("begin") / "t.tbl", CONFIG, x)


def hasher() -> NgramHasher:
    return NgramHasher(CONFIG, np.arange(VOCAB, dtype=np.int64) % 700)


def decode_steps(table, as_pieces, steps: np.ndarray, dead=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's table ids and first layer's rows, the tokens given by ``as_pieces``."""
    seen = []
    with open_table(table, "mmap") as store, Prefetcher(store, hasher()) as pf:
        for tokens in steps:  # [S] a step
            step = pf.begin_step([7, 8, 9], as_pieces(tokens), dead)
            seen.append((step.table_ids.clone(), pf.rows(CONFIG.layer_ids[0], step).clone()))
            assert step.lengths == (1, 1, 1)
            pf.end_step(step)
    return seen


@pytest.mark.parametrize("form", ["numpy", "int32", "tensor"])
def test_one_array_of_decode_tokens_hashes_as_one_piece_each(table, form):
    steps = np.random.default_rng(4).integers(0, VOCAB, size=(5, 3))  # 5 steps of 3 sequences
    convert = {"numpy": lambda t: t, "int32": lambda t: t.astype(np.int32), "tensor": torch.from_numpy}[form]
    want = decode_steps(table, lambda t: [t[i:i + 1] for i in range(t.size)], steps)
    got = decode_steps(table, convert, steps)
    for (ids_w, rows_w), (ids_g, rows_g) in zip(want, got):
        assert torch.equal(ids_g, ids_w) and torch.equal(rows_g, rows_w)
    # the history carried over: the last step's ids are not those of its tokens alone
    fresh = decode_steps(table, convert, steps[-1:])
    assert not torch.equal(fresh[0][0], got[-1][0])


def test_one_array_with_dead_masks_takes_the_pieces_path(table):
    steps = np.random.default_rng(6).integers(0, VOCAB, size=(3, 3))
    dead = [np.array([True]), None, np.array([False])]
    want = decode_steps(table, lambda t: [t[i:i + 1] for i in range(t.size)], steps, dead)
    got = decode_steps(table, lambda t: t, steps, dead)
    assert all(torch.equal(g[0], w[0]) for g, w in zip(got, want))


def test_one_array_must_hold_a_token_per_sequence_and_integers(table):
    with open_table(table, "mmap") as store, Prefetcher(store, hasher()) as pf:
        with pytest.raises(ValueError, match="2 tokens for 3 sequences: give one each"):
            pf.begin_step([1, 2, 3], np.array([5, 6]))
        with pytest.raises(TypeError, match="must be integers, got an array of float64"):
            pf.begin_step([1, 2], np.array([5.0, 6.0]))
        with pytest.raises(ValueError, match="2 pieces for 3 sequences"):
            pf.begin_step([1, 2, 3], [np.array([5]), np.array([6])])
