"""Training is seeded end to end: the same seed writes the same bytes."""

from __future__ import annotations

import json
import math
import shutil
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_offload.model.corpus import corpus_files, missing_sources_message, split
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
    assert model_vocabulary([np.array([9, 4, 4])], 10).tolist() == [4, 9]  # ids seen once kept, unseen never
    assert model_vocabulary([np.array([9, 4, 4])], 10).dtype == torch.int64
    empty = model_vocabulary([], 4)
    assert empty.tolist() == [] and empty.dtype == torch.int64


def test_held_out_split_is_by_file_and_stable(small_corpus):
    files = corpus_files([small_corpus])
    train_files, held = split(files)
    assert {f.name for f in train_files}.isdisjoint(f.name for f in held)
    assert len(train_files) + len(held) == len(files)
    assert split(corpus_files([small_corpus]))[1] == held


def test_the_twin_without_engram_starts_from_the_same_backbone():
    from engram_offload.engram.tokenizer import cached_token_map
    from engram_offload.model.lm import EngramLM

    token_map = cached_token_map()
    config = _tiny_config(compressed_vocab_size=int(token_map.max()) + 1)
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


def _tiny_config(**changes):
    from engram_offload.engram.config import EngramConfig

    fields = dict(layer_ids=(1,), max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=(211, 211), pad_id=2,
                  hidden_size=32, hc_mult=2, variant="v4.1", row_format="fp8_e4m3_ue8m0", compressed_vocab_size=1000)
    return EngramConfig(**{**fields, **changes})


def test_the_learning_rate_warms_up_then_decays_to_a_tenth_on_a_cosine():
    from engram_offload.model.train import _lr_factor

    s = TrainSettings(steps=110, warmup=10)
    assert [_lr_factor(step, s) for step in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert [_lr_factor(step, s) for step in (10, 60, 110)] == pytest.approx([1.0, 0.55, 0.1])
    assert _lr_factor(35, s) == pytest.approx(0.1 + 0.45 * (1 + np.cos(np.pi / 4)))
    short = TrainSettings(steps=3, warmup=3)  # no decay steps: the progress counts steps past the warmup
    assert [_lr_factor(step, short) for step in (2, 3, 4)] == pytest.approx([1.0, 1.0, 0.1])


def test_dense_weights_and_table_rows_have_their_own_optimizer_on_one_schedule():
    from engram_offload.model.train import _lr_factor, _optimizers

    s = TrainSettings(steps=20, warmup=4, lr=3e-3, table_lr=1e-2)
    model, table = torch.nn.Linear(3, 2), torch.nn.Embedding(10, 4, sparse=True)
    optimizers, schedules = _optimizers(model, {1: table}, s)
    dense, rows = optimizers
    assert type(dense) is torch.optim.AdamW and type(rows) is torch.optim.SparseAdam
    assert [p for g in dense.param_groups for p in g["params"]] == list(model.parameters())
    assert [p for g in rows.param_groups for p in g["params"]] == [table.weight]
    assert dense.param_groups[0]["weight_decay"] == 0.01
    for step in range(6):
        assert dense.param_groups[0]["lr"] == pytest.approx(3e-3 * _lr_factor(step, s))
        assert rows.param_groups[0]["lr"] == pytest.approx(1e-2 * _lr_factor(step, s))
        for optimizer, schedule in zip(optimizers, schedules):
            optimizer.step()  # no gradients: nothing moves, the schedule counts the step
            schedule.step()
    assert len(_optimizers(model, {}, s)[0]) == 1


def test_row_reads_mark_what_training_read_and_drop_a_share_to_rows_of_the_same_head():
    from engram_offload.model.train import _RowReads

    config = _tiny_config()
    rows = config.rows_per_layer[1]
    torch.manual_seed(1)  # ids where no dropped read draws its own row again
    table = torch.nn.Embedding(rows, 32)
    ids = torch.tensor(config.head_offsets(1)) + torch.randint(0, min(config.head_sizes(1)), (4, 50, 4))  # [B, T, C]
    plain = _RowReads(config, {1: table}, 0.0, torch.Generator().manual_seed(0))
    assert torch.equal(plain(1, ids), table(ids)) and not plain.written[1].any()  # not training: nothing marked
    plain.training = True
    assert torch.equal(plain(1, ids), table(ids))
    assert plain.written[1].nonzero().flatten().tolist() == ids.unique().tolist()

    dropping = _RowReads(config, {1: table}, 0.5, torch.Generator().manual_seed(0))
    dropping.training = True
    got = dropping(1, ids)
    same = (got == table(ids)).all(dim=-1)  # [B, T, C]: reads that got their own row
    assert 0.35 < 1 - same.float().mean() < 0.65
    assert dropping.written[1].nonzero().flatten().tolist() == ids[same].unique().tolist()
    offsets, sizes = torch.tensor(config.head_offsets(1)), torch.tensor(config.head_sizes(1))
    for b, t, c in (~same).nonzero().tolist():  # each dropped read holds a row of its own head
        matches = (table.weight == got[b, t, c]).all(dim=1).nonzero().flatten()
        assert ((matches >= offsets[c]) & (matches < offsets[c] + sizes[c])).any()
    got.sum().backward()
    assert table.weight.grad is not None and table.weight.grad[~dropping.written[1]].abs().sum() == 0
    again = _RowReads(config, {1: table}, 0.5, torch.Generator().manual_seed(0))
    again.training = True
    assert torch.equal(again(1, ids), got)  # the generator given decides the drops


def test_a_batch_is_windows_of_seq_len_plus_one_at_seeded_starts():
    from engram_offload.model.train import _batch

    stream = torch.arange(100)
    s = TrainSettings(batch=5, seq_len=8)
    chunk = _batch(stream, s, torch.Generator().manual_seed(1))
    assert chunk.shape == (5, 9)
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 9)) for row in chunk)
    assert torch.equal(_batch(stream, s, torch.Generator().manual_seed(1)), chunk)
    starts = torch.cat([_batch(stream, s, torch.Generator().manual_seed(i))[:, 0] for i in range(200)])
    assert int(starts.min()) == 0 and int(starts.max()) == 100 - 8 - 2  # every window fits, next token too


