"""What the trained model's gates open for: every Engram row read on a corpus, with its gate.

A V4.1 gate is per position and hyper-connection branch; every row read at a position (one
per order and head) is credited with that position's gate, averaged over the branches. Per
row of the table: how often it was read, the sum of its gates, its most read n-gram with
that n-gram's share of the row's reads, and how many distinct n-grams it served (the hash
collides: a row may hold several). The reads are also kept
in serving order (the batch's windows side by side, one position at a time), for the cache
simulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .evaluate import EvalResult, evaluate
from .lm import EngramLM, RowsFor
from .ngrams import SeenNgrams, ngram_keys

__all__ = ["ScanResult", "scan", "rank_correlation", "top_rows", "plot_scan"]


@dataclass
class ScanResult:
    config_rows: int
    counts: np.ndarray  # int64 [rows]: reads per table row (flat ids, layers back to back)
    gate_sums: np.ndarray  # float64 [rows]
    examples: np.ndarray  # int64 [rows, N]: the row's most read n-gram, DeepSeek ids oldest first; -1 = none
    example_share: np.ndarray  # float64 [rows]: that n-gram's share of the row's reads
    distinct_ngrams: np.ndarray  # int64 [rows]: distinct n-grams read from the row (hash collisions)
    trace_ids: np.ndarray  # int64 [reads]: flat row ids in serving order
    trace_gates: np.ndarray  # float32 [reads]
    evaluation: EvalResult
    # with a ``SeenNgrams`` of the training n-grams: reads (and their gate sums) of n-grams never
    # seen in training, and of the others, per order (index 0: 2-grams); None without one
    unseen_reads: np.ndarray | None = None
    unseen_gate_sums: np.ndarray | None = None
    seen_reads: np.ndarray | None = None
    seen_gate_sums: np.ndarray | None = None

    @property
    def read_rows(self) -> np.ndarray:
        return np.flatnonzero(self.counts)

    @property
    def mean_gates(self) -> np.ndarray:
        return np.divide(self.gate_sums, self.counts, out=np.zeros_like(self.gate_sums), where=self.counts > 0)


def scan(model: EngramLM, pieces: list[np.ndarray], rows_for: RowsFor | None = None, batch: int = 16,
         seen: SeenNgrams | None = None) -> ScanResult:
    """Run the model over ``pieces`` (from ``evaluate.windows``) and record every read's gate
    (and, given the training n-grams ``seen``, the gates of reads of n-grams seen and unseen)."""
    c = model.config
    n = c.max_ngram_size
    rows = c.num_rows
    counts = np.zeros(rows, np.int64)
    gate_sums = np.zeros(rows, np.float64)
    examples = np.full((rows, n), -1, np.int64)
    bases = np.array(c.layer_row_bases, np.int64)
    order_of_col = np.repeat(np.arange(c.num_orders), c.n_heads) + 2  # [C]: the n of each column
    trace_ids: list[np.ndarray] = []
    trace_gates: list[np.ndarray] = []
    pairs: list[np.ndarray] = []  # [reads, 1 + n]: row id, then the n-gram read
    novelty = np.zeros((4, c.num_orders), np.float64)  # unseen reads, unseen gate sums, seen reads, seen gate sums

    def on_batch(inputs: torch.Tensor, row_ids: torch.Tensor, logits: torch.Tensor) -> None:
        b, t = inputs.shape
        gates = np.stack([model.gates()[i].mean(-1).numpy() for i in c.layer_ids], axis=2)  # [B, T, L]
        flat = row_ids.numpy() + bases[:, None]  # [B, T, L, C]
        per_read = np.broadcast_to(gates[..., None], flat.shape)  # [B, T, L, C]
        counts[:] += np.bincount(flat.reshape(-1), minlength=rows)
        gate_sums[:] += np.bincount(flat.reshape(-1), weights=per_read.reshape(-1).astype(np.float64), minlength=rows)
        trace_ids.append(flat.transpose(1, 0, 2, 3).reshape(-1))  # position-major: serving order
        trace_gates.append(per_read.transpose(1, 0, 2, 3).reshape(-1).astype(np.float32))
        # every read's n-gram: the order's last n tokens of its position, oldest first (-1 before them)
        ids = inputs.numpy()
        padded = np.concatenate([np.full((b, n - 1), -1, np.int64), ids], axis=1)  # [B, T+n-1]
        grams = np.stack([padded[:, k: k + t] for k in range(n)], axis=-1)  # [B, T, n]
        keep = np.arange(n)[None] >= (n - order_of_col)[:, None]  # [C, n]: the column's order's tokens
        per_col = np.where(keep, grams[:, :, None, None, :], -1)  # [B, T, 1, C, n]
        per_col = np.broadcast_to(per_col, (*flat.shape, n))
        pairs.append(np.concatenate([flat[..., None], per_col], axis=-1).reshape(-1, n + 1))
        if seen is not None:
            new = ~seen.contains(ngram_keys(model.hasher, ids))  # [B, T, orders]
            per_order = gates.sum(axis=2, keepdims=True) * c.n_heads  # [B, T, 1]: one order's reads' gates
            novelty[0] += new.sum(axis=(0, 1)) * len(c.layer_ids) * c.n_heads
            novelty[1] += (per_order * new).sum(axis=(0, 1))
            novelty[2] += (~new).sum(axis=(0, 1)) * len(c.layer_ids) * c.n_heads
            novelty[3] += (per_order * ~new).sum(axis=(0, 1))

    result = evaluate(model, pieces, rows_for, batch=batch, on_batch=on_batch)
    share = np.zeros(rows, np.float64)
    distinct = np.zeros(rows, np.int64)
    unique, reads = np.unique(np.concatenate(pairs), axis=0, return_counts=True)  # sorted by row
    best = np.lexsort((-reads, unique[:, 0]))  # per row, its most read n-gram first
    first = best[np.r_[True, unique[best[1:], 0] != unique[best[:-1], 0]]]
    examples[unique[first, 0]] = unique[first, 1:]
    share[unique[first, 0]] = reads[first] / counts[unique[first, 0]]
    np.add.at(distinct, unique[:, 0], 1)
    found = (novelty[0], novelty[1], novelty[2], novelty[3]) if seen is not None else (None,) * 4
    return ScanResult(rows, counts, gate_sums, examples, share, distinct, np.concatenate(trace_ids),
                      np.concatenate(trace_gates), result, *found)


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank), float64."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], x.size]
    mean_rank = (starts + ends - 1) / 2.0
    ranks = np.empty(x.size, np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def rank_correlation(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation of two equal-length arrays (ties averaged)."""
    if x.size < 2:
        return float("nan")
    rx, ry = _ranks(np.asarray(x, np.float64)), _ranks(np.asarray(y, np.float64))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / denom) if denom > 0 else float("nan")


