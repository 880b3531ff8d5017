"""The scan: every row read with its gate, the top n-grams, the rank correlation."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from engram_offload.engram.tokenizer import load_tokenizer
from engram_offload.model.evaluate import evaluate
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
    assert loaded.bits.dtype == np.bool_ and loaded.bits.shape == seen.bits.shape  # one byte a bit, not eight
    assert SeenNgrams.load(tmp_path / "none") is None


def _reference(model, pieces):
    """Every read of ``pieces`` (one window per forward) counted by hand: per flat row, the reads
    of each n-gram (``-1`` before the order's tokens and before the window), and the trace."""
    from collections import Counter

    c = model.config
    n, bases = c.max_ngram_size, np.array(c.layer_row_bases)
    per_row: dict[int, Counter] = {}
    for p in pieces:
        inputs = torch.from_numpy(p[None, :-1])
        flat = model.row_ids(inputs)[0].numpy() + bases[:, None]  # [T, L, C]
        padded = [-1] * (n - 1) + p[:-1].tolist()
        for t in range(flat.shape[0]):
            for col in range(c.cols_per_layer):
                order = col // c.n_heads + 2
                gram = tuple([-1] * (n - order) + padded[t + n - order: t + n])
                for row in flat[t, :, col]:
                    per_row.setdefault(int(row), Counter())[gram] += 1
    return per_row


def test_each_row_keeps_its_most_read_ngram_its_share_and_its_distinct_ngrams(model, held_out_pieces):
    pieces = [p for p in held_out_pieces if p.size == 65][:3]
    got = scan(model, pieces)
    per_row = _reference(model, pieces)
    assert sorted(per_row) == got.read_rows.tolist()
    shares = []
    for row, grams in per_row.items():
        most = max(grams.values())
        example = min(g for g, k in grams.items() if k == most)  # ties: the lowest n-gram
        assert tuple(got.examples[row].tolist()) == example, row
        assert got.counts[row] == sum(grams.values()) and got.distinct_ngrams[row] == len(grams)
        assert got.example_share[row] == pytest.approx(most / sum(grams.values()), rel=1e-12)
        shares.append(most / sum(grams.values()))
    assert min(shares) < 1  # some rows serve colliding n-grams, and their example is the most read
    unread = np.setdiff1d(np.arange(model.config.num_rows), got.read_rows)
    assert (got.examples[unread] == -1).all() and (got.example_share[unread] == 0).all()
    assert (got.distinct_ngrams[unread] == 0).all() and (got.mean_gates[unread] == 0).all()
    assert got.config_rows == model.config.num_rows
    assert [a.dtype for a in (got.counts, got.examples, got.distinct_ngrams, got.gate_sums, got.example_share)] == \
        [np.int64] * 3 + [np.float64] * 2


@pytest.mark.parametrize("batch", [16, 5])
def test_the_trace_is_in_serving_order_with_each_reads_gate(model, held_out_pieces, batch):
    """Batch after batch (``batch`` windows each, 16 by default); in a batch, position after
    position, its windows side by side."""
    c = model.config
    pieces = [p for p in held_out_pieces if p.size == 65][:17]
    got = scan(model, pieces) if batch == 16 else scan(model, pieces, batch=batch)
    ids, gates = [], []
    bases = np.array(c.layer_row_bases)
    with torch.no_grad():
        for chunk in (pieces[k:k + batch] for k in range(0, len(pieces), batch)):
            inputs = torch.from_numpy(np.stack(chunk)[:, :-1])
            model(inputs)
            g = np.stack([model.gates()[i].mean(-1).numpy() for i in c.layer_ids], axis=2)  # [B, T, L]
            flat = model.row_ids(inputs).numpy() + bases[:, None]  # [B, T, L, C]
            for t in range(inputs.shape[1]):
                for b in range(inputs.shape[0]):
                    ids.extend(flat[b, t].reshape(-1).tolist())
                    gates.extend(np.repeat(g[b, t], c.cols_per_layer).tolist())
    assert got.trace_ids.tolist() == ids
    assert np.allclose(got.trace_gates, np.array(gates, np.float32), rtol=1e-5, atol=1e-7)
    assert got.trace_gates.dtype == np.float32
    expected_sums = np.bincount(np.array(ids), weights=np.array(gates), minlength=c.num_rows)
    assert np.allclose(got.gate_sums, expected_sums, rtol=1e-5)
    assert got.evaluation == evaluate(model, pieces, batch=batch)


def test_with_an_empty_filter_every_read_is_unseen_and_each_order_has_its_share(model, held_out_pieces, scanned):
    from engram_offload.model.ngrams import SeenNgrams

    c = model.config
    got = scan(model, held_out_pieces, seen=SeenNgrams())
    per_order = scanned.counts.sum() / c.num_orders
    assert got.unseen_reads.tolist() == [per_order] * c.num_orders
    assert got.seen_reads.tolist() == [0] * c.num_orders and got.seen_gate_sums.tolist() == [0] * c.num_orders
    assert np.allclose(got.unseen_gate_sums, scanned.gate_sums.sum() / c.num_orders, rtol=1e-5)


def test_top_rows_name_the_layer_order_and_head_each_row_is_read_at(model, scanned):
    c = model.config
    tokenizer = load_tokenizer()
    top = top_rows(model, scanned, tokenizer, top=40, min_reads=1)
    rows = [r for rs in top.values() for r in rs]
    assert {r["layer"] for r in rows} == set(c.layer_ids) and {r["head"] for r in rows} == set(range(c.n_heads))
    for r in rows:
        tokens = torch.tensor([r["ngram_tokens"]])
        ids = model.hasher.table_ids(model.hasher.hash_all(tokens))[0, -1]  # [L, C]
        column = (r["order"] - 2) * c.n_heads + r["head"]
        assert int(ids[c.layer_ids.index(r["layer"]), column]) == r["row"], r
        assert r["reads"] == scanned.counts[r["row"]] and r["gate_mass"] == scanned.gate_sums[r["row"]]
        assert r["mean_gate"] == scanned.mean_gates[r["row"]]
        assert r["ngram_share"] == scanned.example_share[r["row"]]
        assert r["distinct_ngrams"] == scanned.distinct_ngrams[r["row"]]
        assert r["ngram"] == tokenizer.decode(r["ngram_tokens"], skip_special_tokens=False)


def test_top_rows_keep_rows_read_min_reads_times_and_show_an_ngram_once_per_layer_and_order(model, scanned):
    reads = scanned.counts[scanned.read_rows]
    floor = int(np.sort(reads)[-300])  # rows read this often or more: about 300
    steady = scanned.read_rows[scanned.counts[scanned.read_rows] >= floor]
    tokenizer = load_tokenizer()
    top = top_rows(model, scanned, tokenizer, top=steady.size, min_reads=floor)
    chosen = top["by_mean_gate"]
    assert min(r["reads"] for r in chosen) == floor
    keys = [(r["layer"], r["order"], tuple(r["ngram_tokens"])) for r in chosen]
    assert len(set(keys)) == len(keys)
    # every steady row is shown, or another head of its layer and order showed its n-gram
    assert len(chosen) < steady.size == len(top["by_reads"]) == len(top["by_gate_mass"])
    assert {r["row"] for r in chosen} < set(steady.tolist())
    score = [(-r["mean_gate"], r["row"]) for r in chosen]
    assert score == sorted(score)  # ties by row id
    few = top_rows(model, scanned, tokenizer, top=3, min_reads=floor)
    assert [len(v) for v in few.values()] == [3, 3, 3] and few["by_mean_gate"] == chosen[:3]


def test_rank_correlation_of_too_few_or_constant_values_is_nan():
    assert np.isnan(rank_correlation(np.array([1.0]), np.array([2.0])))
    assert rank_correlation(np.array([1.0, 2]), np.array([5.0, 3])) == pytest.approx(-1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division of zero by zero behind the NaN
        assert np.isnan(rank_correlation(np.array([1.0, 2, 3]), np.array([4.0, 4, 4])))
    # ties in the middle of a run: ranks [1, 2.5, 2.5, 4, 5]
    x, y = np.array([1.0, 3, 3, 4, 9]), np.array([1.0, 2, 3, 4, 5])
    assert rank_correlation(x, y) == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4, 5], y)[0, 1])
    assert rank_correlation(np.array([2, 1, 3]), np.array([1, 2, 3])) == pytest.approx(0.5)  # integers too


