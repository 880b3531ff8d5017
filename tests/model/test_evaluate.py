"""End to end with the trained model: its table converted and served from every tier gives
the same logits, bit for bit, as the checkpoint's own rows."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from tiers.tier_cases import direct_io_refused

from engram_offload.commands import model as model_commands
from engram_offload.model.checkpoint_io import load_model
from engram_offload.model.evaluate import batches, evaluate, store_rows
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
    off = json.loads(_run(["eval", "--json", "--max-tokens", "1500", "--no-engram"], capsys))
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
