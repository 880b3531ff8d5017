"""Real-text decode steps through a ``Prefetcher`` over one tier: rows, misses and hits per
second, and the CPU of a missed row and of a hit row, measured apart in one run.

Steps: ``sequences`` sequences of real text (the corpus through the DeepSeek tokenizer, cut
into requests by ``workload.RequestStream``) decode one token each per step; a finished
sequence is replaced by the stream's next request. Each step goes through
``Prefetcher.begin_step``, ``rows(layer)`` of every Engram layer (the rows are consumed:
gathered into ``[T, C, head_dim]``) and ``end_step``. One caller keeps ``run_ahead`` steps
in flight: step N+1 (and on) is begun before step N is consumed and ended, so its fetch
overlaps step N's, as a server prefetching the next step does.

Method (the ``method`` key of the result says it too):

1. cold phase, for ``seconds``: the figures (``rows_per_s``: distinct rows the store served;
   ``misses_per_s``: rows read from the tier; ``hit_rate``) and the process CPU (every
   thread, ``time.process_time``) over the phase;
2. warm phase, for ``warm_seconds``: a set of steps whose distinct rows fit in half the
   cache is fetched once, then replayed over and over with fresh sequence histories (so the
   same row ids), every row a hit; ``cpu_us_per_hit`` = that phase's CPU / its distinct rows;
3. ``cpu_us_per_miss`` = (cold CPU - cold hits x ``cpu_us_per_hit``) / cold misses.

Both per-row figures hold everything the step costs per row (hashing and dedup, the cache,
the tier, decode, the consumer's gather); the caller thread's CPU in ``begin_step``
(hashing and dedup) is also given per token. ``check`` compares the rows of a sample of
steps with a reference gather from the ``mmap`` tier (no cache) after each phase.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..engram.hashing import NgramHasher
from ..engram.rows import fp8_decode_path
from ..serving.layered import LayeredStore
from ..serving.prefetch import Prefetcher, Step
from ..serving.store import TableStore, open_table
from .corpus import Corpus, load_corpus
from .workload import RequestStream, WorkloadShape

__all__ = ["DecodeSteps", "PrefetchPhase", "run_prefetch_phases", "load_text"]

SEQUENCE_TOKENS = 1024  # tokens of each sequence before it is replaced by the next request
CHECK_EVERY = 16  # with check: every this many steps' rows are kept for the comparison
CHECK_STEPS = 8  # at most this many sampled steps per phase
WARM_SET_MAX_STEPS = 256

StepInput = tuple[list[int], np.ndarray, list[int]]  # (seq ids, one token each [S], seq ids finished)


def load_text(corpus: str | Corpus, max_tokens: int, seed: int) -> tuple[Corpus, np.ndarray]:
    """The corpus (a name or path for ``load_corpus``, or one already loaded) and the
    DeepSeek tokenizer's compression map."""
    from ..engram.tokenizer import cached_token_map, load_tokenizer

    if not isinstance(corpus, Corpus):
        corpus = load_corpus(corpus, load_tokenizer(), max_tokens=max_tokens, seed=seed)
    return corpus, cached_token_map()


class DecodeSteps:
    """Decode steps of ``sequences`` sequences of real text, one token each per step.

    Each sequence is a request of ``SEQUENCE_TOKENS`` corpus tokens; when its last token has
    been fed, the next request takes its place under a new sequence id (the finished id is
    handed back with the step, to release its history).
    """

    def __init__(self, corpus: Corpus, sequences: int, seed: int = 0) -> None:
        self.stream = RequestStream(corpus, WorkloadShape("chat", prompt=SEQUENCE_TOKENS - 2, answer=2), seed)
        self.slots = [self._new() for _ in range(sequences)]  # [seq id, tokens, next position]

    def _new(self) -> list[Any]:
        request = self.stream.next()
        return [request.number, request.tokens, 0]

    def __iter__(self) -> Iterator[StepInput]:
        while True:
            seq_ids, finished = [], []
            new_tokens = np.empty(len(self.slots), np.int64)  # [S] one token a sequence
            for i, (seq_id, tokens, pos) in enumerate(self.slots):
                seq_ids.append(seq_id)
                new_tokens[i] = tokens[pos]
                if pos + 1 < tokens.size:
                    self.slots[i][2] = pos + 1
                else:
                    finished.append(seq_id)
                    self.slots[i] = self._new()
            yield seq_ids, new_tokens, finished