def test_a_scan_reads_its_rows_through_rows_for(model, held_out_pieces, scanned):
    from engram_offload.model.checkpoint_io import load_model, shipped_model_dir

    bare = load_model(shipped_model_dir(), table=False)  # no table of its own: every row comes from rows_for
    layers = model.engram_layers()
    got = scan(bare, held_out_pieces, lambda layer, ids: layers[layer].lookup(ids))
    assert np.array_equal(got.counts, scanned.counts) and np.array_equal(got.trace_gates, scanned.trace_gates)
    assert got.evaluation == scanned.evaluation


def test_top_rows_show_twenty_rows_read_three_times_or_more_by_default(model, scanned):
    tokenizer = load_tokenizer()
    default = top_rows(model, scanned, tokenizer)
    assert [len(v) for v in default.values()] == [20, 20, 20]
    assert default == top_rows(model, scanned, tokenizer, top=20, min_reads=3)
    assert min(r["reads"] for r in default["by_mean_gate"]) == 3  # rows read 3 times are among them


def test_a_row_at_a_layers_or_heads_first_row_is_described_as_that_layers_or_heads(model):
    """Rows on the boundaries of the flat row space, an example holding token 0 (the
    tokenizer's begin-of-sentence, decoded as it is) and a row without an example."""
    from engram_offload.model.evaluate import EvalResult
    from engram_offload.model.scan import ScanResult

    c = model.config
    n, rows = c.max_ngram_size, c.num_rows
    second = c.layer_row_bases[1]  # layer 2's first row: its head 0 of order 2
    head1 = c.head_offsets(c.layer_ids[0])[1]  # layer 1's order-2 head 1
    counts, examples = np.zeros(rows, np.int64), np.full((rows, n), -1, np.int64)
    counts[[second, head1, 7]] = [9, 8, 7]
    examples[second, -2:] = [0, 5]
    examples[head1, -2:] = [11, 12]
    result = ScanResult(rows, counts, counts * 0.5, examples, (counts > 0) * 1.0, (counts > 0).astype(np.int64),
                        np.zeros(0, np.int64), np.zeros(0, np.float32), EvalResult(1, 1.0, np.e))
    tokenizer = load_tokenizer()
    got = top_rows(model, result, tokenizer, top=5, min_reads=1)["by_reads"]
    assert [(r["row"], r["layer"], r["order"], r["head"]) for r in got] == [
        (second, c.layer_ids[1], 2, 0), (head1, c.layer_ids[0], 2, 1), (7, c.layer_ids[0], 2, 0)]
    assert got[0]["ngram_tokens"] == [0, 5] and got[0]["ngram"] == tokenizer.decode([0, 5], skip_special_tokens=False)
    assert got[0]["ngram"] != tokenizer.decode([0, 5], skip_special_tokens=True)
    assert (got[2]["ngram_tokens"], got[2]["ngram"]) == ([], "")


