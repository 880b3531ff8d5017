"""End to end with the trained model: its table converted and served from every tier gives
the same logits, bit for bit, as the checkpoint's own rows."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiers.tier_cases import direct_io_refused

from engram_offload.commands import model as model_commands
from engram_offload.model.checkpoint_io import load_model, shipped_model_dir, twin_dir
from engram_offload.model.corpus import OUT_OF_DOMAIN, find_sources
from engram_offload.model.evaluate import (
    EvalResult,
    GateNovelty,
    batches,
    combined,
    compare,
    evaluate,
    store_rows,
    windows,
)
from engram_offload.model.ngrams import SeenNgrams, ngram_keys
from engram_offload.model.serving import served_table


def _logits(model, pieces, rows_for=None) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(chunk[:, :-1], rows_for) for chunk in batches(pieces, 8)]


@pytest.mark.parametrize("tier,cache", [("memory", 0), ("mmap", 0), ("mmap", 1 << 16), ("direct", 1 << 16)])
def test_tiers_give_bit_identical_logits(model_dir, model, held_out_pieces, tmp_path, tier, cache):
    if tier == "direct" and direct_io_refused(tmp_path):
        pytest.skip(f"O_DIRECT refused on {tmp_path}")
    expected = _logits(model, held_out_pieces)
    served = load_model(model_dir, table=False)
    from engram_offload.engram.config import EngramConfig
    from engram_offload.table.convert import convert_checkpoint

    table = convert_checkpoint(model_dir, tmp_path / "t.engram", EngramConfig.from_hf_config(model_dir), progress=False)
    with served_table(model_dir, tier, table=table, cache_bytes=cache) as store:
        got = _logits(served, held_out_pieces, store_rows(store, served))
        if cache:
            assert store.stats()["store"]["hit_rate"] > 0
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_table_is_worth_something_on_held_out_text(model, held_out_pieces):
    on = evaluate(model, held_out_pieces)
    model.set_gate_scale(0.0)
    try:
        off = evaluate(model, held_out_pieces)
    finally:
        model.set_gate_scale(None)
    assert on.tokens == off.tokens > 2000
    assert on.perplexity < off.perplexity
    assert on.perplexity < 200  # a model that learned something (the vocabulary has 2,048 tokens)


def test_gate_zero_leaves_the_hidden_state_unchanged(model):
    layer = model.engram_layers()[model.config.layer_ids[0]]
    c = model.config
    h = torch.randn(2, 5, c.hc_mult, c.hidden_size)
    rows = torch.randn(2, 5, c.cols_per_layer, c.head_dim)
    layer.gate_scale = 0.0
    try:
        assert torch.equal(layer(h, rows=rows), h)
        assert torch.count_nonzero(layer.last_gate) == 0
    finally:
        layer.gate_scale = None
    assert not torch.equal(layer(h, rows=rows), h)


def _run(argv: list[str], capsys) -> str:
    parser = argparse.ArgumentParser()
    model_commands.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_eval_command_prints_tokens_and_perplexity(capsys):
    on = json.loads(_run(["eval", "--json", "--max-tokens", "1500"], capsys))
    off = json.loads(_run(["eval", "--json", "--max-tokens", "1500", "--lesion"], capsys))
    served = json.loads(_run(["eval", "--json", "--max-tokens", "1500", "--tier", "mmap", "--cache-bytes", "64KiB"], capsys))
    assert on["tokens"] == off["tokens"] == served["tokens"] > 1000
    assert served["perplexity"] == on["perplexity"] < off["perplexity"]
    assert (on["engram"], off["engram"], served["tier"]) == (True, False, "mmap")


def test_every_reading_command_takes_the_same_model_text_and_json_options(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    model_commands.register(parser.add_subparsers(dest="command"))
    shared = ["--checkpoint", "M", "--corpus", "C", "--all-files", "--max-tokens", "7", "--seq-len", "9",
              "--threads", "2", "--json", "--json-out", "out.json"]
    for command in ("eval", "scan", "cache-sim", "skip-curve"):
        args = parser.parse_args([command, *shared])
        assert (args.checkpoint, args.corpus, args.all_files, args.max_tokens, args.seq_len, args.threads, args.json,
                args.json_out) == ("M", ["C"], True, 7, 9, 2, True, "out.json"), command


def test_eval_command_writes_the_json_it_prints(tmp_path, capsys):
    out = tmp_path / "eval.json"
    printed = json.loads(_run(["eval", "--json", "--max-tokens", "1500", "--json-out", str(out)], capsys))
    assert json.loads(out.read_text()) == printed


def test_the_shipped_model_beats_its_twin_and_its_lesion_on_every_kind_installed(capsys):
    """On held-out files of each kind of text installed here (code alone on a bare machine), the
    model with its table beats the twin trained without one and the model with its gate at 0."""
    record = json.loads(_run(["eval", "--json", "--max-tokens", "9000"], capsys))
    assert record["twin"] is not None, "the twin without Engram ships beside the model"
    for kind, row in record["by_kind"].items():
        assert row["engram"]["tokens"] == row["twin"]["tokens"] == row["lesion"]["tokens"] > 1000, kind
        assert row["engram"]["perplexity"] < row["twin"]["perplexity"], kind
        assert row["engram"]["perplexity"] < row["lesion"]["perplexity"], kind
    assert record["twin_over_engram"] > 1 and record["lesion_over_engram"] > 1


def test_windows_overlap_by_one_token_and_keep_the_tail():
    ten, nine = np.arange(10), np.arange(100, 109)
    got = windows([ten, np.arange(1), np.arange(0), nine], 4)
    # each window's last token is the next one's first; a tail of two tokens is a window, of one is not
    assert [w.tolist() for w in got] == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9],
                                         [100, 101, 102, 103, 104], [104, 105, 106, 107, 108]]
    assert windows([np.arange(2)], 4)[0].tolist() == [0, 1]


def test_batches_group_equal_lengths_longest_first():
    pieces = [np.full(3, 1), np.full(5, 2), np.full(5, 3), np.full(3, 4), np.full(5, 5)]
    got = [b.tolist() for b in batches(pieces, 2)]
    assert got == [[[2] * 5, [3] * 5], [[5] * 5], [[1] * 3, [4] * 3]]


def test_store_rows_reads_each_layer_at_its_base(model):
    c = model.config
    asked: list[np.ndarray] = []

    class Store:
        def gather(self, ids: np.ndarray) -> torch.Tensor:
            asked.append(ids)
            return torch.zeros(*ids.shape, c.head_dim)

    rows_for = store_rows(Store(), model)
    ids = torch.tensor([[[0, 1, 2]]])
    for layer, base in zip(c.layer_ids, c.layer_row_bases):
        assert rows_for(layer, ids).shape == (1, 1, 3, c.head_dim)
        assert asked[-1].tolist() == [[[base, base + 1, base + 2]]]
    assert len(set(c.layer_row_bases)) == len(c.layer_ids) > 1  # the layers' bases differ


def test_evaluate_is_the_mean_cross_entropy_of_every_target(model, held_out_pieces):
    """Every window's every target counts once, whatever the batching; the hooks see each batch."""
    full = [p for p in held_out_pieces if p.size == 65]
    pieces = full[:5] + [full[5][:9], full[6][:9], full[7][:2]]
    total, count = 0.0, 0
    with torch.no_grad():
        for p in pieces:
            chunk = torch.from_numpy(p[None])
            logits = model(chunk[:, :-1])
            total += float(F.cross_entropy(logits[0], model.to_model_ids(chunk[0, 1:]), reduction="sum"))
            count += p.size - 1
    seen: list[tuple] = []
    result = evaluate(model, pieces, batch=2, on_batch=lambda i, r, lg: seen.append((i.shape, r.shape, lg.shape)))
    assert result.tokens == count == 5 * 64 + 2 * 8 + 1
    assert result.nll == pytest.approx(total / count, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.nll), rel=1e-12)
    c = model.config
    L, C, K = len(c.layer_ids), c.cols_per_layer, model.vocab_size
    assert seen == [((2, 64), (2, 64, L, C), (2, 64, K))] * 2 + [((1, 64), (1, 64, L, C), (1, 64, K)),
                                                                ((2, 8), (2, 8, L, C), (2, 8, K)),
                                                                ((1, 1), (1, 1, L, C), (1, 1, K))]
    assert evaluate(model, pieces, batch=16).nll == pytest.approx(result.nll, rel=1e-5)

    def lesion(inputs: torch.Tensor, row_ids: torch.Tensor) -> None:  # before each forward
        assert torch.equal(row_ids, model.row_ids(inputs))
        model.set_gate_scale(0.0)

    try:
        lesioned = evaluate(model, pieces, before_batch=lesion)
        model.set_gate_scale(0.0)
        assert lesioned == evaluate(model, pieces)
    finally:
        model.set_gate_scale(None)
    assert lesioned.nll != result.nll
    with pytest.raises(ValueError, match="no window of two or more tokens"):
        evaluate(model, windows([np.arange(1)], 8))


