"""The serving loop: continuous batching over a real backbone, rows prefetched every step.

Each step holds one decode token for every sequence that is decoding and prefill chunks
for the others, up to ``max_step_tokens`` tokens (decode tokens first, as chunked-prefill
schedulers do). At the step's beginning the prefetcher hashes the step's tokens through
each sequence's hasher history and starts fetching every Engram layer's rows; then the
backbone runs, and each Engram layer takes its rows from the prefetcher (a wait there is
the step's Engram stall).

Pieces of several sequences are packed into one row ``[1, T]`` with a per-piece causal
mask. The backbone keeps no KV cache: attention covers the step's own piece, which keeps
the compute per token (the dense layers) while leaving context length out of it.

Prefill lookahead: a turn's input is known when the turn starts, so its rows need not
wait for the step that computes it. The engine hashes and fetches upcoming prefill chunks
("windows" of ``window_tokens``, at most ``lookahead_tokens`` tokens ahead in all) while
earlier steps compute; only decode tokens, which exist once the previous step has sampled
them, are fetched at their own step's beginning. Windows fetched ahead are background work
for the prefetcher (a step's own fetches overtake them between their parts), except the
first window of a turn that just started, which the next step needs. A prefill piece is
scheduled only once its rows are in (``defer_unready``); until then the batch runs
without it. ``lookahead_tokens=0`` turns all this off: every piece is then fetched at the
beginning of the step that computes it.

The model is either a torch backbone (``EngramBackbone``: real compute on this machine) or
any ``StepModel``, which is handed each step's ``StepShape`` and the ``rows_for`` of its
Engram layers (``bench.modeled.ModeledBackbone``: a GPU's step time, slept).

The arrival process is closed-loop: ``concurrency`` requests are always in flight, and a
new one starts as soon as one finishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import torch

from ..serving.prefetch import Prefetcher, Step
from .backbone import packed_causal_mask
from .drafts import Drafter
from .workload import Request, RequestStream

__all__ = ["EngineRun", "RowsFor", "ServingEngine", "StepModel", "StepShape", "Window"]

RowsFor = Callable[[int], torch.Tensor]  # layer_id -> the step's rows of that layer [T, C, d]


@dataclass(frozen=True)
class StepShape:
    """What one serving step computes: its pieces (decode tokens first, then prefill chunks)."""

    pieces: tuple[np.ndarray, ...]
    decode_tokens: int
    prefill_tokens: int
    kv_tokens: int  # KV-cache tokens its attention reads: each sequence's length after the step

    @property
    def tokens(self) -> int:
        return self.decode_tokens + self.prefill_tokens


class StepModel(Protocol):
    """A model the engine runs one step at a time; it calls ``rows_for`` once per Engram
    layer, in layer order."""

    def run_step(self, shape: StepShape, rows_for: RowsFor) -> None: ...


class BackboneStep:
    """A torch backbone as a ``StepModel``: decode-only steps as a ``[B, 1]`` batch, others
    packed into ``[1, T]`` with a causal mask per piece."""

    def __init__(self, backbone: torch.nn.Module, cols: int, dim: int) -> None:
        self.backbone = backbone
        self._cols, self._dim = cols, dim

    def run_step(self, shape: StepShape, rows_for: RowsFor) -> None:
        lengths = [p.size for p in shape.pieces]
        if all(n == 1 for n in lengths):
            input_ids = torch.from_numpy(np.concatenate(shape.pieces)).view(-1, 1)  # [B, 1]
            mask = None
        else:
            input_ids = torch.from_numpy(np.concatenate(shape.pieces)).view(1, -1)  # [1, T]
            mask = packed_causal_mask(lengths)
        b, t = input_ids.shape
        with torch.no_grad():
            self.backbone(input_ids, lambda layer_id: rows_for(layer_id).view(b, t, self._cols, self._dim), mask)


@dataclass
class EngineRun:
    """What one timed run of the loop observed."""

    seconds: float = 0.0
    steps: int = 0
    tokens: int = 0  # prefill + decode tokens fed to the model
    prefill_tokens: int = 0
    decode_tokens: int = 0
    rows_requested: int = 0  # row ids of all steps (every token, every Engram layer)
    rows_unique: int = 0  # after each step's dedup
    step_seconds: list[float] = field(default_factory=list)
    stall_seconds: list[float] = field(default_factory=list)
    step_tokens: list[tuple[int, int, int]] = field(default_factory=list)  # (decode, prefill, KV) per step
    # prefill tokens whose rows each step began to fetch: its own pieces not fetched ahead and
    # the windows fetched ahead of later steps (those of the last steps may never be computed)
    step_fetched_prefill: list[int] = field(default_factory=list)
    layer_stall_seconds: dict[int, float] = field(default_factory=dict)  # Engram layer -> its waits, in all
    requests: list[Request] = field(default_factory=list)  # finished, then those still running
    finished: int = 0


@dataclass
class Window:
    """The lookahead unit: a request's input tokens [start, end) whose rows are fetched ahead
    of the serving step that computes them (``fetch``: the prefetcher's ``Step`` for them)."""

    start: int
    end: int
    fetch: Step


class ServingEngine:
    """Runs ``model`` (a torch backbone or a ``StepModel``) over requests with rows from
    ``prefetcher`` (see the module docstring).

    ``model=None`` replays the row accesses only (hash, fetch, wait): a fast warm-up pass
    that fills caches as serving the same requests would.

    ``drafter`` (``bench.drafts``): each decode step also hands the prefetcher, per
    sequence, the draft tokens after its token, whose rows are fetched a step early.
    """

    def __init__(self, model: torch.nn.Module | StepModel | None, prefetcher: Prefetcher, *, concurrency: int,
                 max_step_tokens: int = 256, lookahead_tokens: int | None = None,
                 window_tokens: int = 64, defer_unready: bool = True, drafter: Drafter | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if max_step_tokens < concurrency:
            raise ValueError(
                f"max_step_tokens ({max_step_tokens}) must be >= concurrency ({concurrency}): every "
                "decoding sequence needs one token a step"
            )
        self.prefetcher = prefetcher
        cfg = prefetcher.config
        self.model: StepModel | None = (BackboneStep(model, cfg.cols_per_layer, cfg.head_dim)
                                        if isinstance(model, torch.nn.Module) else model)
        self.concurrency = concurrency
        self.max_step_tokens = max_step_tokens
        self.lookahead_tokens = 2 * max_step_tokens if lookahead_tokens is None else int(lookahead_tokens)
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens must be >= 0 (0: off), got {lookahead_tokens}")
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        self.window_tokens = int(window_tokens)
        self.defer_unready = defer_unready
        self.drafter = drafter
        self._layers = list(cfg.layer_ids)
        self._windows: dict[int, list[Window]] = {}  # request number -> its input windows, in order
        self._hashed: dict[int, int] = {}  # request number -> input tokens hashed so far
        self._issued_tokens = 0  # prefill tokens whose fetch was begun, in all
        self._run: EngineRun | None = None
        self._waiting: list[Request] = []  # active requests not in this step

    # ------------------------------------------------------------------ scheduling
    def _schedule(self, active: list[Request]) -> tuple[list[Request], list[np.ndarray]]:
        """This step's sequences and their pieces: every decode token, then prefill chunks.

        With lookahead and ``defer_unready`` on, a prefill piece runs only as far as its rows
        have been fetched: a turn whose input just arrived waits while its first rows are
        fetched, instead of stalling the whole batch (as servers hold a request whose KV cache
        is still loading). When nothing else could run, it runs at once.
        """
        budget = self.max_step_tokens
        chosen, pieces = [], []
        for r in active:
            if not r.in_prefill:
                chosen.append(r)
                pieces.append(r.next_piece(1))
                budget -= 1
        deferred = []
        for r in active:
            if not r.in_prefill or budget <= 0:
                continue
            allowed = budget
            if self.defer_unready:
                allowed = min(budget, self._ready_ahead(r))
                if allowed == 0:
                    deferred.append(r)
                    continue
            piece = r.next_piece(allowed)
            chosen.append(r)
            pieces.append(piece)
            budget -= piece.size
        if not chosen and deferred:  # nothing else to do: run the first waiting prefill now
            r = deferred[0]
            chosen.append(r)
            pieces.append(r.next_piece(budget))
        return chosen, pieces

    def _ready_ahead(self, r: Request) -> int:
        """Input tokens of r from its position on whose rows are already fetched (windows done;
        unbounded without lookahead)."""
        if not self.lookahead_tokens:
            return self.max_step_tokens
        end = r.fed
        for w in self._windows.get(r.number, []):
            if w.start > end or not w.fetch.done():
                break
            end = max(end, w.end)
        return end - r.fed

    def _hashed_to(self, r: Request) -> int:
        """Where r's tokens stop being hashed: its windows' end, or its position when past them
        (the tokens it decoded since were hashed by their decode steps)."""
        return max(self._hashed.get(r.number, r.fed), r.fed)

    def _issue(self, r: Request, upto: int, urgent: bool = True) -> int:
        """Hash and start fetching r's input up to position ``upto``; returns tokens issued."""
        hashed = self._hashed_to(r)
        issued = 0
        windows = self._windows.setdefault(r.number, [])
        while hashed < upto:
            end = min(upto, hashed + self.window_tokens)
            fetch = self.prefetcher.begin_step([r.number], [r.tokens[hashed:end]], urgent=urgent)
            windows.append(Window(hashed, end, fetch))
            issued += end - hashed
            hashed = end
        self._hashed[r.number] = hashed
        self._issued_tokens += issued
        return issued

    def _lookahead(self, active: list[Request]) -> None:
        """Issue upcoming prefill windows, at most ``lookahead_tokens`` ahead in all."""
        budget = self.lookahead_tokens
        for r in active:
            if budget <= 0:
                return
            if not r.in_prefill:
                continue
            input_end = r.turns[r.turn][0]
            hashed = self._hashed_to(r)
            budget -= hashed - r.fed
            if budget > 0 and hashed == r.fed and hashed < input_end:
                # nothing fetched ahead yet (a turn just started): its first window is needed
                # by the next step, so it goes before the windows fetched further ahead
                budget -= self._issue(r, min(input_end, hashed + self.window_tokens, hashed + budget), urgent=True)
                hashed = self._hashed[r.number]
            if budget > 0 and hashed < input_end:
                budget -= self._issue(r, min(input_end, hashed + budget), urgent=False)

    def _count(self, step: Step) -> None:
        """Rows of a consumed step (windows fetched but not computed by the end are not counted)."""
        if self._run is not None:
            self._run.rows_requested += step.dedup.requested
            self._run.rows_unique += int(step.dedup.unique.size)

    # ------------------------------------------------------------------ one step
    @staticmethod
    def _shape(chosen: list[Request], pieces: list[np.ndarray]) -> StepShape:
        decode = sum(p.size for r, p in zip(chosen, pieces) if not r.in_prefill)
        prefill = sum(p.size for r, p in zip(chosen, pieces) if r.in_prefill)
        return StepShape(tuple(pieces), decode, prefill, sum(r.fed + p.size for r, p in zip(chosen, pieces)))

    def _forward(self, chosen: list[Request], pieces: list[np.ndarray], shape: StepShape) -> float:
        """One step through the model; returns the Engram stall seconds of the step."""
        decoding = [(r, p) for r, p in zip(chosen, pieces) if not r.in_prefill]
        prefill = [(r, p) for r, p in zip(chosen, pieces) if r.in_prefill]
        decode_step = None
        if decoding:
            # a sequence's tokens so far, this step's included: what a drafter proposes from
            drafts = None if self.drafter is None else [self.drafter(r.tokens, r.fed + 1) for r, _ in decoding]
            decode_step = self.prefetcher.begin_step([r.number for r, _ in decoding], [p for _, p in decoding],
                                                     drafts=drafts)
        for r, p in prefill:  # pieces not fetched ahead are fetched now
            self._issue(r, r.fed + p.size)
        self._lookahead([r for r, _ in prefill] + [r for r in self._waiting])
        fetches = ([decode_step] if decode_step else []) + [w.fetch for r, p in prefill for w in self._windows[r.number]
                                                           if w.start < r.fed + p.size and w.end > r.fed]
        stall_before = sum(f.stall_seconds for f in fetches)  # a window's fetch may have stalled an earlier step

        def rows_for(layer_id: int) -> torch.Tensor:
            waited = sum(f.stall_seconds for f in fetches)
            try:
                return layer_rows(layer_id)
            finally:
                if self._run is not None:
                    stalls = self._run.layer_stall_seconds
                    stalls[layer_id] = stalls.get(layer_id, 0.0) + sum(f.stall_seconds for f in fetches) - waited

        def layer_rows(layer_id: int) -> torch.Tensor:
            parts = []
            if decode_step is not None:
                parts.append(self.prefetcher.rows(layer_id, decode_step))  # [n_decode, C, d]
            for r, p in prefill:
                lo, hi = r.fed, r.fed + p.size
                for w in self._windows[r.number]:
                    if w.start < hi and w.end > lo:
                        rows = self.prefetcher.rows(layer_id, w.fetch)  # [window, C, d]
                        parts.append(rows[max(lo, w.start) - w.start: min(hi, w.end) - w.start])
            return torch.cat(parts) if len(parts) > 1 else parts[0]  # [T, C, d]

        try:
            if self.model is None:  # replay: wait for every layer's rows
                for layer_id in self._layers:
                    rows_for(layer_id)
            else:
                self.model.run_step(shape, rows_for)
        except BaseException:
            self._cancel_all()
            raise
        if decode_step is not None:
            self.prefetcher.end_step(decode_step)
            self._count(decode_step)
        for r, p in prefill:  # windows this step used up
            keep = []
            for w in self._windows[r.number]:
                if w.end <= r.fed + p.size:
                    self.prefetcher.end_step(w.fetch)
                    self._count(w.fetch)
                else:
                    keep.append(w)
            self._windows[r.number] = keep
        return sum(f.stall_seconds for f in fetches) - stall_before

    def _cancel_all(self) -> None:
        for windows in self._windows.values():
            for w in windows:
                self.prefetcher.cancel(w.fetch)
        self._windows.clear()
        self._hashed.clear()

    def _forget(self, r: Request) -> None:
        for w in self._windows.pop(r.number, []):
            self.prefetcher.cancel(w.fetch)
        self._hashed.pop(r.number, None)
        self.prefetcher.release_sequence(r.number)

    # ------------------------------------------------------------------ the loop
    def run(self, stream: RequestStream, seconds: float, *,
            on_step: Callable[[float], Any] | None = None, max_steps: int | None = None,
            agree: Callable[[bool], bool] | None = None) -> EngineRun:
        """Serve requests from ``stream`` for ``seconds`` (or ``max_steps``); in-flight
        requests at the end are counted with what they did, then their histories released.
        ``agree`` turns this process's "go on" into the one its tensor-parallel group agrees
        on before each step, so that ranks that exchange rows run the same steps."""
        run = EngineRun()
        self._run = run
        active: list[Request] = []
        done: list[Request] = []
        start = time.perf_counter()
        deadline = start + seconds
        now = start

        def go_on() -> bool:
            more = now < deadline and (max_steps is None or run.steps < max_steps)
            return more if agree is None else agree(more)

        try:
            while go_on():
                while len(active) < self.concurrency:
                    r = stream.next()
                    r.turn_started = now
                    active.append(r)
                chosen, pieces = self._schedule(active)
                scheduled = {r.number for r in chosen}
                self._waiting = [r for r in active if r.number not in scheduled]
                shape = self._shape(chosen, pieces)
                t0 = time.perf_counter()
                issued_before = self._issued_tokens
                stall = self._forward(chosen, pieces, shape)
                now = time.perf_counter()
                run.step_fetched_prefill.append(self._issued_tokens - issued_before)
                run.step_seconds.append(now - t0)
                run.stall_seconds.append(stall)
                run.step_tokens.append((shape.decode_tokens, shape.prefill_tokens, shape.kv_tokens))
                run.steps += 1
                for r, piece in zip(chosen, pieces):
                    if r.in_prefill:
                        run.prefill_tokens += piece.size
                    else:
                        run.decode_tokens += piece.size
                    r.advance(piece.size, now)
                    if r.done:
                        done.append(r)
                        self._forget(r)
                active = [r for r in active if not r.done]
                if on_step is not None:
                    on_step(now - start)
        finally:
            for r in active:
                self._forget(r)
            self._run = None
        run.seconds = now - start
        run.tokens = run.prefill_tokens + run.decode_tokens
        run.finished = len(done)
        run.requests = done + active
        return run
