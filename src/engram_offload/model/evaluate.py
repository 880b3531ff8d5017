"""Held-out perplexity of an ``EngramLM``, with rows from any source (its own table, a store).

Each text is cut into windows of ``seq_len + 1`` tokens overlapping by one (inputs, then
targets shifted by one); every window starts afresh (attention and the n-gram hash see no
earlier window), so a window's logits do not depend on how windows are batched.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from .lm import EngramLM, RowsFor
from .ngrams import SeenNgrams, ngram_keys

__all__ = ["EvalResult", "GateNovelty", "evaluate", "windows", "batches", "store_rows", "compare", "combined"]


@dataclass
class EvalResult:
    tokens: int  # predicted tokens
    nll: float  # mean negative log-likelihood (nats per token, model vocabulary)
    perplexity: float
    gates: dict[str, list[float]] | None = None  # GateNovelty.summary() of the Engram model, when measured

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def windows(sequences: list[np.ndarray], seq_len: int) -> list[np.ndarray]:
    """Every text's windows of up to ``seq_len + 1`` tokens (the last may be shorter; at least 2)."""
    out = []
    for seq in sequences:
        for start in range(0, max(seq.size - 1, 0), seq_len):
            piece = seq[start: start + seq_len + 1]
            if piece.size >= 2:
                out.append(piece)
    return out


def batches(pieces: list[np.ndarray], batch: int) -> Iterator[torch.Tensor]:
    """Windows of equal length grouped ``batch`` at a time, in a fixed order: ``[B, T+1]``."""
    by_length: dict[int, list[np.ndarray]] = {}
    for p in pieces:
        by_length.setdefault(p.size, []).append(p)
    for length in sorted(by_length, reverse=True):
        group = by_length[length]
        for i in range(0, len(group), batch):
            yield torch.from_numpy(np.stack(group[i: i + batch]))


def store_rows(store, model: EngramLM) -> RowsFor:
    """Rows from a ``TableStore`` holding the model's table (layers back to back)."""
    bases = dict(zip(model.config.layer_ids, model.config.layer_row_bases))

    def rows_for(layer_id: int, ids: torch.Tensor) -> torch.Tensor:
        return store.gather((ids + bases[layer_id]).numpy())  # [B, T, C, d]

    return rows_for


@torch.no_grad()
def evaluate(model: EngramLM, pieces: list[np.ndarray], rows_for: RowsFor | None = None, *,
             batch: int = 16, on_batch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
             before_batch: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> EvalResult:
    """Mean NLL and perplexity over ``pieces`` (from ``windows``), targets in the model vocabulary.

    ``on_batch(inputs [B, T], row_ids [B, T, L, C], logits [B, T, K])`` sees every batch (the
    model's ``gates()`` then hold that batch's gates); ``before_batch(inputs, row_ids)`` runs
    before its forward (e.g. to set the gate scales).
    """
    total, count = 0.0, 0
    for chunk in batches(pieces, batch):
        inputs, targets = chunk[:, :-1], model.to_model_ids(chunk[:, 1:])
        row_ids = model.row_ids(inputs)
        if before_batch is not None:
            before_batch(inputs, row_ids)
        logits = model(inputs, rows_for, row_ids=row_ids)  # [B, T, K]
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), targets.reshape(-1), reduction="sum"))
        count += targets.numel()
        if on_batch is not None:
            on_batch(inputs, row_ids, logits)
    if count == 0:
        raise ValueError("no text to evaluate: the corpus gave no window of two or more tokens")
    nll = total / count
    return EvalResult(count, nll, math.exp(nll))


class GateNovelty:
    """An ``on_batch`` of ``evaluate``: per order (2-grams first), the mean gate (over the Engram
    layers and branches) at positions whose n-gram no training window held (not in ``seen``) and
    at the others."""

    def __init__(self, model: EngramLM, seen: SeenNgrams) -> None:
        self.model, self.seen = model, seen
        self.sums = np.zeros((4, model.config.num_orders))  # unseen positions, their gates, seen ones, theirs

    def __call__(self, inputs: torch.Tensor, row_ids: torch.Tensor, logits: torch.Tensor) -> None:
        gate = torch.stack(list(self.model.gates().values())).mean(dim=(0, -1)).numpy()[..., None]  # [B, T, 1]
        new = ~self.seen.contains(ngram_keys(self.model.hasher, inputs))  # [B, T, orders]
        self.sums += np.stack([new.sum((0, 1)), (gate * new).sum((0, 1)), (~new).sum((0, 1)), (gate * ~new).sum((0, 1))])

    def summary(self) -> dict[str, list[float]]:
        """``unseen_share``, ``gate_unseen`` and ``gate_seen``, one value per order."""
        unseen, unseen_gates, seen, seen_gates = self.sums
        with np.errstate(invalid="ignore", divide="ignore"):
            return {"unseen_share": (unseen / (unseen + seen)).tolist(), "gate_unseen": (unseen_gates / unseen).tolist(),
                    "gate_seen": (seen_gates / seen).tolist()}


def combined(results: list[EvalResult]) -> EvalResult:
    """The results of disjoint texts as one: their token-weighted NLL."""
    tokens = sum(r.tokens for r in results)
    nll = sum(r.nll * r.tokens for r in results) / max(1, tokens)
    return EvalResult(tokens, nll, math.exp(nll))


def compare(model: EngramLM, twin: EngramLM | None, pieces_by_kind: dict[str, list[np.ndarray]],
            rows_for: RowsFor | None = None, seen: SeenNgrams | None = None) -> dict[str, dict[str, EvalResult]]:
    """Per kind of text, and for ``"all"`` of it: the Engram model (rows from ``rows_for``), the
    same model with every gate forced to 0 (the lesion) and, when given, its ``twin`` trained
    without Engram, all on the same windows. Given the training n-grams ``seen``, the Engram
    model's results of each kind carry its ``GateNovelty`` summary."""
    out: dict[str, dict[str, EvalResult]] = {}
    for kind, pieces in pieces_by_kind.items():
        novelty = GateNovelty(model, seen) if seen is not None else None
        row = {"engram": evaluate(model, pieces, rows_for, on_batch=novelty)}
        if novelty is not None:
            row["engram"].gates = novelty.summary()
        model.set_gate_scale(0.0)
        try:
            row["lesion"] = evaluate(model, pieces, rows_for)
        finally:
            model.set_gate_scale(None)
        if twin is not None:
            row["twin"] = evaluate(twin, pieces)
        out[kind] = row
    out["all"] = {name: combined([row[name] for row in out.values()]) for name in next(iter(out.values()))}
    return out