def test_combined_weights_each_result_by_its_tokens():
    got = combined([EvalResult(10, 1.0, math.e), EvalResult(30, 2.0, math.e ** 2)])
    assert got == EvalResult(40, 1.75, math.exp(1.75))
    assert combined([EvalResult(1, 2.0, math.e ** 2)]) == EvalResult(1, 2.0, math.exp(2.0))
    assert combined([]) == EvalResult(0, 0.0, 1.0)
    assert got.to_dict() == {"tokens": 40, "nll": 1.75, "perplexity": math.exp(1.75)}


def test_compare_lesions_every_gate_and_combines_the_kinds(model, held_out_pieces):
    kinds = {"first": held_out_pieces[:3], "second": held_out_pieces[3:7]}
    twin = load_model(twin_dir(shipped_model_dir()))
    got = compare(model, twin, kinds)
    assert list(got) == ["first", "second", "all"]
    assert all(layer.gate_scale is None for layer in model.engram_layers().values())  # the lesion is undone
    for kind, pieces in kinds.items():
        assert got[kind]["engram"] == evaluate(model, pieces)
        assert got[kind]["twin"] == evaluate(twin, pieces)
        model.set_gate_scale(0.0)
        try:
            assert got[kind]["lesion"] == evaluate(model, pieces)
        finally:
            model.set_gate_scale(None)
        assert len({got[kind][name].nll for name in ("engram", "lesion", "twin")}) == 3
    for name in ("engram", "lesion", "twin"):
        assert got["all"][name] == combined([got["first"][name], got["second"][name]])
    # a model without its table reads every row, its lesion's too, through rows_for
    bare = load_model(shipped_model_dir(), table=False)
    layers = model.engram_layers()
    alone = compare(bare, None, {"first": kinds["first"]}, lambda layer, ids: layers[layer].lookup(ids))
    assert list(alone["first"]) == list(alone["all"]) == ["engram", "lesion"]
    assert alone["all"]["engram"] == got["first"]["engram"] and alone["all"]["lesion"] == got["first"]["lesion"]