def _describe_row(model: EngramLM, row: int, result: ScanResult, tokenizer: Any) -> dict[str, Any]:
    c = model.config
    layer_index = int(np.searchsorted(np.array(c.layer_row_bases), row, side="right") - 1)
    layer = c.layer_ids[layer_index]
    local = row - c.layer_row_bases[layer_index]
    offsets = np.array(c.head_offsets(layer))
    column = int(np.searchsorted(offsets, local, side="right") - 1)
    tokens = [int(x) for x in result.examples[row] if x >= 0]
    return {
        "row": int(row), "layer": layer, "order": column // c.n_heads + 2, "head": column % c.n_heads,
        "reads": int(result.counts[row]), "mean_gate": float(result.mean_gates[row]),
        "gate_mass": float(result.gate_sums[row]), "ngram_tokens": tokens,
        "ngram_share": float(result.example_share[row]), "distinct_ngrams": int(result.distinct_ngrams[row]),
        "ngram": tokenizer.decode(tokens, skip_special_tokens=False) if tokens else "",
    }


def top_rows(model: EngramLM, result: ScanResult, tokenizer: Any, top: int = 20, min_reads: int = 3
             ) -> dict[str, list[dict[str, Any]]]:
    """The top rows by mean gate (rows read at least ``min_reads`` times), by read count, and
    by gate x count (the gate mass a row contributes); an n-gram shown for one head of its
    layer and order is not repeated for the others."""
    read = result.read_rows
    steady = read[result.counts[read] >= min_reads]
    keys = {
        "by_mean_gate": (steady, result.mean_gates[steady]),
        "by_reads": (read, result.counts[read].astype(np.float64)),
        "by_gate_mass": (read, result.gate_sums[read]),
    }
    out = {}
    for name, (rows, score) in keys.items():
        chosen, seen = [], set()
        for r in rows[np.lexsort((rows, -score))]:
            row = _describe_row(model, int(r), result, tokenizer)
            key = (row["layer"], row["order"], tuple(row["ngram_tokens"]))
            if key not in seen:  # the heads of an order hash the same n-gram: show it once
                seen.add(key)
                chosen.append(row)
            if len(chosen) == top:
                break
        out[name] = chosen
    return out


def plot_scan(result: ScanResult, path: str | Path, correlation: float) -> Path:
    """Scatter PNG: each row read, its read count (log x) against its mean gate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    read = result.read_rows
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter(result.counts[read], result.mean_gates[read], s=2, alpha=0.25, linewidths=0)
    ax.set_xscale("log")
    ax.set_xlabel("reads of the row (held-out text)")
    ax.set_ylabel("mean gate when read")
    ax.set_title(f"Engram rows: gate vs read frequency (Spearman {correlation:+.3f}, {read.size:,} rows)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