def _replayed(steps: Sequence[StepInput]) -> Iterator[StepInput]:
    """``steps`` again and again, each time under new sequence ids (fresh hashing histories,
    so the same row ids); every sequence is finished at the end of each pass."""
    ids = sorted({s for seq_ids, _, _ in steps for s in seq_ids})
    offset = 0
    while True:
        for k, (seq_ids, pieces, _) in enumerate(steps):
            last = k == len(steps) - 1
            yield [s + offset for s in seq_ids], pieces, [s + offset for s in ids] if last else []
        offset += max(ids) + 1


@dataclass
class PrefetchPhase:
    """What one phase did: steps, tokens, the store's counters, wall and CPU seconds."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    kernel_cpu_seconds: float = 0.0  # the part of cpu_seconds spent in the kernel (system time)
    begin_cpu_seconds: float = 0.0  # the caller thread's CPU in begin_step (hashing, dedup)
    caller_cpu_seconds: float = 0.0  # the caller thread's CPU over the phase (hashing, dedup, layer rows)
    step_periods: list[float] = field(default_factory=list)  # seconds between consecutive ends
    fetch_seconds: list[float] = field(default_factory=list)  # each step's begin -> all rows fetched
    stall_seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)  # the store's stats over the phase
    tier_delta: dict[str, int] = field(default_factory=dict)  # the tier's own counters over the phase
    samples: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (table ids, rows)

    @property
    def rows(self) -> int:
        return int(self.stats["store"]["rows_unique"])

    @property
    def misses(self) -> int:
        return int(self.stats["levels"][-1]["rows"])  # the rows the store read from the tier

    @property
    def hit_rate(self) -> float:
        return float(self.stats["store"]["hit_rate"])

    @property
    def fetch_cpu_seconds(self) -> float:
        """The fetch loop's CPU: the Prefetcher's workers (cache lookups, reads, fills, decode),
        i.e. the process's CPU less the caller thread's."""
        return max(self.cpu_seconds - self.caller_cpu_seconds, 0.0)

    def summary(self) -> dict[str, Any]:
        """The phase's figures as plain values."""
        wall, rows, misses = self.seconds, self.rows, self.misses
        periods = np.array(self.step_periods or [0.0]) * 1e3
        fetches = np.array(self.fetch_seconds or [0.0]) * 1e3
        return {
            "steps": self.steps, "tokens": self.tokens, "seconds": wall, "cpu_seconds": self.cpu_seconds,
            "kernel_cpu_seconds": self.kernel_cpu_seconds,
            "rows_requested": int(self.stats["store"]["rows_requested"]), "rows": rows, "misses": misses,
            "hits": rows - misses, "hit_rate": self.hit_rate,
            "rows_per_s": rows / wall, "misses_per_s": misses / wall, "tokens_per_s": self.tokens / wall,
            "reads": self.tier_delta.get("reads", 0), "reads_per_s": self.tier_delta.get("reads", 0) / wall,
            "bytes_read": self.tier_delta.get("bytes_read", 0),
            "cpu_us_per_row": self.cpu_seconds / max(rows, 1) * 1e6,
            "fetch_cpu_seconds": self.fetch_cpu_seconds,
            "fetch_cpu_us_per_row": self.fetch_cpu_seconds / max(rows, 1) * 1e6,
            "hash_dedup_cpu_us_per_token": self.begin_cpu_seconds / max(self.tokens, 1) * 1e6,
            "step_ms_p50": float(np.percentile(periods, 50)), "step_ms_p99": float(np.percentile(periods, 99)),
            "fetch_ms_p50": float(np.percentile(fetches, 50)), "fetch_ms_p99": float(np.percentile(fetches, 99)),
            "stall_seconds": self.stall_seconds,
        }