def test_a_step_returns_the_batch_loss_before_it_and_clips_the_gradient_to_norm_one():
    from engram_offload.engram.tokenizer import cached_token_map
    from engram_offload.model.lm import EngramLM
    from engram_offload.model.train import _lr_factor, _optimizers, _step

    token_map = cached_token_map()
    config = _tiny_config(compressed_vocab_size=int(token_map.max()) + 1)
    torch.manual_seed(0)
    model = EngramLM(config, torch.arange(3, 66), token_map, 2, 2, table=False, engram=False)
    s = TrainSettings(steps=10, warmup=2, lr=1e-2)
    optimizers, schedules = _optimizers(model, {}, s)
    chunk = torch.randint(3, 66, (2, 17))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(chunk[:, :-1], None).flatten(0, 1),
                                                     model.to_model_ids(chunk[:, 1:]).reshape(-1))
    before = [p.detach().clone() for p in model.parameters()]
    assert _step(model, optimizers, schedules, chunk, None) == pytest.approx(float(expected))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) == pytest.approx(1.0)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * _lr_factor(1, s))
    fresh = EngramLM(config, torch.arange(3, 66), token_map, 2, 2, table=False, engram=False)
    fresh.load_state_dict(model.state_dict())  # the gradients of the next step start from zero: a fresh copy's
    torch.nn.functional.cross_entropy(fresh(chunk[:, :-1], None).flatten(0, 1),
                                      fresh.to_model_ids(chunk[:, 1:]).reshape(-1)).backward()
    torch.nn.utils.clip_grad_norm_(fresh.parameters(), 1.0)
    _step(model, optimizers, schedules, chunk, None)
    for mine, theirs in zip(model.parameters(), fresh.parameters()):
        assert torch.allclose(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)


def test_interleave_takes_one_of_each_in_turn():
    from engram_offload.model.train import _interleave, _jsonable, _stream

    assert _interleave([[1, 2, 3], [4], [5, 6]]) == [1, 4, 5, 2, 6, 3]
    assert _interleave([]) == [] and _interleave([[], [7]]) == [7]
    assert _jsonable({"a": (1, 2), "b": [3], "c": 4}) == {"a": [1, 2], "b": [3], "c": 4}
    assert _stream([np.array([5, 6]), np.array([7])]).tolist() == [5, 6, 1, 7, 1]  # 1: end of text


