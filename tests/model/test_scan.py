"""The scan: every row read with its gate, the top n-grams, the rank correlation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload.engram.tokenizer import load_tokenizer
from engram_offload.model.scan import rank_correlation, scan, top_rows


@pytest.fixture(scope="module")
def scanned(model, held_out_pieces):
    return scan(model, held_out_pieces)


def test_every_read_is_counted_with_its_gate(model, held_out_pieces, scanned):
    c = model.config
    per_token = len(c.layer_ids) * c.cols_per_layer
    assert scanned.counts.sum() == scanned.evaluation.tokens * per_token == scanned.trace_ids.size
    assert np.isclose(scanned.gate_sums.sum(), scanned.trace_gates.astype(np.float64).sum(), rtol=1e-5)
    assert np.array_equal(np.bincount(scanned.trace_ids, minlength=c.num_rows), scanned.counts)
    gates = scanned.mean_gates[scanned.read_rows]
    assert ((gates > 0) & (gates < 1)).all()
    share = scanned.example_share[scanned.read_rows]
    assert ((share > 0) & (share <= 1)).all()
    distinct = scanned.distinct_ngrams[scanned.read_rows]
    assert (distinct >= 1).all() and (distinct <= scanned.counts[scanned.read_rows]).all()
    assert np.allclose(share[distinct == 1], 1.0)


def test_each_example_ngram_hashes_to_its_row(model, scanned):
    """A row's example (its most read n-gram) is the order's last n tokens (fewer at a window's
    start, where the hash reads the pad id): hashing them alone gives the row back."""
    rows = scanned.read_rows[:: max(1, scanned.read_rows.size // 200)]
    assert rows.size > 50
    for row in rows:
        tokens = scanned.examples[row][scanned.examples[row] >= 0]
        ids = model.hasher.table_ids(model.hasher.hash_all(torch.from_numpy(tokens[None])))[0, -1]  # [L, C]
        assert int(row) in ids.reshape(-1).tolist()


def test_top_rows_are_sorted_and_decoded(model, scanned):
    top = top_rows(model, scanned, load_tokenizer(), top=10, min_reads=3)
    by_gate = [r["mean_gate"] for r in top["by_mean_gate"]]
    assert by_gate == sorted(by_gate, reverse=True) and all(r["reads"] >= 3 for r in top["by_mean_gate"])
    by_reads = [r["reads"] for r in top["by_reads"]]
    assert by_reads == sorted(by_reads, reverse=True) and by_reads[0] == scanned.counts.max()
    assert all(r["ngram"] for r in top["by_gate_mass"])
    assert {r["order"] for rs in top.values() for r in rs} <= set(range(2, model.config.max_ngram_size + 1))


def test_rank_correlation():
    x = np.array([1.0, 2, 3, 4, 5])
    assert rank_correlation(x, x ** 3) == pytest.approx(1.0)
    assert rank_correlation(x, -x) == pytest.approx(-1.0)
    # ties take their mean rank: Pearson of ranks [1.5, 1.5, 3, 4] and [1, 2, 3, 4]
    a, b = np.array([1.5, 1.5, 3, 4]), np.array([1.0, 2, 3, 4])
    assert rank_correlation(np.array([7.0, 7, 8, 9]), np.array([1.0, 2, 3, 4])) == pytest.approx(np.corrcoef(a, b)[0, 1])


def test_reads_of_unseen_ngrams_are_told_from_seen_ones(model, held_out_pieces, scanned):
    from engram_offload.model.evaluate import batches
    from engram_offload.model.ngrams import SeenNgrams, ngram_keys

    seen = SeenNgrams()
    half = held_out_pieces[: len(held_out_pieces) // 2]
    for chunk in batches(half, 16):
        seen.add(ngram_keys(model.hasher, chunk[:, :-1]))
    with_seen = scan(model, held_out_pieces, seen=seen)
    c = model.config
    reads = with_seen.unseen_reads + with_seen.seen_reads  # per order
    assert np.array_equal(reads, np.full(c.num_orders, scanned.counts.sum() / c.num_orders))
    assert np.isclose((with_seen.unseen_gate_sums + with_seen.seen_gate_sums).sum(), scanned.gate_sums.sum())
    assert (with_seen.seen_reads > 0).all() and (with_seen.unseen_reads > 0).all()
    assert with_seen.unseen_reads[1] > with_seen.unseen_reads[0]  # 3-grams are new more often than 2-grams
    alone = scan(model, half, seen=seen)
    assert alone.unseen_reads.sum() == 0  # the text the filter was filled from: all seen
    assert scanned.unseen_reads is None


def test_seen_ngrams_round_trip(model, tmp_path):
    from engram_offload.model.ngrams import SeenNgrams, ngram_keys

    ids = torch.randint(3, 100_000, (3, 40), generator=torch.Generator().manual_seed(0))
    keys = ngram_keys(model.hasher, ids)
    assert keys.shape == (3, 40, model.config.max_ngram_size - 1)
    seen = SeenNgrams()
    seen.add(keys[:2])
    seen.save(tmp_path)
    loaded = SeenNgrams.load(tmp_path)
    assert loaded is not None and loaded.contains(keys[:2]).all() and not loaded.contains(keys[2]).any()
    assert SeenNgrams.load(tmp_path / "none") is None