def _drive(prefetcher: Prefetcher, steps: Iterator[StepInput], seconds: float, run_ahead: int,
           check: bool, max_steps: int | None = None) -> PrefetchPhase:
    """Run steps for ``seconds`` (or ``max_steps``) with ``run_ahead`` of them in flight; the
    store's and the process's counters over the run, every step begun also consumed and ended."""
    store = prefetcher.store
    assert isinstance(store, (TableStore, LayeredStore))
    layers = prefetcher.config.layer_ids
    phase = PrefetchPhase()
    store.reset_stats()
    tier_before = store.stats()["tier"]
    pending: deque[Step] = deque()
    cpu0, t0, caller0, kernel0 = time.process_time(), time.perf_counter(), time.thread_time(), os.times().system
    stop_at, last_end = t0 + seconds, t0
    begun = 0
    while True:
        more = time.perf_counter() < stop_at and (max_steps is None or begun < max_steps)
        while more and len(pending) < run_ahead:
            seq_ids, pieces, finished = next(steps)
            c0 = time.thread_time()
            pending.append(prefetcher.begin_step(seq_ids, pieces))
            phase.begin_cpu_seconds += time.thread_time() - c0
            for seq_id in finished:
                prefetcher.release_sequence(seq_id)
            phase.tokens += len(pieces)
            begun += 1
            more = max_steps is None or begun < max_steps
        if not pending:
            break
        step = pending.popleft()
        rows = [prefetcher.rows(layer, step) for layer in layers]  # [T, C, head_dim] each
        if check and len(phase.samples) < CHECK_STEPS and phase.steps % CHECK_EVERY == 0:
            # the ids [T, L, C] and their rows [T, L, C, head_dim]
            phase.samples.append((step.table_ids.clone(), torch.stack(rows, 1)))
        prefetcher.end_step(step)
        now = time.perf_counter()
        phase.steps += 1
        phase.step_periods.append(now - last_end)
        phase.fetch_seconds.append(step.fetch_seconds)
        phase.stall_seconds += step.stall_seconds
        last_end = now
    phase.seconds = time.perf_counter() - t0
    phase.cpu_seconds = time.process_time() - cpu0
    phase.kernel_cpu_seconds = os.times().system - kernel0
    phase.caller_cpu_seconds = time.thread_time() - caller0
    phase.stats = store.stats()
    tier_after = phase.stats["tier"]
    phase.tier_delta = {k: tier_after.get(k, 0) - tier_before.get(k, 0) for k in ("reads", "bytes_read")}
    return phase