def test_gate_novelty_splits_the_gate_by_whether_training_saw_the_ngram(model, model_dir, held_out_pieces):
    pieces = held_out_pieces[:6]
    gates: list[torch.Tensor] = []
    every = SeenNgrams()
    for chunk in batches(pieces, 4):
        every.add(ngram_keys(model.hasher, chunk[:, :-1]))
    runs = {name: GateNovelty(model, seen) for name, seen in
            (("every", every), ("none", SeenNgrams()), ("trained", SeenNgrams.load(model_dir)))}

    def record(*batch) -> None:
        gates.append(torch.stack(list(model.gates().values())).mean(dim=(0, -1)).flatten())
        for novelty in runs.values():
            novelty(*batch)

    evaluate(model, pieces, batch=4, on_batch=record)
    mean = float(torch.cat(gates).double().mean())
    every_seen, none_seen, trained = (runs[n].summary() for n in ("every", "none", "trained"))
    assert every_seen["unseen_share"] == [0.0, 0.0] and every_seen["gate_seen"] == pytest.approx([mean, mean])
    assert none_seen["unseen_share"] == [1.0, 1.0] and none_seen["gate_unseen"] == pytest.approx([mean, mean])
    assert 0 < trained["unseen_share"][0] <= trained["unseen_share"][1] < 1  # an unseen 2-gram's 3-gram is unseen
    assert all(0 < g < 1 for g in trained["gate_unseen"] + trained["gate_seen"])
    assert trained["gate_unseen"][0] < 0.8 * trained["gate_seen"][0]  # trained to close on rows not its n-gram's


def test_eval_reports_each_out_of_domain_source_or_why_it_is_skipped(capsys):
    record = json.loads(_run(["eval", "--json", "--max-tokens", "3000"], capsys))
    installed = {s.label for s in find_sources(OUT_OF_DOMAIN)[0]}
    assert set(record["out_of_domain"]) == installed
    assert record["out_of_domain_skipped"] == {s.label: f"not installed (apt-get install {s.package})"
                                               for s in OUT_OF_DOMAIN if s.label not in installed}
    for row in [*record["out_of_domain"].values(), *(v for k, v in record["by_kind"].items() if k != "all")]:
        assert row["engram"]["tokens"] == row["twin"]["tokens"] == row["lesion"]["tokens"] > 300
        assert set(row["engram"]["gates"]) == {"unseen_share", "gate_unseen", "gate_seen"}
    assert record["tokens"] == record["by_kind"]["all"]["engram"]["tokens"]  # the unseen sources stand apart
    printed = _run(["eval", "--max-tokens", "3000"], capsys)
    assert all(f"unseen:{label}" in printed for label in ("fortunes", "devil"))
    assert "gate on unseen / seen 2-grams, 3-grams" in printed


def test_eval_cache_names_what_cache_bytes_takes_in_one_line(capsys):
    parser = argparse.ArgumentParser(prog="engram-offload")
    model_commands.register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["eval", "--cache", "10%"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("error: --cache was removed; use --cache-bytes SIZE with --tier (bytes: 256KiB, 512M, 2G; "
                        "not a percentage)"), err