def test_training_records_its_settings_data_and_losses(small_corpus, tmp_path):
    lines: list[str] = []
    settings = tiny(5, small_corpus)
    settings.steps, settings.eval_every = 4, 3
    started = time.perf_counter()
    result = train(settings, tmp_path / "m", progress=False, log=lines.append)
    wall = time.perf_counter() - started
    train_files, held = split(corpus_files([small_corpus]))
    assert lines == [f"tokenizing {len(train_files):,} training files (up to 20,000 tokens, shared by kind and source) "
                     f"and {len(held):,} held-out files"]
    assert ["held_out_loss" in r for r in result.history] == [False, False, True, True]  # every 3 steps and the last
    meta = json.loads((result.path / "training.json").read_text())
    assert meta["settings"]["engram_layers"] == [1] and meta["settings"]["corpus"] == [str(small_corpus)]
    assert meta["train_tokens"] == result.train_tokens and meta["history"] == result.history
    assert meta["train_files"] == len(train_files) and meta["held_out_files"] == len(held)
    kinds = meta["train_tokens_by_kind"]
    assert list(kinds) == ["code"] and kinds["code"] == 20_000
    assert result.train_tokens == 20_000 + meta["train_tokens"] - kinds["code"]  # with one end-of-text a file
    assert 0 < result.seconds < wall


