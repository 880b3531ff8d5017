"""A model's forward pass with the prefetch started at forward entry, and without (bench_cache.py's stall).

``forward_with_prefetch`` begins the step before layer 0 runs, so the backbone's layers
before the first Engram layer compute while the rows are fetched; each Engram layer then
takes its rows from the prefetcher (waiting, and recording a stall, only if they are late).
The step's cache pins are released when the forward pass ends, however it ends. With a
store opened with ``device=`` the rows handed to the layers are on that device, ready on the
caller's stream (docs/prefetch.md).

Threads: the prefetch worker (ids, cache bookkeeping, io_uring submission, decoding) needs
a core while the model runs; on a small machine torch's intra-op pool competes with it.
benchmarks/results/cache.json (``stall``) has the step time at 1 and 2 intra-op threads on
2 cores; measure both on the target machine and pick with ``torch.set_num_threads``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from engram_offload.engram.hashing import NgramHasher
from engram_offload.serving.prefetch import Prefetcher, Step
from engram_offload.serving.store import RowStore

__all__ = ["ForwardResult", "forward_with_prefetch", "forward_with_store"]


@dataclass
class ForwardResult:
    output: torch.Tensor  # the backbone's output, e.g. [B, T, D]
    step: Step  # the prefetched step (ids, dedup, stall_seconds, stalls, fetch_seconds)

    @property
    def stall_seconds(self) -> float:
        return self.step.stall_seconds


def _batch(pieces: Sequence[Any]) -> torch.Tensor:
    arrays = [np.asarray(p.detach().cpu() if isinstance(p, torch.Tensor) else p).reshape(-1) for p in pieces]
    lengths = {a.size for a in arrays}
    if len(lengths) != 1:
        raise ValueError(
            f"forward_with_prefetch needs pieces of one length (a [B, T] batch), got lengths {sorted(lengths)}"
        )
    return torch.from_numpy(np.stack(arrays).astype(np.int64))  # [B, T]


def forward_with_prefetch(model: Any, prefetcher: Prefetcher, seq_ids: Sequence[int], pieces: Sequence[Any]) -> ForwardResult:
    """Run ``model(input_ids, rows_for)`` with the step's rows prefetched from forward entry.

    ``model`` is any module called as ``model(input_ids [B, T], rows_for)`` whose Engram layers
    call ``rows_for(layer_id)`` for rows ``[B, T, C, d]`` (``EngramBackbone`` does).
    """
    input_ids = _batch(pieces)  # [B, T]
    b, t = input_ids.shape
    step = prefetcher.begin_step(seq_ids, pieces)
    cols, d = prefetcher.config.cols_per_layer, prefetcher.config.head_dim

    def rows_for(layer_id: int) -> torch.Tensor:
        return prefetcher.rows(layer_id, step).view(b, t, cols, d)  # [B, T, C, d]

    try:
        output = model(input_ids, rows_for)
    except BaseException:
        prefetcher.cancel(step)
        raise
    prefetcher.end_step(step)
    return ForwardResult(output, step)


def forward_with_store(model: Any, store: RowStore, hasher: NgramHasher, input_ids: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same forward pass with rows gathered synchronously at each Engram layer (the
    no-prefetch baseline, and the oracle for tests). Hashes whole sequences from their start."""
    table_ids = hasher.table_ids(hasher.hash_all(input_ids))  # [B, T, L, C]
    layers = list(hasher.config.layer_ids)

    def rows_for(layer_id: int) -> torch.Tensor:
        return store.gather(table_ids[:, :, layers.index(layer_id)], dtype)  # [B, T, C, d]

    return model(input_ids, rows_for)
