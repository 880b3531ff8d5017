"""A read-skip predictor (experimental, OFF by default): skip an Engram layer's reads at a
position when the gate is predicted to be weak, and zero that contribution.

The gate needs the rows, so the prediction uses only what is known before the read: the
position's row ids (its n-gram per order and head) and the gates those rows were last read
under (a per-row history, as a serving engine could keep beside its cache). The predicted
gate of a position is the mean of its rows' remembered gates; a position with a row never
read before is always read. Positions predicted below ``threshold`` skip all ``(N-1)*H``
reads of that layer and get gate 0. Skipped rows teach the history nothing.

Nothing in the package turns this on: only ``skip_curve`` (the ``skip-curve`` command) runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import torch

from .evaluate import evaluate
from .lm import EngramLM, RowsFor

__all__ = ["SkipPoint", "skip_eval", "skip_curve"]


class SkipPoint(TypedDict):
    """One ``skip_eval`` result."""

    threshold: float
    random_rate: float | None  # None: the predictor, not the random baseline
    reads_saved: float  # share of the reads skipped
    perplexity: float
    nll: float
    tokens: int


@dataclass
class _SkipState:
    skipped: int = 0
    reads: int = 0
    masks: tuple[np.ndarray, np.ndarray] | None = None  # the batch's row ids [B, T, L, C], skips [B, T, L]


def skip_eval(model: EngramLM, pieces: list[np.ndarray], threshold: float, rows_for: RowsFor | None = None,
              batch: int = 16, random_rate: float | None = None, seed: int = 0) -> SkipPoint:
    """Perplexity with reads skipped below ``threshold`` (<= 0: nothing skipped).

    ``random_rate`` replaces the predictor by a baseline: each (position, layer) skipped with
    that probability (seeded), whatever its gate.
    """
    rng = np.random.default_rng(seed)
    c = model.config
    remembered = np.full(c.num_rows, np.nan, np.float32)  # last gate each row was read under
    bases = np.array(c.layer_row_bases, np.int64)
    state = _SkipState()

    def before(inputs: torch.Tensor, row_ids: torch.Tensor) -> None:
        flat = row_ids.numpy() + bases[:, None]  # [B, T, L, C]
        known = remembered[flat]  # [B, T, L, C]
        seen = ~np.isnan(known).any(-1)  # [B, T, L]
        predicted = np.where(seen, np.nan_to_num(known).mean(-1), np.inf)
        skip = predicted < threshold  # [B, T, L]
        if random_rate is not None:
            skip = rng.random(skip.shape) < random_rate
        state.skipped += int(skip.sum()) * flat.shape[-1]
        state.reads += flat.size
        state.masks = (flat, skip)
        model.set_gate_scale({layer: torch.from_numpy((~skip[:, :, i]).astype(np.float32))[..., None]
                              for i, layer in enumerate(c.layer_ids)})

    def after(inputs: torch.Tensor, row_ids: torch.Tensor, logits: torch.Tensor) -> None:
        assert state.masks is not None, "evaluate calls before_batch before each on_batch"
        flat, skip = state.masks
        gates = np.stack([model.gates()[i].mean(-1).numpy() for i in c.layer_ids], axis=2)  # [B, T, L]
        read = ~skip
        ids = flat[read]  # [k, C]
        remembered[ids.reshape(-1)] = np.repeat(gates[read], ids.shape[-1])

    try:
        result = evaluate(model, pieces, rows_for, batch=batch, before_batch=before, on_batch=after)
    finally:
        model.set_gate_scale(None)
    return {"threshold": threshold, "random_rate": random_rate, "reads_saved": state.skipped / max(1, state.reads),
            "perplexity": result.perplexity, "nll": result.nll, "tokens": result.tokens}


def skip_curve(model: EngramLM, pieces: list[np.ndarray], thresholds: list[float],
               rows_for: RowsFor | None = None) -> tuple[list[SkipPoint], list[SkipPoint]]:
    """``skip_eval`` at each threshold (0 first: every read done), and the random baseline
    skipping as many reads as each threshold did."""
    curve = [skip_eval(model, pieces, t, rows_for) for t in [0.0, *thresholds]]
    baseline = [skip_eval(model, pieces, 0.0, rows_for, random_rate=r["reads_saved"]) for r in curve[1:]
                if r["reads_saved"] > 0]
    return curve, baseline
