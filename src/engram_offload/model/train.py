"""Train a small ``EngramLM`` on the CPU, on code, documentation and prose a Debian machine has
installed (``corpus.SOURCES``), or its twin without Engram (``TrainSettings.engram=False``).

Seeded end to end: the file shuffle, the initial weights, the batches and the optimizer
steps depend only on ``TrainSettings``; with one thread the saved bytes repeat exactly. A
model and its twin of the same settings see the same batches and start from the same
backbone weights. Engram tables train as float ``nn.Embedding`` s (sparse gradients,
``SparseAdam``) and are saved as fp8 rows with ue8m0 scales; ``wkv`` is saved as fp8 with
32x32 block scales. ``row_dropout`` trains with that share of row reads replaced by another
row of the same head (not trained by that read), as a read of an n-gram never seen in training
gets what colliding n-grams wrote: the gate may learn to close on rows that do not fit.
``unseen_rate`` reads whole n-grams as unseen: at that share of positions the 2-gram's rows (and so
the 3-gram's), at as many more the 3-gram's alone, are all replaced by random rows of their heads,
as an n-gram no training window held hashes to; ``gate_loss`` adds that weight times the gate's
binary cross-entropy as a detector of them (target: the share of the position's orders kept).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..engram.config import EngramConfig
from ..engram.tokenizer import cached_token_map, load_tokenizer
from ..table.progress import LineProgress, on_terminal
from .checkpoint_io import save_model
from .corpus import EOS_ID, corpus_files, find_sources, kind_sequences, missing_sources_message, split
from .evaluate import evaluate, windows
from .lm import EngramLM
from .ngrams import SeenNgrams, ngram_keys

__all__ = ["TrainSettings", "TrainResult", "train", "model_vocabulary", "plot_losses", "loss_figure"]


@dataclass
class TrainSettings:
    seed: int = 0
    steps: int = 2_000
    batch: int = 16
    seq_len: int = 128
    hidden: int = 64
    layers: int = 3
    attention_heads: int = 4
    engram_layers: tuple[int, ...] = (1, 2)
    max_ngram: int = 3
    engram_heads: int = 4
    head_dim: int = 32
    hc_mult: int = 2
    prime_start: int = 20_000
    vocab: int = 2_048  # model tokens, the unknown token included
    lr: float = 3e-3
    table_lr: float = 1e-2
    warmup: int = 30
    table_init_std: float = 0.1
    max_train_tokens: int = 4_000_000
    eval_every: int = 200
    eval_windows: int = 32
    corpus: list[str] | None = field(default=None)  # None: every installed source of corpus.SOURCES
    engram: bool = True  # False: the twin without Engram (same backbone, data and steps)
    row_dropout: float = 0.0  # share of row reads replaced by another row of their head while training
    table_init: str = "normal"  # "normal" (std table_init_std) or "zero": what an unwritten row holds
    unseen_rate: float = 0.3  # share of positions whose 2-gram (and 3-gram) is read as unseen; as many more: the 3-gram
    gate_loss: float = 5.0  # weight of the gate's cross-entropy as a detector of the rows replaced, added to the loss


@dataclass
class TrainResult:
    path: Path
    history: list[dict[str, float]]
    train_tokens: int
    seconds: float


def model_vocabulary(sequences: list[np.ndarray], size: int) -> torch.Tensor:
    """The ``size - 1`` most frequent token ids (ties: lower id first), int64, most frequent first."""
    counts = np.bincount(np.concatenate(sequences)) if sequences else np.zeros(0, np.int64)
    order = np.lexsort((np.arange(counts.size), -counts))  # by count desc, then id
    order = order[counts[order] > 0][: size - 1]
    return torch.from_numpy(order.astype(np.int64))


def _stream(sequences: list[np.ndarray]) -> torch.Tensor:
    """Every text back to back, each followed by the end-of-text token: int64 ``[N]``."""
    eos = np.array([EOS_ID], np.int64)
    return torch.from_numpy(np.concatenate([x for s in sequences for x in (s, eos)]))


def _lr_factor(step: int, s: TrainSettings) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < s.warmup:
        return (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(settings: TrainSettings, out: str | Path, *, progress: bool = True, log=print, warn=None) -> TrainResult:
    """Train with ``settings`` and save the model into ``out`` (released V4.1 format). ``log``
    gets the progress lines; ``warn`` (default ``log``) the line naming the corpus sources not
    installed."""
    s = settings
    if s.table_init not in ("normal", "zero"):
        raise ValueError(f"table_init must be 'normal' or 'zero', got {s.table_init!r}")
    if not 0 <= s.row_dropout < 1:
        raise ValueError(f"row_dropout must be in [0, 1), got {s.row_dropout}")
    if not 0 <= s.unseen_rate * (s.max_ngram - 1) <= 1 or s.gate_loss < 0:
        raise ValueError(f"unseen_rate must be in [0, 1/{s.max_ngram - 1}] and gate_loss at least 0, "
                         f"got {s.unseen_rate} and {s.gate_loss}")
    torch.manual_seed(s.seed)
    if s.corpus is None and (missing := find_sources()[1]):
        (warn or log)(missing_sources_message(missing))
    files = corpus_files(s.corpus)
    train_files, held_files = split(files)
    if not train_files or not held_files:
        raise ValueError(f"the corpus has {len(train_files)} training and {len(held_files)} held-out files: "
                         "give a corpus of at least a few dozen files")
    shuffled = [train_files[i] for i in np.random.default_rng(s.seed).permutation(len(train_files))]
    tokenizer = load_tokenizer()
    log(f"tokenizing {len(train_files):,} training files (up to {s.max_train_tokens:,} tokens, shared by "
        f"kind and source) and {len(held_files):,} held-out files")
    by_kind = kind_sequences(shuffled, tokenizer, s.max_train_tokens)
    train_seqs = [seq for seqs in by_kind.values() for seq in seqs]
    held = _interleave([windows(seqs, s.seq_len) for seqs in
                        kind_sequences(held_files, tokenizer, s.eval_windows * s.seq_len * 4).values()])
    held = held[: s.eval_windows]
    stream = _stream(train_seqs)
    token_map = cached_token_map()
    config = EngramConfig(
        layer_ids=s.engram_layers, max_ngram_size=s.max_ngram, n_heads=s.engram_heads, head_dim=s.head_dim,
        prime_starts=(s.prime_start,) * (s.max_ngram - 1), pad_id=2, hidden_size=s.hidden, hc_mult=s.hc_mult, variant="v4.1",
        row_format="fp8_e4m3_ue8m0", rms_norm_eps=1e-6, compressed_vocab_size=int(token_map.max()) + 1,
    )
    model = EngramLM(config, model_vocabulary(train_seqs, s.vocab), token_map, s.layers, s.attention_heads,
                     table=False, engram=s.engram)
    layer_ids = config.layer_ids if s.engram else ()
    tables = {i: nn.Embedding(config.rows_per_layer[i], s.head_dim, sparse=True) for i in layer_ids}
    for table in tables.values():
        if s.table_init == "zero":
            nn.init.zeros_(table.weight)
        else:
            nn.init.normal_(table.weight, std=s.table_init_std)
    reads = _RowReads(config, tables, s.row_dropout, torch.Generator().manual_seed(s.seed + 1), s.unseen_rate)
    optimizers, schedules = _optimizers(model, tables, s)
    seen = SeenNgrams() if tables else None  # the n-grams of every training window
    g = torch.Generator().manual_seed(s.seed)
    rows_for = reads if tables else None
    history: list[dict[str, float]] = []
    started = time.perf_counter()
    with _progress(progress, s.steps) as bar:
        for step in range(s.steps):
            model.train()
            reads.training = True
            chunk = _batch(stream, s, g)  # [B, T+1]
            if seen is not None:
                seen.add(ngram_keys(model.hasher, chunk[:, :-1]))
            extra = None
            if s.unseen_rate and tables:
                reads.draw(s.batch, s.seq_len)
                if s.gate_loss:
                    extra = lambda: s.gate_loss * reads.gate_loss(model)  # noqa: E731
            record = {"step": step + 1, "train_loss": _step(model, optimizers, schedules, chunk, rows_for, extra)}
            if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
                model.eval()
                reads.training = False
                record["held_out_loss"] = evaluate(model, held, rows_for).nll
            history.append(record)
            bar(step, record)
    seconds = time.perf_counter() - started
    meta = {"settings": _jsonable(asdict(s)), "train_tokens": int(stream.numel()),
            "train_tokens_by_kind": {k: int(sum(x.size for x in v)) for k, v in by_kind.items()},
            "train_files": len(train_files), "held_out_files": len(held_files), "history": history}
    flat_written = torch.cat([reads.written[i] for i in layer_ids]) if tables else None
    path = save_model(model, {i: tables[i].weight for i in layer_ids}, out, extra=meta, written=flat_written)
    if seen is not None:
        seen.save(path)
    return TrainResult(path, history, int(stream.numel()), seconds)


def _optimizers(model: nn.Module, tables: dict[int, nn.Embedding], s: TrainSettings
                ) -> tuple[list[torch.optim.Optimizer], list[torch.optim.lr_scheduler.LambdaLR]]:
    """AdamW (``lr``, weight decay 0.01) for the dense weights, SparseAdam (``table_lr``) for the
    tables' rows, each on the warmup-then-cosine schedule of ``_lr_factor``."""
    optimizers: list[torch.optim.Optimizer] = [torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)]
    if tables:
        optimizers.append(torch.optim.SparseAdam([table.weight for table in tables.values()], lr=s.table_lr))
    return optimizers, [torch.optim.lr_scheduler.LambdaLR(o, lambda step: _lr_factor(step, s)) for o in optimizers]


