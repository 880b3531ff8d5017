"""``Step``: the tokens whose rows are fetched together, and their life cycle.

A step hands its parts to the workers, takes each part's rows or error, waits for a layer
(the wait is its stall) and lets go of its cache pins. ``Part``: a slice of the step's
sorted distinct ids holding every id of some Engram layers.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np
import torch

from ..errors import PrefetchError, StepCancelled
from ..gpu.sync import MAIN
from .dedup import Dedup
from .outputs import Outputs
from .store import RowLease

__all__ = ["Part", "Step"]

Part = tuple[int, int, tuple[int, ...]]  # (lo, hi, layer positions): dedup.unique[lo:hi] holds those layers' ids


class Step:
    """Tokens whose rows are fetched together (a serving step, or a prefill window fetched
    ahead): their row ids, the dedup, and, part by part, the decoded rows.

    The distinct ids are fetched in ``parts`` (``(lo, hi, layer positions)``, a slice of
    ``dedup.unique`` holding every id of those layers); each part is delivered and
    signalled on its own. With ``outputs`` (on a device) each part's rows go straight into
    its layers' buffers, ready after the part's event.
    """

    wait_s: float = 60.0  # the longest wait in rows() when no timeout is given (the Prefetcher's wait_s)
    source = "the store"  # what the rows come from, for messages

    def __init__(self, number: int, seq_ids: tuple[int, ...], lengths: tuple[int, ...],
                 table_ids: np.ndarray | torch.Tensor, d: Dedup, layer_ids: tuple[int, ...],
                 parts: list[Part] | None = None, outputs: Outputs | None = None) -> None:
        self.number = number
        self.seq_ids = seq_ids
        self.lengths = lengths  # tokens per sequence, in seq_ids order
        self._table_ids = table_ids  # int64 [T, L, C] flat table ids (C: the rank's columns)
        self.dedup = d
        self.layer_ids = layer_ids
        self.parts = parts or [(0, int(d.unique.size), tuple(range(len(layer_ids))))]
        self.error: BaseException | None = None  # the first failure
        self.cancelled = False
        self.stall_seconds = 0.0  # time spent in rows() waiting for parts not yet delivered
        self.stalls = 0  # how many of those waits there were
        self.fetch_seconds = 0.0  # from creation until every part was delivered, failed or skipped
        self.first_part_seconds = 0.0  # until the first part was
        self.started = time.perf_counter()
        self._part_of = {li: p for p, (_, _, lis) in enumerate(self.parts) for li in lis}
        self._errors: list[BaseException | None] = [None] * len(self.parts)
        self._delivered = [threading.Event() for _ in self.parts]
        self._done = threading.Event()
        self._leases: list[RowLease] = []
        self._layer_rows: dict[int, torch.Tensor] = {}  # the layers rows() returned
        self._decoded: dict[int, torch.Tensor] = {}  # on the host: every delivered layer's rows [T, C, d]
        self._lock = threading.Lock()
        self._handed_out = 0
        self._parts_left = len(self.parts)
        self.outputs = outputs
        self.layer_outputs = outputs.views(self.num_tokens) if outputs is not None else []  # [T, C, d] each
        self._events: list[object] = [None] * len(self.parts)  # device: each part's rows are there after it
        self._when_done: list[Callable[[], None]] = []

    @property
    def table_ids(self) -> torch.Tensor:
        """int64 ``[T, L, C]``: the step's flat table ids (``C``: the rank's columns).

        Made a tensor only when asked for: a tensor's end lets go of the GIL, a thread switch
        while a prefetch worker waits for it."""
        if isinstance(self._table_ids, np.ndarray):  # the hasher's may be a transposed view
            self._table_ids = torch.from_numpy(np.ascontiguousarray(self._table_ids))
        return self._table_ids

    @property
    def num_tokens(self) -> int:
        return int(self._table_ids.shape[0])

    @property
    def num_columns(self) -> int:
        """Columns of each layer this step fetches (all of them, or a rank's)."""
        return int(self._table_ids.shape[-1])

    def done(self) -> bool:
        return self._done.is_set()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until every part is delivered, failed or skipped; False on timeout."""
        return self._done.wait(timeout)

    # ------------------------------------------------------------------ the worker's side
    def take_part(self) -> tuple[int, bool]:
        """The next part to fetch, and whether it is the last one to hand out."""
        with self._lock:
            p = self._handed_out
            self._handed_out += 1
            return p, self._handed_out >= len(self.parts)

    def layer_index(self, li: int) -> tuple[np.ndarray, int]:
        """Layer position ``li``'s ids as positions in the step's distinct ids, token-major
        (int64 ``[T, C]``, a strided view of the inverse), and its part's first position:
        ``index - base`` are positions in the part's rows.

        A view and an offset, no array op: a NumPy op over a step's ids lets go of the GIL,
        and each let-go while the caller's thread waits for it costs a thread switch (tens
        of microseconds on a virtual CPU). The C decoder reads the view in place."""
        inverse = self.dedup.inverse.reshape(self.num_tokens, len(self.layer_ids), self.num_columns)
        return inverse[:, li], self.parts[self._part_of[li]][0]

    def layer_positions(self, li: int) -> np.ndarray:
        """Positions in its part's rows of layer position ``li``'s ids, token-major: int64 ``[T*C]``."""
        index, base = self.layer_index(li)
        return index.reshape(-1) - base

    def part_ids(self, p: int) -> tuple[np.ndarray, int]:
        """Distinct ids of part ``p`` and how many ids of the step they stand for."""
        lo, hi, lis = self.parts[p]
        return self.dedup.unique[lo:hi], self.num_tokens * self.num_columns * len(lis)

    @property
    def skipping(self) -> bool:
        """Whether parts not fetched yet should be skipped (cancelled, or an earlier part failed)."""
        return self.cancelled or self.error is not None

    def deliver(self, p: int, rows: dict[int, torch.Tensor] | None, lease: RowLease, event: object = None) -> None:
        """Part ``p``'s decoded rows, ``{layer id: [T, C, head_dim]}`` for each of its layers
        (None on a device: its layers' outputs hold them after ``event``), pinned by ``lease``."""
        with self._lock:
            if self.cancelled:
                lease.release()
            else:
                self._leases.append(lease)
            if rows is not None:
                self._decoded.update(rows)
            self._events[p] = event
        self._finish_part(p)

    def fail(self, p: int, error: BaseException) -> None:
        """Part ``p`` failed (or was skipped after an earlier failure) with ``error``."""
        with self._lock:
            self._errors[p] = error
            if self.error is None:
                self.error = error
        self._finish_part(p)

    def skip(self, p: int) -> None:
        """Part ``p`` is not fetched: the step was cancelled or an earlier part failed."""
        if self.error is not None:
            self.fail(p, self.error)
        else:
            self._finish_part(p)

    def _finish_part(self, p: int) -> None:
        with self._lock:
            now = time.perf_counter()
            if p == 0:
                self.first_part_seconds = now - self.started
            self._parts_left -= 1
            last = self._parts_left == 0
            if last:
                self.fetch_seconds = now - self.started
                then, self._when_done = self._when_done, []
        self._delivered[p].set()
        if last:
            self._done.set()
            for fn in then:
                fn()

    def when_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once every part is delivered, failed or skipped (now, if they are)."""
        with self._lock:
            if self._parts_left:
                self._when_done.append(fn)
                return
        fn()

    # ------------------------------------------------------------------ the consumer's side
    def rows(self, layer_id: int, timeout: float | None = None) -> torch.Tensor:
        """Rows of Engram layer ``layer_id``: ``[T, C, head_dim]`` (``C``: the columns fetched),
        waiting for its part if needed (the wait is recorded as stall). Raises
        ``PrefetchError`` (cause attached), ``StepCancelled``, or ``TimeoutError`` after
        ``timeout`` seconds (default ``wait_s``)."""
        if layer_id not in self.layer_ids:
            raise KeyError(f"layer {layer_id} is not an Engram layer; Engram layers: {list(self.layer_ids)}")
        cached = self._layer_rows.get(layer_id)
        if cached is not None:
            return cached
        li = self.layer_ids.index(layer_id)
        p = self._part_of[li]
        self._wait_part(p, layer_id, timeout)
        if self.cancelled:
            raise StepCancelled(f"step {self.number} was cancelled; begin a new step")
        error = self._errors[p]
        if error is not None:
            raise PrefetchError(
                f"fetching the rows of step {self.number} ({self.dedup.unique.size} rows) failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        if self.outputs is not None:
            return self._device_rows(layer_id, li, p)
        rows = self._decoded[layer_id]  # [T, C, d], decoded by the worker
        self._layer_rows[layer_id] = rows
        return rows

    def _device_rows(self, layer_id: int, li: int, p: int) -> torch.Tensor:
        """The layer's output buffer, once the caller's stream has waited for its part."""
        outputs = self.outputs
        assert outputs is not None
        outputs.sync.wait(MAIN, self._events[p])
        outputs.sync.run(MAIN, _read_rows, reads={outputs.name: [li]})
        rows = self.layer_outputs[li]
        self._layer_rows[layer_id] = rows  # [T, C, d]
        return rows

    def _wait_part(self, p: int, layer_id: int, timeout: float | None) -> None:
        """Wait for part ``p``; the time waited for a part not yet there is the stall."""
        delivered = self._delivered[p]
        if delivered.is_set():
            return
        t0 = time.perf_counter()
        timeout = self.wait_s if timeout is None else timeout
        if not delivered.wait(timeout):
            raise TimeoutError(f"rows of layer {layer_id} of step {self.number} not delivered after {timeout:g} s: "
                               f"{self.source} did not return them (Prefetcher wait_s= or timeout= sets the wait)")
        self.add_stall(time.perf_counter() - t0)

    def add_stall(self, seconds: float) -> None:
        """Count ``seconds`` the consumer spent waiting for (or fetching) this step's rows."""
        with self._lock:
            self.stall_seconds += seconds
            self.stalls += 1

    def cancel(self) -> None:
        """Skip the parts not fetched yet and let go of the pins (rows already delivered stay)."""
        with self._lock:
            self.cancelled = True
        self.release()

    def release(self) -> None:
        """Let go of the step's cache pins (its delivered rows stay usable)."""
        with self._lock:
            leases, self._leases = self._leases, []
        for lease in leases:
            lease.release()

    def __repr__(self) -> str:
        state = "failed" if self.error else "cancelled" if self.cancelled else "ready" if self.done() else "fetching"
        return (f"Step({self.number}, tokens={self.num_tokens}, unique={self.dedup.unique.size}/"
                f"{self.dedup.requested}, parts={len(self.parts)}, {state})")


def _read_rows() -> None:
    """No device work: marks where the caller's stream starts reading a layer's rows."""
