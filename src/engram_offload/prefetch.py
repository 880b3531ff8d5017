"""``Prefetcher``: fetch a step's Engram rows in the background while the backbone runs.

Row ids depend only on token ids, so at forward entry a server knows every row the step
will need. ``begin_step`` hashes the step's tokens (advancing each sequence's hasher
history), deduplicates the ids of every token and every Engram layer at once, and hands
the fetch to a background worker. ``rows(layer_id)`` returns that layer's rows, waiting
only if they are not there yet; the wait is recorded as stall.

Failures: an error in the worker is kept with its step and raised by ``rows()`` as a
``PrefetchError`` whose ``__cause__`` is the original error; the worker goes on serving
later steps. A cancelled step raises ``StepCancelled``. Rows of a step stay pinned in the
store's caches until ``end_step`` (or until the step is cancelled), so a prefetch for the
next step can never evict rows this step still reads.

    EngramError
    └── PrefetchError         the background fetch of a step failed (cause attached)
        └── StepCancelled     rows were asked of a cancelled step
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Sequence

import numpy as np
import torch

from .dedup import Dedup, dedup
from .errors import EngramError
from .hashing import NgramHasher, SequenceHistory
from .rows import decode_rows

__all__ = ["Prefetcher", "PrefetchError", "Step", "StepCancelled"]


class PrefetchError(EngramError):
    """The background fetch of a step failed; ``__cause__`` holds the original error."""


class StepCancelled(PrefetchError):
    """Rows were asked of a step that was cancelled."""


class Step:
    """One serving step: its row ids, their dedup, and (once fetched) the staged rows."""

    def __init__(self, number: int, seq_ids: tuple[int, ...], lengths: tuple[int, ...],
                 table_ids: torch.Tensor, d: Dedup, layer_ids: tuple[int, ...]) -> None:
        self.number = number
        self.seq_ids = seq_ids
        self.lengths = lengths  # tokens per sequence, in seq_ids order
        self.table_ids = table_ids  # int64 [T, L, C] flat table ids
        self.dedup = d
        self.layer_ids = layer_ids
        self.staged: torch.Tensor | None = None  # [u, head_dim] rows of d.unique
        self.error: BaseException | None = None
        self.cancelled = False
        self.stall_seconds = 0.0
        self.fetch_seconds = 0.0
        self.started = time.perf_counter()
        self._done = threading.Event()
        self._lease: Any = None
        self._lock = threading.Lock()
        self._layer_rows: dict[int, torch.Tensor] = {}

    @property
    def num_tokens(self) -> int:
        return int(self.table_ids.shape[0])

    def done(self) -> bool:
        return self._done.is_set()

    def _finish(self, staged: torch.Tensor | None, lease: Any, error: BaseException | None) -> None:
        with self._lock:
            if self.cancelled and lease is not None:
                lease.release()
                lease = None
            self.staged, self._lease, self.error = staged, lease, error
            self.fetch_seconds = time.perf_counter() - self.started
        self._done.set()

    def release(self) -> None:
        """Let go of the step's cache pins (its staged rows stay usable)."""
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    def __repr__(self) -> str:
        state = "failed" if self.error else "cancelled" if self.cancelled else "ready" if self.done() else "fetching"
        return (f"Step({self.number}, tokens={self.num_tokens}, unique={self.dedup.unique.size}/"
                f"{self.dedup.requested}, {state})")