def test_plot_scan_writes_a_png_of_the_figure_size(scanned, tmp_path):
    import struct

    from engram_offload.model.scan import plot_scan

    path = plot_scan(scanned, str(tmp_path / "scan.png"), 0.25)
    assert path == tmp_path / "scan.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (770, 495)  # 7 x 4.5 inches at 110 dpi


def test_the_shipped_filter_knows_the_ngrams_of_common_python(model):
    """The keys and their bit positions are those the shipped filter was written with: every
    2- and 3-gram within a few everyday lines of Python is in it (not those reaching before the
    text, which training saw only where a window started there; about 11% of its bits are set,
    so a key hashed any other way passes all three bits by chance about once in 700)."""
    from engram_offload.model.checkpoint_io import shipped_model_dir
    from engram_offload.model.ngrams import SeenNgrams, ngram_keys

    text = "import os\nimport sys\n\n\nclass Foo:\n    def __init__(self, name):\n        self.name = name\n"
    ids = np.array(load_tokenizer().encode(text, add_special_tokens=False).ids, np.int64)
    keys = ngram_keys(model.hasher, ids[None])
    assert keys.dtype == np.uint64 and keys.shape == (1, ids.size, model.config.max_ngram_size - 1)
    shipped = SeenNgrams.load(shipped_model_dir())
    assert shipped is not None and 0.05 < shipped.bits.mean() < 0.2
    assert shipped.contains(keys[:, 2:]).all()
    # the order sits in the key's low three bits: 2 for 2-grams, 3 for 3-grams
    assert (keys[..., 0] % 8 == 2).all() and (keys[..., 1] % 8 == 3).all()
