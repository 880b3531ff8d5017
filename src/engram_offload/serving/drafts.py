"""Drafts: rows of speculative tokens fetched ahead of the step that may need them.

Speculative decoding knows the next tokens before they are verified (an MTP head, a draft
model, a prompt-lookup match). Their row ids are hashed on a copy of each sequence's history
(the real one is not touched) and fetched in the background, after every urgent step and
ahead of the windows fetched further ahead. A right draft makes the next step's rows cache
hits; a wrong one costs reads, never rows.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..engram.hashing import NgramHasher, SequenceHistory
from .dedup import dedup
from .sharding import Columns, shard_ids
from .step import Step

__all__ = ["DraftStep", "Drafts"]


class DraftStep(Step):
    """The rows of draft tokens, fetched ahead of the step that may need them: one part, no
    layer decoded (``deliver`` keeps only the lease that pins the rows in the caches)."""

    def part_ids(self, p: int) -> tuple[np.ndarray, int]:
        return self.dedup.unique, int(self.dedup.unique.size)


class Drafts:
    """The last step's drafts, held until the next urgent step of their sequences meets
    them, and the counts of what they fetched. ``queue`` puts a ``DraftStep`` ahead of the
    background steps."""

    def __init__(self, hasher: NgramHasher, history: SequenceHistory, columns: Columns | None,
                 queue: Callable[[Step], None]) -> None:
        self._hasher, self._history, self._columns, self._queue = hasher, history, columns, queue
        self._lock = threading.Lock()
        self.last: DraftStep | None = None  # until the next step of its sequences is fetched
        self._counts = {"draft_steps": 0, "draft_rows": 0, "next_steps": 0, "next_rows": 0,
                        "next_rows_fetched": 0, "draft_rows_unused": 0}

    def fetch(self, seq_ids: tuple[int, ...], drafts: Sequence[Any]) -> None:
        """Hash the draft tokens on a copy of their sequences' histories and queue their rows'
        fetch behind every urgent step."""
        if len(drafts) != len(seq_ids):
            raise ValueError(f"{len(drafts)} drafts for {len(seq_ids)} sequences: give one (maybe empty) each")
        pairs = [(seq, np.asarray(tokens.detach().cpu() if isinstance(tokens, torch.Tensor) else tokens,
                                  dtype=np.int64).reshape(-1))
                 for seq, tokens in zip(seq_ids, drafts) if tokens is not None]
        pairs = [(seq, tokens) for seq, tokens in pairs if tokens.size]
        if not pairs:
            return
        ids = [seq for seq, _ in pairs]
        scratch = self._hasher.new_history(capacity=len(ids))
        slots, own = scratch.slots_for(ids), self._history.slots_for(ids)
        scratch.tokens[slots] = self._history.tokens[own]
        scratch.dead[slots] = self._history.dead[own]
        scratch.any_dead = bool(scratch.dead.any())
        table_ids = self._hasher.pieces_ids(scratch, ids, [tokens for _, tokens in pairs], flat=True)  # [K, L, C]
        if self._columns is not None:
            table_ids = shard_ids(table_ids, self._columns)
        d = dedup(table_ids)
        draft = DraftStep(0, tuple(ids), tuple(t.size for _, t in pairs), table_ids, d,
                          self._hasher.config.layer_ids, [(0, int(d.unique.size), ())])
        with self._lock:
            stale, self.last = self.last, draft
            self._counts["draft_steps"] += 1
            self._counts["draft_rows"] += int(d.unique.size)
        if stale is not None:  # drafts no urgent step came for (e.g. only prefill since)
            stale.cancel()
        self._queue(draft)

    def meet(self, step: Step, unique: np.ndarray) -> None:
        """The last drafts meet the step they were for (the next urgent step with one of their
        sequences): count the rows they had fetched, and let go of their pins once this step's
        own fetch holds its rows (at once, when the draft fetch has not started: the step
        reads them itself)."""
        with self._lock:
            draft = self.last
            if draft is None or not set(step.seq_ids) & set(draft.seq_ids):
                return  # no drafts, or drafts for other sequences (a prefill window, say)
            self.last = None
        fetched = draft.done() and not draft.skipping
        hits = int(np.isin(unique, draft.dedup.unique, assume_unique=True).sum()) if fetched else 0
        with self._lock:
            c = self._counts
            c["next_steps"] += 1
            c["next_rows"] += int(unique.size)
            c["next_rows_fetched"] += hits
            c["draft_rows_unused"] += int(draft.dedup.unique.size) - hits
        if draft.done() or draft._handed_out:  # fetched or being fetched: keep its pins until the step's
            step.when_done(draft.cancel)
        else:
            draft.cancel()  # not started: skipped

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the last drafts' fetch has ended; False on timeout, True when there are none."""
        with self._lock:
            draft = self.last
        return True if draft is None else draft.wait_done(timeout)

    def cancel(self) -> None:
        """Drop the last drafts and let go of their pins."""
        draft, self.last = self.last, None
        if draft is not None:
            draft.cancel()

    def stats(self) -> dict[str, Any]:
        """See ``Prefetcher.draft_stats``."""
        with self._lock:
            c: dict[str, Any] = dict(self._counts)
        c["share_fetched"] = c["next_rows_fetched"] / c["next_rows"] if c["next_rows"] else 0.0
        c["unused_per_fetched"] = c["draft_rows_unused"] / c["next_rows_fetched"] if c["next_rows_fetched"] else None
        return c