class _RowReads:
    """The model's row reads from the trained tables (``rows_for(layer_id, ids)``): while
    ``training``, each row read is marked written, except those replaced by a random row of their
    head (untrained by that read), as an unseen n-gram's are: every row of the n-grams ``draw``
    chose, and a ``row_dropout`` share of the other reads."""

    def __init__(self, config: EngramConfig, tables: dict[int, nn.Embedding], row_dropout: float,
                 generator: torch.Generator, unseen_rate: float = 0.0) -> None:
        self.tables, self.row_dropout, self.generator = tables, row_dropout, generator
        self.unseen_rate, self.n_heads = unseen_rate, config.n_heads
        self.orders = torch.arange(1, config.num_orders + 1)
        self.unseen: torch.Tensor | None = None  # bool [B, T, orders]: the n-grams this batch reads as unseen
        self.training = False
        self.written = {i: torch.zeros(config.rows_per_layer[i], dtype=torch.bool) for i in tables}
        self.heads = {i: (torch.tensor(config.head_offsets(i)), torch.tensor(config.head_sizes(i))) for i in tables}

    def draw(self, b: int, t: int) -> None:
        """Choose the batch's unseen n-grams: the order-k n-gram (k = 2, 3, ...) at a position
        where a uniform draw is below ``(k - 1) * unseen_rate`` (an unseen 2-gram's 3-gram is unseen)."""
        self.unseen = torch.rand((b, t, 1), generator=self.generator) < self.unseen_rate * self.orders

    def gate_loss(self, model: EngramLM) -> torch.Tensor:
        """The binary cross-entropy of every Engram layer's and branch's gate (of the last forward,
        with its graph) against the share of the position's orders read as seen: the gate is
        trained to tell a position's own rows from replaced ones."""
        assert self.unseen is not None
        target = 1 - self.unseen.float().mean(-1, keepdim=True)  # [B, T, 1]
        return torch.stack([F.binary_cross_entropy(g.clamp(1e-6, 1 - 1e-6), target.expand_as(g))
                            for g in model.gates().values()]).mean()

    def __call__(self, layer_id: int, ids: torch.Tensor) -> torch.Tensor:
        rows = self.tables[layer_id](ids)  # [B, T, C, d]
        if not self.training:
            return rows
        if self.unseen is None and not self.row_dropout:
            self.written[layer_id][ids.reshape(-1)] = True
            return rows
        replaced = torch.zeros(ids.shape, dtype=torch.bool) if self.unseen is None else \
            self.unseen.repeat_interleave(self.n_heads, dim=-1)  # [B, T, C]
        if self.row_dropout:
            replaced |= torch.rand(ids.shape, generator=self.generator) < self.row_dropout
        offsets, sizes = self.heads[layer_id]  # [C] each
        other = (torch.rand(ids.shape, generator=self.generator) * sizes).long() + offsets
        self.written[layer_id][ids[~replaced]] = True
        return torch.where(replaced.unsqueeze(-1), self.tables[layer_id](other).detach(), rows)