def _warm_set(hasher: NgramHasher, corpus: Corpus, sequences: int, seed: int, capacity_rows: int) -> list[StepInput]:
    """Decode steps whose distinct rows (each step's count, summed: at least their union) fill
    at most half a cache of ``capacity_rows`` (at least one step)."""
    steps: list[StepInput] = []
    rows = 0
    history = hasher.new_history()
    for seq_ids, pieces, finished in DecodeSteps(corpus, sequences, seed + 1):
        ids = hasher.table_ids(hasher.hash_decode(history, seq_ids, pieces))  # [S, L, C]
        distinct = int(np.unique(ids).size)
        if steps and (rows + distinct > capacity_rows // 2 or len(steps) >= WARM_SET_MAX_STEPS):
            return steps
        steps.append((seq_ids, pieces, []))
        rows += distinct
        for seq_id in finished:
            history.release(seq_id)
    raise AssertionError("DecodeSteps never ends")


def _check_rows(table: str, phases: Sequence[PrefetchPhase]) -> dict[str, Any]:
    """The sampled steps' rows against the ``mmap`` tier's gather of the same ids (no cache)."""
    checked = 0
    with open_table(table, "mmap") as reference:
        for phase in phases:
            for table_ids, rows in phase.samples:
                expected = reference.gather(table_ids)  # [T, L, C, d]
                if not torch.equal(expected, rows):
                    bad = int((expected != rows).any(-1).sum())
                    raise RuntimeError(f"{bad} rows the Prefetcher returned differ from the mmap tier's rows "
                                       f"of the same ids in {table}: the fetch path is wrong")
                checked += int(table_ids.numel())
    return {"reference": "mmap", "steps": sum(len(p.samples) for p in phases), "rows": checked, "equal": True}


def _us(seconds: float | None) -> float | None:
    return seconds * 1e6 if seconds is not None else None


METHOD = ("cold phase: real-text decode steps through the Prefetcher, process CPU over the phase; "
          "warm phase: steps whose rows fit in half the cache fetched until a pass has no miss (at most 8 passes), then replayed: "
          "cpu_us_per_hit = warm CPU / warm rows; cpu_us_per_miss = (cold CPU - cold hits x cpu_us_per_hit) "
          "/ cold misses. Rows are distinct rows per step (the store's unique rows); misses are rows read "
          "from the tier. Both per-row costs include hashing, dedup, decode and the consumer's gather; "
          "fetch_cpu_us_per_hit/miss are the same split of the fetch loop's CPU alone (the Prefetcher's "
          "workers: cache lookups, reads, fills, decode), the process's CPU less the caller thread's; "
          "kernel_cpu_us_per_miss is the same split of the process's system time, user_cpu_us_per_miss the rest.")


WARM_PASSES = 8  # passes over the warm set before its replay is measured (a pass without a miss ends them)


def run_prefetch_phases(store: TableStore, table: str, corpus: Corpus, token_map: np.ndarray, *,
                        seconds: float, warm_seconds: float, sequences: int, run_ahead: int, seed: int,
                        check: bool) -> dict[str, Any]:
    """The cold phase and, with a row cache, the warm phase over ``store``; the figures."""
    hasher = NgramHasher(store.config, token_map)
    with Prefetcher(store, hasher, dtype=torch.float32) as prefetcher:
        cold = _drive(prefetcher, iter(DecodeSteps(corpus, sequences, seed)), seconds, run_ahead, check)
    warm, warm_steps = None, []
    if store.levels:
        warm_steps = _warm_set(hasher, corpus, sequences, seed, min(level.capacity for level in store.levels))
        with Prefetcher(store, hasher, dtype=torch.float32) as prefetcher:  # fresh sequence histories
            replay = _replayed(warm_steps)
            for _ in range(WARM_PASSES):  # cache them: a frequency policy admits a row once it is seen again
                if _drive(prefetcher, replay, math.inf, run_ahead, False, max_steps=len(warm_steps)).misses == 0:
                    break
            warm = _drive(prefetcher, replay, warm_seconds, run_ahead, check)
    figures = cold.summary()

    def split(cpu_seconds: Callable[[PrefetchPhase], float]) -> tuple[float | None, float | None]:
        """(per hit row, per missed row) of one CPU figure: the warm phase's per row, and the
        cold phase's less its hits at that cost, per miss (see METHOD)."""
        per_hit = cpu_seconds(warm) / max(warm.rows, 1) if warm is not None else None
        if not cold.misses:
            return per_hit, None
        return per_hit, (cpu_seconds(cold) - (cold.rows - cold.misses) * (per_hit or 0.0)) / cold.misses

    cpu_per_hit, cpu_per_miss = split(lambda p: p.cpu_seconds)
    fetch_per_hit, fetch_per_miss = split(lambda p: p.fetch_cpu_seconds)
    _, kernel_per_miss = split(lambda p: p.kernel_cpu_seconds)
    return {
        **figures,
        "cpu_us_per_miss": _us(cpu_per_miss),
        "cpu_us_per_hit": _us(cpu_per_hit),
        "fetch_cpu_us_per_miss": _us(fetch_per_miss),
        # cpu_us_per_miss split: in the kernel (system time: the reads' submissions and
        # completions) and in the process (checks, decode, caches, Python)
        "kernel_cpu_us_per_miss": _us(kernel_per_miss),
        "user_cpu_us_per_miss": _us(None if cpu_per_miss is None else cpu_per_miss - (kernel_per_miss or 0.0)),
        "fp8_decode": fp8_decode_path(torch.float32),
        "fetch_cpu_us_per_hit": _us(fetch_per_hit),
        "method": METHOD,
        "sequences": sequences,
        "run_ahead": run_ahead,
        "corpus": {"name": corpus.name, "tokens": corpus.tokens, "source": corpus.source},
        "warm": None if warm is None else {**warm.summary(), "replayed_steps": len(warm_steps)},
        "check": _check_rows(table, [cold] + ([warm] if warm else [])) if check else None,
        "cache": cold.stats,
    }