def test_a_corpus_too_small_to_split_and_bad_table_init_are_refused(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.py").write_text("x = 1\n" * 100)
    settings = tiny(0, one)
    train_files, held = split(corpus_files([one]))
    with pytest.raises(ValueError, match=f"the corpus has {len(train_files)} training and {len(held)} held-out files: "
                                         "give a corpus of at least a few dozen files"):
        train(settings, tmp_path / "m", progress=False, log=lambda m: None)
    settings.table_init = "uniform"
    with pytest.raises(ValueError, match="table_init must be 'normal' or 'zero', got 'uniform'"):
        train(settings, tmp_path / "m", progress=False, log=lambda m: None)
    settings.table_init = "normal"
    for bad in (-0.1, 1.0):
        settings.row_dropout = bad
        with pytest.raises(ValueError, match=rf"row_dropout must be in \[0, 1\), got {bad}"):
            train(settings, tmp_path / "m", progress=False, log=lambda m: None)


def test_missing_sources_are_warned_of_only_when_training_on_every_source(small_corpus, tmp_path, monkeypatch):
    import engram_offload.model.train as train_module
    from engram_offload.model.corpus import Source

    gone = Source("gone", "prose", tmp_path / "gone", ("*.txt",), "gone-doc", "GPL-2+")
    monkeypatch.setattr(train_module, "find_sources", lambda: ([], [gone]))
    monkeypatch.setattr(train_module, "corpus_files",
                        lambda roots: corpus_files([small_corpus] if roots is None else roots))
    logged, warned = [], []
    settings = tiny(0, small_corpus)
    settings.steps = 1
    train(settings, tmp_path / "given", progress=False, log=logged.append, warn=warned.append)
    assert warned == [] and len(logged) == 1
    settings.corpus = None
    train(settings, tmp_path / "every", progress=False, log=logged.append, warn=warned.append)
    assert warned == [missing_sources_message([gone])]
    train(settings, tmp_path / "log", progress=False, log=logged.append)
    assert logged[-2] == missing_sources_message([gone])  # without warn, the log says it


def test_progress_lines_carry_the_latest_losses(small_corpus, tmp_path, capsys):
    settings = tiny(0, small_corpus)
    train(settings, tmp_path / "m", log=lambda m: None)  # progress is on by default
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("training steps: 3 of 3 (100%)  loss ") and " held-out " in err[-1]
    assert "nan" not in err[-1]


def test_the_loss_figure_draws_both_losses_with_labels_and_its_png_is_770_by_440(tmp_path):
    import struct

    import matplotlib.pyplot as plt

    from engram_offload.model.train import loss_figure

    history = [{"step": 1, "train_loss": 5.0}, {"step": 2, "train_loss": 4.0, "held_out_loss": 4.5},
               {"step": 3, "train_loss": 3.5, "held_out_loss": 4.2}]
    fig = loss_figure(history, "a title")
    try:
        (ax,) = fig.axes
        train_line, held_line = ax.get_lines()
        assert train_line.get_xdata().tolist() == [1, 2, 3] and train_line.get_ydata().tolist() == [5.0, 4.0, 3.5]
        assert (train_line.get_linewidth(), train_line.get_alpha(), train_line.get_label()) == (0.8, 0.7,
                                                                                                 "training batch")
        assert held_line.get_xdata().tolist() == [2, 3] and held_line.get_ydata().tolist() == [4.5, 4.2]
        assert (held_line.get_marker(), held_line.get_linestyle(), held_line.get_label()) == ("o", "-",
                                                                                               "held-out files")
        assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("step", "cross-entropy (nats/token)", "a title")
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["training batch", "held-out files"]
        grid = ax.xaxis.get_gridlines()[0]
        assert grid.get_visible() and grid.get_alpha() == 0.3
        assert tuple(fig.get_size_inches()) == (7, 4)
        assert ax.get_position().x0 < 0.125 - 0.01  # laid out tight: narrower margins than matplotlib's default
    finally:
        plt.close(fig)
    assert len(loss_figure(history[:1]).axes[0].get_lines()) == 1  # no held-out loss yet: one line
    assert loss_figure(history[:1]).axes[0].get_title() == "EngramLM training"
    plt.close("all")
    png = plot_losses(history, tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (770, 440)
    assert plt.get_fignums() == []  # closed


def test_the_saved_plot_is_the_figure_of_the_title_given(tmp_path, monkeypatch):
    import matplotlib.figure

    titles = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (titles.append(fig.axes[0].get_title()), save(fig, *a, **k))[1])
    history = [{"step": 1, "train_loss": 5.0}]
    plot_losses(history, tmp_path / "a.png", "my run")
    plot_losses(history, tmp_path / "b.png")
    assert titles == ["my run", "EngramLM training"]


def test_progress_is_a_line_off_a_terminal_a_bar_on_one_and_nothing_when_off(monkeypatch, capsys):
    import engram_offload.model.train as train_module

    threads = set(threading.enumerate())
    with train_module._progress(False, 5) as off:
        off(4, {"train_loss": 1.0})
        assert set(threading.enumerate()) - threads == set()  # no bar refreshing in the background
    assert capsys.readouterr().err == ""
    with train_module._progress(True, 2000) as lines:
        lines(1998, {"train_loss": 2.0, "held_out_loss": 3.0})
        lines(1999, {"train_loss": 1.0})
    assert capsys.readouterr().err.splitlines()[-1] == \
        "training steps: 2,000 of 2,000 (100%)  loss 1.000  held-out 3.000"
    monkeypatch.setattr(train_module, "on_terminal", lambda: True)
    with train_module._progress(True, 5) as bar:
        assert bar._lines is None
        (task,) = bar._bar.tasks
        assert task.fields["losses"] == ""  # no loss before the first step
        bar(0, {"train_loss": 2.5})
        assert (task.description, task.total, task.completed, task.fields["losses"]) == (
            "train", 5, 1, "loss 2.500  held-out nan")
        bar(3, {"train_loss": 1.5, "held_out_loss": 1.75})
        assert (task.completed, task.fields["losses"]) == (4, "loss 1.500  held-out 1.750")
        columns = [type(c).__name__ for c in bar._bar.columns]
        assert columns == ["TextColumn", "BarColumn", "MofNCompleteColumn", "TextColumn", "TimeRemainingColumn"]
        assert bar._bar.columns[0].text_format == "training"
        assert bar._bar.columns[3].text_format == "{task.fields[losses]}"
        assert bar._bar.live.is_started
    assert not bar._bar.live.is_started  # stopped on leaving


def test_held_out_files_are_read_up_to_four_windows_of_tokens_each(small_corpus, tmp_path, monkeypatch):
    import engram_offload.model.train as train_module

    budgets = []
    real = train_module.kind_sequences
    monkeypatch.setattr(train_module, "kind_sequences",
                        lambda files, tokenizer, max_tokens: (budgets.append(max_tokens),
                                                              real(files, tokenizer, max_tokens))[1])
    settings = tiny(0, small_corpus)
    settings.steps = 1
    train(settings, tmp_path / "m", progress=False, log=lambda m: None)
    assert budgets == [20_000, 2 * 32 * 4]  # the training budget, then eval_windows * seq_len * 4


def test_a_trained_model_keeps_its_settings_its_batches_and_the_ngrams_it_saw(small_corpus, tmp_path, monkeypatch):
    """The saved config is the settings'; the twin and the model train on the same batches; the
    seen n-grams are those of every batch's inputs; unwritten rows keep their initial spread."""
    import engram_offload.model.train as train_module
    from engram_offload.model.checkpoint_io import load_model, written_rows
    from engram_offload.model.ngrams import SeenNgrams

    batches: list[torch.Tensor] = []
    inputs: list[torch.Tensor] = []
    real_batch, real_keys = train_module._batch, train_module.ngram_keys
    monkeypatch.setattr(train_module, "_batch", lambda *a: batches.append(real_batch(*a)) or batches[-1])
    monkeypatch.setattr(train_module, "ngram_keys", lambda hasher, ids: inputs.append(ids) or real_keys(hasher, ids))
    result = train(tiny(5, small_corpus), tmp_path / "m", progress=False, log=lambda m: None)
    assert len(batches) == len(inputs) == 3
    assert all(torch.equal(chunk[:, :-1], ids) for chunk, ids in zip(batches, inputs))
    model = load_model(result.path)
    config = model.config
    assert (config.hidden_size, config.hc_mult, config.row_format, config.pad_id) == (32, 2, "fp8_e4m3_ue8m0", 2)
    assert (config.layer_ids, config.n_heads, config.head_dim, config.max_ngram_size, config.prime_starts) == (
        (1,), 2, 32, 3, (211, 211))
    seen = SeenNgrams.load(result.path)
    expected = SeenNgrams()
    for ids in inputs:
        expected.add(real_keys(model.hasher, ids))
    assert seen is not None and np.array_equal(seen.bits, expected.bits)
    rows = model.engram_layers()[1].lookup(torch.arange(config.rows_per_layer[1]))  # [rows, d]
    unwritten = rows[~torch.from_numpy(written_rows(result.path))]
    assert 0.08 < float(unwritten.float().std()) < 0.12  # table_init_std 0.1

    model_batches = list(batches)
    batches.clear()
    settings = tiny(5, small_corpus)
    settings.engram = False
    train(settings, tmp_path / "t", progress=False, log=lambda m: None)
    assert len(batches) == 3 and all(torch.equal(a, b) for a, b in zip(batches, model_batches))
    assert len(inputs) == 3  # the twin has no n-grams to record


def test_row_dropout_leaves_a_share_of_the_rows_read_unwritten(small_corpus, tmp_path):
    from engram_offload.model.checkpoint_io import written_rows

    written = {}
    for dropout in (0.0, 0.5):
        settings = tiny(5, small_corpus)
        settings.row_dropout, settings.unseen_rate = dropout, 0.0
        written[dropout] = int(written_rows(train(settings, tmp_path / str(dropout), progress=False,
                                                  log=lambda m: None).path).sum())
    assert 0.3 * written[0.0] < written[0.5] < 0.8 * written[0.0]


def test_a_model_and_its_twin_start_from_the_same_backbone(small_corpus, tmp_path):
    """Saved before any step (``steps=0``), the model's backbone shard and its twin's backbone are
    the same bytes: the Engram layers draw from the seed only after the backbone."""
    from safetensors.torch import load_file

    settings = tiny(5, small_corpus)
    settings.steps = 0
    model = train(settings, tmp_path / "m", progress=False, log=lambda m: None)
    settings.engram = False
    twin = train(settings, tmp_path / "t", progress=False, log=lambda m: None)
    assert model.history == twin.history == []
    backbone = load_file(model.path / "model-00001-of-00002.safetensors")
    twin_weights = load_file(twin.path / "model.safetensors")
    assert backbone.keys() == twin_weights.keys()
    assert all(torch.equal(backbone[k], twin_weights[k]) for k in backbone)


def test_unseen_ngrams_read_random_rows_of_their_heads_in_every_column_of_their_order():
    """A position's unseen 2-gram makes its 3-gram unseen too; an unseen order reads random rows of
    each head's own range (detached), the others their own rows; only these are marked written."""
    from engram_offload.model.train import _RowReads

    config = _tiny_config()
    torch.manual_seed(0)
    table = torch.nn.Embedding(config.rows_per_layer[1], 32)
    offsets, sizes = torch.tensor(config.head_offsets(1)), torch.tensor(config.head_sizes(1))
    ids = offsets + torch.randint(0, int(sizes.min()), (4, 200, 4))  # [B, T, C]: 2-gram heads, then 3-gram heads
    reads = _RowReads(config, {1: table}, 0.0, torch.Generator().manual_seed(0), unseen_rate=0.2)
    reads.training = True
    reads.draw(4, 200)
    assert reads.unseen is not None and reads.unseen.shape == (4, 200, 2)
    unseen2, unseen3 = reads.unseen[..., 0], reads.unseen[..., 1]
    assert bool((unseen3 | ~unseen2).all())  # an unseen 2-gram's 3-gram is unseen
    assert 0.12 < unseen2.float().mean() < 0.28 and 0.32 < unseen3.float().mean() < 0.48
    got = reads(1, ids)
    own = (got == table(ids)).all(dim=-1)  # [B, T, C]
    replaced = reads.unseen.repeat_interleave(2, dim=-1)
    assert bool((own | replaced).all()) and (~own).sum() > 0.95 * replaced.sum()
    for b, t, c in (~own).nonzero().tolist()[:50]:
        row = int((table.weight == got[b, t, c]).all(dim=1).nonzero()[0])
        assert offsets[c] <= row < offsets[c] + sizes[c]
    assert reads.written[1].nonzero().flatten().tolist() == ids[~replaced].unique().tolist()
    got.sum().backward()
    assert table.weight.grad is not None and table.weight.grad[~reads.written[1]].abs().sum() == 0


def test_the_gate_loss_is_the_gates_cross_entropy_against_the_share_of_orders_kept():
    from types import SimpleNamespace

    from engram_offload.model.train import _RowReads

    reads = _RowReads(_tiny_config(), {}, 0.0, torch.Generator())
    reads.unseen = torch.tensor([[[True, True], [False, True], [False, False]]])  # [1, 3, orders]
    gates = {1: torch.tensor([[[0.5, 0.7], [0.4, 0.2], [0.9, 0.9]]]), 2: torch.full((1, 3, 2), 0.1)}
    targets = [0.0, 0.5, 1.0]

    def bce(g: float, y: float) -> float:
        return -(y * math.log(g) + (1 - y) * math.log(1 - g))

    expected = [sum(bce(float(g[0, t, b]), targets[t]) for t in range(3) for b in range(2)) / 6 for g in gates.values()]
    assert float(reads.gate_loss(SimpleNamespace(gates=lambda: gates))) == pytest.approx(sum(expected) / 2)


def test_training_with_unseen_ngrams_is_seeded_and_refuses_bad_settings(small_corpus, tmp_path):
    """The same seed writes the same bytes with unseen n-grams and the gate loss on."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = []
        for name in ("a", "b"):
            settings = tiny(5, small_corpus)
            settings.unseen_rate, settings.gate_loss = 0.2, 1.0
            runs.append(train(settings, tmp_path / name, progress=False, log=lambda m: None))
    finally:
        torch.set_num_threads(threads)
    assert _bytes(runs[0].path) == _bytes(runs[1].path)
    assert json.loads((runs[0].path / "training.json").read_text())["settings"]["unseen_rate"] == 0.2
    settings = tiny(5, small_corpus)
    for bad in ({"unseen_rate": 0.6}, {"unseen_rate": -0.1}, {"gate_loss": -1.0}):
        for name, value in bad.items():
            setattr(settings, name, value)
        with pytest.raises(ValueError, match=r"unseen_rate must be in \[0, 1/2\] and gate_loss at least 0"):
            train(settings, tmp_path / "bad", progress=False, log=lambda m: None)
        settings.unseen_rate, settings.gate_loss = 0.0, 0.0