def _batch(stream: torch.Tensor, s: TrainSettings, generator: torch.Generator) -> torch.Tensor:
    """``s.batch`` windows of ``s.seq_len + 1`` tokens at random starts of ``stream``: ``[B, T+1]``."""
    starts = torch.randint(0, stream.numel() - s.seq_len - 1, (s.batch,), generator=generator)
    return torch.stack([stream[i: i + s.seq_len + 1] for i in starts.tolist()])


def _step(model: EngramLM, optimizers: list[torch.optim.Optimizer],
          schedules: list[torch.optim.lr_scheduler.LambdaLR], chunk: torch.Tensor, rows_for: Any,
          extra: Any = None) -> float:
    """One optimizer step on ``chunk`` ``[B, T+1]`` (inputs its first T tokens, targets its last
    T), gradients clipped to norm 1; the batch's loss before the step (without ``extra()``, a
    term added to the loss after the forward)."""
    logits = model(chunk[:, :-1], rows_for)
    loss = F.cross_entropy(logits.flatten(0, 1), model.to_model_ids(chunk[:, 1:]).reshape(-1))
    reported = float(loss.detach())
    if extra is not None:
        loss = loss + extra()
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for o in optimizers:
        o.step()
    for schedule in schedules:
        schedule.step()
    return reported