class Prefetcher:
    """Background fetch of each step's rows from ``store`` for the layers of ``hasher.config``.

    ``store`` is a cached store (``fetch`` pins the step's rows) or any store with
    ``read_raw``. Rows are dequantized to ``dtype`` on ``device`` (default: the store's).
    One worker thread serves steps in order; use as a context manager or call ``close``.
    """

    def __init__(
        self,
        store: Any,
        hasher: NgramHasher,
        *,
        history: SequenceHistory | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
    ) -> None:
        if store.config.num_rows != hasher.config.num_rows or store.config.layer_ids != hasher.config.layer_ids:
            raise ValueError(
                "the store's table and the hasher's config have different layouts: build the hasher "
                "with NgramHasher(store.config, token_map)"
            )
        self.store = store
        self.hasher = hasher
        self.config = hasher.config
        self.history = history if history is not None else hasher.new_history()
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else getattr(store, "device", torch.device("cpu"))
        self._queue: queue.SimpleQueue[Step | None] = queue.SimpleQueue()
        self._step_count = 0
        self.current: Step | None = None
        self._open: list[Step] = []
        self._lock = threading.Lock()
        self.steps = 0
        self.failures = 0
        self.stall_seconds = 0.0
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="engram-prefetch", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        while True:
            step = self._queue.get()
            if step is None:
                return
            if step.cancelled:
                step._finish(None, None, None)
                continue
            lease = None
            try:
                lease, raw = self._fetch(step.dedup)
                staged = decode_rows(raw.to(self.device), self.config.row_format, self.config.head_dim, self.dtype)
                step._finish(staged, lease, None)
            except BaseException as exc:  # kept for the caller; the worker carries on
                if lease is not None:
                    lease.release()
                with self._lock:
                    self.failures += 1
                step._finish(None, None, exc)

    def _fetch(self, d: Dedup) -> tuple[Any, torch.Tensor]:
        fetch = getattr(self.store, "fetch", None)
        if fetch is not None:
            lease = fetch(d.unique, hold=True, requested=d.requested)
            return lease, lease.raw
        return None, self.store.read_raw(d.unique)

    # ------------------------------------------------------------------ steps
    def begin_step(
        self,
        seq_ids: Sequence[int],
        pieces: Sequence[Any],
        dead: Sequence[Any] | None = None,
    ) -> Step:
        """Hash the step's new tokens per sequence and start fetching every layer's rows.

        ``pieces[i]`` holds the new token ids of sequence ``seq_ids[i]`` (a prefill chunk or
        one decode token). Returns the ``Step``; it also becomes ``current``.
        """
        if self._closed:
            raise ValueError("this prefetcher is closed: create a new one")
        if not self._worker.is_alive():  # never expected: the worker catches everything
            raise PrefetchError("the prefetch worker has stopped; create a new Prefetcher")
        seq_ids = tuple(int(s) for s in seq_ids)
        arrays = [np.asarray(p.detach().cpu() if isinstance(p, torch.Tensor) else p).reshape(-1) for p in pieces]
        if len(arrays) != len(seq_ids):
            raise ValueError(f"{len(arrays)} pieces for {len(seq_ids)} sequences")
        if dead is None and arrays and all(a.size == 1 for a in arrays):
            rows = self.hasher.hash_decode(self.history, seq_ids, np.concatenate(arrays))  # [S, L, C]
        else:
            rows = self.hasher.hash_pieces(self.history, seq_ids, arrays, dead)  # [T, L, C]
        table_ids = self.hasher.table_ids(rows)  # [T, L, C]
        d = dedup(table_ids)
        with self._lock:
            self._step_count += 1
            step = Step(self._step_count, seq_ids, tuple(a.size for a in arrays), table_ids, d,
                        self.config.layer_ids)
            self.current = step
            self._open.append(step)
        self._queue.put(step)
        return step

    def rows(self, layer_id: int, step: Step | None = None, *, timeout: float | None = None) -> torch.Tensor:
        """Rows of Engram layer ``layer_id`` for the step: ``[T, C, head_dim]`` of ``dtype``.

        Waits if the fetch is still running (the wait is recorded as stall). Raises the
        worker's failure as ``PrefetchError`` (cause attached), ``StepCancelled`` for a
        cancelled step, and ``TimeoutError`` after ``timeout`` seconds.
        """
        step = step or self.current
        if step is None:
            raise ValueError("no step in flight: call begin_step(seq_ids, pieces) first")
        if layer_id not in step.layer_ids:
            raise KeyError(f"layer {layer_id} is not an Engram layer; Engram layers: {list(step.layer_ids)}")
        cached = step._layer_rows.get(layer_id)
        if cached is not None:
            return cached
        t0 = time.perf_counter()
        if not step._done.wait(timeout):
            raise TimeoutError(f"rows of step {step.number} not ready after {timeout} s")
        waited = time.perf_counter() - t0
        step.stall_seconds += waited
        with self._lock:
            self.stall_seconds += waited
        record = getattr(self.store, "record_stall", None)
        if record is not None:
            record(waited)
        if step.cancelled:
            raise StepCancelled(f"step {step.number} was cancelled; begin a new step")
        if step.error is not None:
            raise PrefetchError(
                f"fetching the rows of step {step.number} ({step.dedup.unique.size} rows) failed: "
                f"{type(step.error).__name__}: {step.error}"
            ) from step.error
        assert step.staged is not None
        li = step.layer_ids.index(layer_id)
        inverse = torch.from_numpy(step.dedup.inverse).view(step.num_tokens, len(step.layer_ids), -1)
        index = inverse[:, li].reshape(-1).to(step.staged.device)  # [T*C]
        rows = step.staged.index_select(0, index).view(step.num_tokens, -1, self.config.head_dim)  # [T, C, d]
        step._layer_rows[layer_id] = rows
        return rows

    def end_step(self, step: Step | None = None) -> None:
        """Finish a step: release its cache pins (waits for its fetch to end first)."""
        step = step or self.current
        if step is None:
            return
        step._done.wait()
        step.release()
        with self._lock:
            if step in self._open:
                self._open.remove(step)
                self.steps += 1
            if self.current is step:
                self.current = None

    def cancel(self, step: Step | None = None) -> None:
        """Cancel a step: its fetch is skipped if not started, and its pins are let go."""
        step = step or self.current
        if step is None:
            return
        with step._lock:
            step.cancelled = True
            lease, step._lease = step._lease, None
        if lease is not None:
            lease.release()
        with self._lock:
            if step in self._open:
                self._open.remove(step)
            if self.current is step:
                self.current = None

    def release_sequence(self, seq_id: int) -> None:
        """Forget a finished sequence's hashing history."""
        self.history.release(seq_id)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"steps": self.steps, "failures": self.failures, "stall_seconds": self.stall_seconds,
                    "open_steps": len(self._open)}

    def close(self) -> None:
        """End open steps and stop the worker."""
        if self._closed:
            return
        self._closed = True
        for step in list(self._open):
            self.cancel(step)
        self._queue.put(None)
        self._worker.join(timeout=30)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