def _interleave(lists: list[list[Any]]) -> list[Any]:
    """The items of ``lists`` taken in turn, one from each (a shorter list drops out when it ends)."""
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


class _progress:
    """Progress over training steps with the latest losses: a rich bar on a terminal, a line
    every ``LINE_SECONDS`` elsewhere (or nothing)."""

    def __init__(self, enabled: bool, steps: int) -> None:
        self.enabled, self.steps = enabled, steps
        self._held = float("nan")

    def __enter__(self):
        self._lines = None if not self.enabled or on_terminal() else \
            LineProgress("training steps", self.steps, lambda n: f"{int(n):,}")
        if self.enabled and self._lines is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[losses]}"), TimeRemainingColumn())
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.steps, losses="")
        return self

    def __call__(self, step: int, record: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._held = record.get("held_out_loss", self._held)
        text = f"loss {record['train_loss']:.3f}  held-out {self._held:.3f}"
        if self._lines is not None:
            self._lines.update(step + 1, text)
        else:
            self._bar.update(self._task, completed=step + 1, losses=text)

    def __exit__(self, *exc: object) -> None:
        if self._lines is not None:
            self._lines.close()
        elif self.enabled:
            self._bar.__exit__(*exc)


def plot_losses(history: list[dict[str, float]], path: str | Path, title: str = "EngramLM training") -> Path:
    """A PNG of the training loss (and held-out loss where measured) against the step: 770 x 440
    pixels (7 x 4 inches at 110 dpi)."""
    import matplotlib.pyplot as plt

    fig = loss_figure(history, title)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return Path(path)


def loss_figure(history: list[dict[str, float]], title: str = "EngramLM training") -> Any:
    """The matplotlib figure of ``plot_losses`` (Agg, not shown); the caller closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["train_loss"] for r in history], lw=0.8, alpha=0.7, label="training batch")
    held = [(r["step"], r["held_out_loss"]) for r in history if "held_out_loss" in r]
    if held:
        ax.plot(*zip(*held), "o-", label="held-out files")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
