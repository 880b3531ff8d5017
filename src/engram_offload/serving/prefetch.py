"""``Prefetcher``: fetch a step's Engram rows in the background while the backbone runs.

Row ids depend only on token ids, so at forward entry a server knows every row the step
will need. ``begin_step`` hashes the step's tokens (advancing each sequence's hasher
history), deduplicates the ids of every token and every Engram layer at once, and queues
the ``Step`` for a background worker. ``rows(layer_id)`` returns that layer's rows, waiting
only if they are not there yet; the wait is the step's stall.

Layers arrive in order. Every layer's rows sit in its own range of the table's flat row
space (layer 1's below layer 14's in V4.1-Flash), so the step's sorted distinct ids split
at the layer boundaries into parts: the worker fetches and decodes the first Engram
layer's part, makes it available, then the next layer's. Only the backbone's layers before
the first Engram layer overlap the first fetch, so ``rows(first_layer)`` need not wait for
the rest. Steps under ``split_min_rows`` distinct rows are fetched in one part (a second
fetch call costs more than it saves there).

Who does what: a ``Step`` owns its life cycle (it hands out its parts, takes their rows or
their error, waits for a layer and records that wait as its stall, lets go of its pins);
the ``Prefetcher`` only hashes, queues steps and runs the workers. The store fetches and
decodes.

On a device (a store opened with ``device=``, whose ``sync`` orders its device work), rows
never pass through a pageable copy: ``begin_step`` makes the fetch stream wait for the work
the caller's stream has enqueued so far (``side.wait_stream(main)``: the ids are made and the
last step's rows read), the store delivers each part's raw rows to the device (HBM hits,
UVA reads, or pinned staging), and the worker dequantizes every layer's rows on the fetch
stream into that layer's output buffer. ``rows(layer)`` makes the caller's stream wait for
the part's event and returns a view of the buffer. Buffers are reused from step to step
(a step takes the set the last ended step gave back), so their addresses stay fixed and a
CUDA graph can be captured around the layers that read them, with the fetch outside it
(``max_tokens`` allocates them at once, so they do not move when a step grows). Ids and
row orders go to the device through ``DeviceSync.upload`` (a pinned ring), never a blocking
copy.

Failures: an error in the worker is kept with its step and raised by ``rows()`` as a
``PrefetchError`` whose ``__cause__`` is the original error; the worker goes on serving
later steps (a failed part fails every part after it; layers already delivered stay
usable). A cancelled step raises ``StepCancelled``. Rows of a step stay pinned in the
store's caches until ``end_step`` (or until the step is cancelled), so a prefetch for the
next step can never evict rows this step still reads.

Drafts: speculative decoding knows the next tokens before they are verified (an MTP head, a
draft model, a prompt-lookup match). ``begin_step(..., drafts=)`` takes, per sequence, the
draft tokens after this step's token; their row ids are hashed on a copy of each sequence's
history (the real one is not touched) and fetched in the background, after every urgent
step and ahead of the prefill windows fetched further ahead (a ``_DraftStep``: no rows
decoded, its pins held until the next step's own fetch is done). The next step fetches its real rows as always: those a right draft brought in are
cache hits, the rest are read as without drafts. A wrong draft costs reads, never rows: it
only ever warms the store's caches. ``draft_stats()`` counts the next steps' rows a draft
had already fetched and the draft rows no next step asked for. Drafts pay only with a
row cache in front of a tier that reads (``direct``, ``remote``): a resident table has
nothing to fetch early.

Tensor parallelism: a rank that owns the columns ``[c0, c1)`` of every layer
(``sharding.shard_columns``) hashes every column (an n-gram's hash needs the whole n-gram and
costs little) but keeps, fetches and returns only its own: ``rows(layer)`` is
``[T, c1 - c0, head_dim]``, and ``sharding.assemble_columns`` all-gathers the full rows. The
columns come from the store (a store opened with ``columns=`` serves only their rows: the
one source of truth); ``Prefetcher(..., columns=)`` is for a store that serves every row (a
``shared`` table, a row server), and must match the store's columns when it has some.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .._native import env_choice
from ..buffers.recycle import RecycledArrays
from ..engram.hashing import NgramHasher, SequenceHistory
from ..errors import PrefetchError, StepCancelled
from ..gpu.kernels import gather_rows
from ..gpu.sync import FETCH, MAIN, DeviceSync
from .dedup import Dedup, dedup
from .sharding import Columns, check_columns, shard_ids
from .store import RowLease, RowStore

__all__ = ["Prefetcher", "PrefetchError", "Step", "StepCancelled", "HIT_ROWS_ENV", "HIT_ROWS"]

SPLIT_MIN_ROWS = 512  # a step with fewer distinct rows is fetched in one part (one fetch call)
Part = tuple[int, int, tuple[int, ...]]  # (lo, hi, layer positions): dedup.unique[lo:hi] holds those layers' ids
HIT_ROWS_ENV = "ENGRAM_OFFLOAD_HIT_ROWS"
HIT_ROWS = ("in-place", "copied")


def _hit_rows_in_place() -> bool:
    """Whether host rows a cache holds every one of are decoded where it holds them
    (``ENGRAM_OFFLOAD_HIT_ROWS`` unset or "in-place") or copied out of it first ("copied"): a
    switch for measuring one against the other, read when a Prefetcher is made."""
    return env_choice(HIT_ROWS_ENV, HIT_ROWS, "a way to take hit rows") == HIT_ROWS[0]


class Outputs:
    """One set of per-layer output buffers on the device, ``[T_max, C, head_dim]`` each (``C``:
    the columns fetched), reused from step to step. With ``max_tokens`` they are allocated at
    once and never move (a larger step raises); without, they grow (new addresses) when a
    step has more tokens than any before."""

    def __init__(self, name: str, sync: DeviceSync, shape: tuple[int, int], layers: int,
                 dtype: torch.dtype, device: torch.device, max_tokens: int | None = None) -> None:
        self.name = name  # how DeviceSync names these buffers (one part per layer)
        self.sync = sync
        self._shape, self._layers, self._dtype, self._device = shape, layers, dtype, device
        self.max_tokens = max_tokens
        self._buffers: list[torch.Tensor] = []
        if max_tokens is not None:
            self._allocate(max_tokens)

    def _allocate(self, tokens: int) -> None:
        """Buffers allocated on the caller's stream, kept alive on the fetch stream that writes them."""
        self._buffers = [self.sync.empty(MAIN, (tokens, *self._shape), self._dtype, self._device)
                         for _ in range(self._layers)]
        for buffer in self._buffers:
            self.sync.keep_alive(buffer, FETCH)

    def views(self, tokens: int) -> list[torch.Tensor]:
        """Per-layer ``[tokens, C, head_dim]`` views of the buffers."""
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise ValueError(f"a step of {tokens} tokens is more than max_tokens={self.max_tokens}: the output "
                             "buffers keep their addresses (for CUDA graphs); make the Prefetcher with a larger "
                             "max_tokens")
        if not self._buffers or self._buffers[0].shape[0] < tokens:
            self._allocate(tokens)
        return [b[:tokens] for b in self._buffers]


class _OutputPool:
    """Output sets handed to steps; the last one given back is taken first."""

    def __init__(self, sync: DeviceSync, shape: tuple[int, int], layers: int, dtype: torch.dtype,
                 device: torch.device, max_tokens: int | None = None) -> None:
        self._make = lambda n: Outputs(f"prefetch_rows{n}", sync, shape, layers, dtype, device, max_tokens)
        self._free: list[Outputs] = []
        self._made = 0
        self._lock = threading.Lock()
        if max_tokens is not None:
            self._free.append(self._make_one())  # the first set exists before the first capture

    def _make_one(self) -> Outputs:
        self._made += 1
        return self._make(self._made)

    def take(self) -> Outputs:
        with self._lock:
            if self._free:
                return self._free.pop()
            return self._make_one()

    def give(self, outputs: Outputs) -> None:
        with self._lock:
            self._free.append(outputs)


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


class _DraftStep(Step):
    """The rows of draft tokens, fetched ahead of the step that may need them: one part, no
    layer decoded (``deliver`` keeps only the lease that pins the rows in the caches)."""

    def part_ids(self, p: int) -> tuple[np.ndarray, int]:
        return self.dedup.unique, int(self.dedup.unique.size)


def _read_rows() -> None:
    """No device work: marks where the caller's stream starts reading a layer's rows."""


class Prefetcher:
    """Background fetch of each step's rows from ``store`` for the layers of ``hasher.config``.

    Rows are decoded to ``dtype`` on ``device``, which must be the store's (the default): a
    store opened with ``device=`` delivers to that device, and the step's rows are then
    dequantized there on the fetch stream (see the module doc). Two worker threads serve
    steps in order, urgent ones first, and each step's parts in order; one of them serves
    only urgent steps. A caller asking for host rows whose part no worker has taken yet,
    both being busy, fetches the step's parts up to it itself rather than wait behind them.
    Use as a context manager or call ``close``.

    ``columns``: the column shard ``[c0, c1)`` whose rows ``rows()`` returns (default: the
    store's ``columns``, else every column); see the module doc.

    ``split_min_rows``: a step with fewer distinct rows is fetched in one part (default
    ``SPLIT_MIN_ROWS``; 1, every step split by layer, for a store whose layers sit on
    different tiers).

    ``first_layer_first``: workers take the queued part of the earliest Engram layer first
    (each step's parts still in order), so a step's first layer never waits behind another
    step's later layer; by default on for a store whose layers sit on different tiers
    (``serving.layered``), where a later layer's part may be a drive read and the first
    layer's a DRAM copy due within the layers before it.

    ``max_tokens`` (on a device): the most tokens a step may have; the first set of output
    buffers is allocated at once for that many and never moves, so a CUDA graph captured
    around the consuming layers stays valid even when steps grow (a larger step raises).
    A step fetched ahead while another is open takes another set (fixed too).

    ``wait_s``: the longest wait on the store (in ``rows``, ``end_step`` and ``close``); past it
    they raise ``TimeoutError`` naming the store. A store whose fetch never returns keeps a
    worker inside it: bound the store's own waits too (``RowClient(timeout_s=)``).
    """

    def __init__(
        self,
        store: RowStore,
        hasher: NgramHasher,
        *,
        history: SequenceHistory | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        split_min_rows: int | None = None,
        columns: Columns | None = None,
        max_tokens: int | None = None,
        wait_s: float = 60.0,
        first_layer_first: bool | None = None,
    ) -> None:
        if not wait_s > 0:
            raise ValueError(f"wait_s must be > 0, got {wait_s}")
        self.wait_s = float(wait_s)
        if store.config.num_rows != hasher.config.num_rows or store.config.layer_ids != hasher.config.layer_ids:
            raise ValueError(
                "the store's table and the hasher's config have different layouts: build the hasher "
                "with NgramHasher(store.config, token_map)"
            )
        self.store = store
        self._source = repr(store)  # for a step's messages, made once (a store's repr costs tens of us)
        self.hasher = hasher
        self.config = hasher.config
        # a store with its layers on different tiers (serving.layered): an early layer's rows
        # are quick to fetch and due soon, so they never wait for a later layer's slow ones:
        # every step in one part per layer, however small, and early layers' parts first
        layered = len(set(getattr(store, "placement", {}).values())) > 1
        self.first_layer_first = layered if first_layer_first is None else bool(first_layer_first)
        self.columns = _columns(store, columns, self.config.cols_per_layer)
        num_columns = self.config.cols_per_layer if self.columns is None else self.columns[1] - self.columns[0]
        self.history = history if history is not None else hasher.new_history()
        self.dtype = dtype
        self.split_min_rows = (1 if layered else SPLIT_MIN_ROWS) if split_min_rows is None else int(split_min_rows)
        self._layer_bases_list = [int(b) for b in self.config.layer_row_bases]  # first row of each layer
        self.device = torch.device(device) if device is not None else store.device
        if self.device != store.device:
            raise ValueError(f"the store delivers rows to {store.device}, not {self.device}: open the table "
                             f"with open_table(..., device={str(self.device)!r}) so rows reach the device "
                             "through pinned staging, never a pageable copy")
        self.sync = store.sync  # None: rows are on the host (or a fast cache's device) when fetched
        # host rows decoded into arrays used again once the caller lets go of them (a new
        # array a step comes back from the kernel as fresh pages: see recycle)
        self._decoded = RecycledArrays()
        self.rows_in_place = _hit_rows_in_place()  # host rows decoded where a cache holds them, if it does
        self._outputs = None if self.sync is None else _OutputPool(
            self.sync, (num_columns, self.config.head_dim), len(self.config.layer_ids), dtype,
            self.device, max_tokens)
        queue_lock = threading.Lock()
        # each worker waits on its own condition, so a new step wakes only the one it needs
        self._wake = {False: threading.Condition(queue_lock), True: threading.Condition(queue_lock)}
        self._idle = {False: False, True: False}  # by urgent_only: waiting for work
        self._urgent: deque[Step] = deque()  # steps whose rows are needed now
        self._background: deque[Step] = deque()  # steps fetched ahead of need
        self._stopping = False
        self._step_count = 0
        self.current: Step | None = None
        self._open: list[Step] = []
        self._lock = threading.Lock()
        self.steps = 0
        self.failures = 0
        self.stall_seconds = 0.0  # the stalls of the steps ended or cancelled
        self._closed = False
        self._draft: _DraftStep | None = None  # the last step's drafts, until the next step is fetched
        self._draft_counts = {"draft_steps": 0, "draft_rows": 0, "next_steps": 0, "next_rows": 0,
                              "next_rows_fetched": 0, "draft_rows_unused": 0}
        # one worker serves every step; a second serves only urgent ones, so a step's own
        # fetch never waits behind a long fetch ahead of need
        self._workers = [threading.Thread(target=self._run, args=(urgent_only,), daemon=True,
                                          name=f"engram-prefetch-{i}")
                         for i, urgent_only in enumerate((False, True))]
        for worker in self._workers:
            worker.start()

    # ------------------------------------------------------------------ the workers
    def _next_part(self, urgent_only: bool) -> tuple[Step, int] | None:
        """The next part to fetch: urgent steps first, then (unless ``urgent_only``) steps
        fetched ahead, each in order; None once closed and drained. A step fetched ahead
        yields to an urgent one between its parts."""
        wake = self._wake[urgent_only]
        with wake:
            while not self._urgent and (urgent_only or not self._background):
                if self._stopping:
                    return None
                self._idle[urgent_only] = True
                wake.wait()
                self._idle[urgent_only] = False
            waiting = self._urgent if self._urgent else self._background
            step = self._pick(waiting)
            p = self._hand_out(step, waiting)
            return step, p

    @staticmethod
    def _hand_out(step: Step, waiting: deque[Step]) -> int:
        """The next part of ``step`` (queued in ``waiting``), taking the step off the queue once
        its last part is handed out; the queue's lock is held."""
        p, last = step.take_part()
        if last:
            waiting.remove(step)
        return p

    def _pick(self, waiting: deque[Step]) -> Step:
        """The step whose part is fetched next: the first queued, or with ``first_layer_first``
        the first of those with the fewest parts handed out (an early layer's part before a
        later layer's part of a step queued before it)."""
        if not self.first_layer_first or len(waiting) == 1:
            return waiting[0]
        return min(waiting, key=lambda step: step._handed_out)  # min keeps the first of equals

    def _run(self, urgent_only: bool) -> None:
        while True:
            picked = self._next_part(urgent_only)
            if picked is None:
                return
            self._fetch_part(*picked)

    def _fetch_part(self, step: Step, p: int) -> None:
        """Fetch, decode and deliver part ``p`` of ``step`` (a worker's, or a caller's own part:
        see ``_fetch_own_parts``); a failure is kept for the caller."""
        if step.skipping:
            step.skip(p)
            return
        lease = None
        try:
            ids, requested = step.part_ids(p)
            lease = self.store.fetch(ids, hold=True, requested=requested,
                                     in_place=self.rows_in_place and step.outputs is None)
            if step.outputs is None:
                step.deliver(p, self._decode_layers(step, p, lease), lease)
            else:
                step.deliver(p, None, lease, self._to_layer_outputs(step, p, lease))
        except BaseException as exc:  # kept for the caller; the worker carries on
            if lease is not None:
                lease.release()
            with self._lock:
                self.failures += 1
            step.fail(p, exc)

    def _fetch_own_parts(self, step: Step, layer_id: int) -> None:
        """A caller that needs a layer whose part no worker has taken yet while both are busy
        (say with a later layer's drive reads or a window fetched ahead) fetches the step's
        parts itself, in order, up to that one, instead of waiting behind them; the time is the
        step's stall. Its fetch is bounded by the store's own waits, as a worker's is; with a
        worker idle it waits (``wait_s``) for the worker. Host rows only (on a device the parts
        run on the fetch stream, the workers' own)."""
        if step.outputs is not None or layer_id not in step.layer_ids or step.done():
            return
        p = step._part_of[step.layer_ids.index(layer_id)]
        t0 = None
        while True:
            with self._wake[False]:  # the queue's lock: workers take parts under it too
                if step._handed_out > p or step.skipping or self._idle[False] or self._idle[True]:
                    break
                q = self._hand_out(step, self._urgent if step in self._urgent else self._background)
            if t0 is None:
                t0 = time.perf_counter()
            self._fetch_part(step, q)
        if t0 is not None:
            step.add_stall(time.perf_counter() - t0)

    def _decode_layers(self, step: Step, p: int, lease: RowLease) -> dict[int, torch.Tensor]:
        """Part ``p``'s rows decoded straight into each of its layers' order (one gather and
        decode per layer, no decoded copy of the part in between): ``{layer id: [T, C, d]}``."""
        shape = (step.num_tokens, step.num_columns)
        in_place = lease.in_place
        if in_place is not None:  # row i of the part is arena[slots[i]], pinned by the lease
            raw, slots = in_place.arena, in_place.slots
        else:
            raw, slots = lease.host_raw, None  # [u, row_bytes] (NumPy: see layer_index)
        decoded = {}
        for li in step.parts[p][2]:
            index, base = step.layer_index(li)
            decoded[step.layer_ids[li]] = self.store.decode(raw, self.dtype, index=index, index_base=base, shape=shape,
                                                            buffers=self._decoded, slots=slots)
        return decoded

    def _to_layer_outputs(self, step: Step, p: int, lease: RowLease) -> object:
        """Dequantize part ``p``'s raw rows into each of its layers' outputs on the fetch
        stream, one gather per layer; returns the event after which they are there."""
        sync, outputs = self.sync, step.outputs
        assert sync is not None and outputs is not None
        sync.wait(FETCH, lease.ready)
        sync.keep_alive(lease.raw, FETCH)
        for li in step.parts[p][2]:
            out = step.layer_outputs[li].view(-1, self.config.head_dim)  # [T*C, d]
            index = sync.upload(FETCH, step.layer_positions(li), self.device)  # [T*C] rows of lease.raw, pinned ring

            def dequantize(out: torch.Tensor = out, index: torch.Tensor = index) -> None:
                gather_rows(lease.raw, index, self.config, out=out)

            sync.run(FETCH, dequantize, writes={outputs.name: [li]})
        return sync.record(FETCH)

    def _parts(self, unique: np.ndarray) -> list[Part] | None:
        """One part per Engram layer, in layer order (None: fetch the step in one piece)."""
        nl = len(self.config.layer_ids)
        if nl < 2 or unique.size < max(1, self.split_min_rows):
            return None
        cuts = [bisect_left(unique, base) for base in self._layer_bases_list[1:]]  # layer boundaries in unique
        # (bisect, not np.searchsorted: that lets go of the GIL, see Step.layer_index)
        bounds = [0, *cuts, int(unique.size)]
        return [(bounds[i], bounds[i + 1], (i,)) for i in range(nl)]

    # ------------------------------------------------------------------ steps
    def begin_step(
        self,
        seq_ids: Sequence[int],
        pieces: Sequence[Any] | np.ndarray | torch.Tensor,
        dead: Sequence[Any] | None = None,
        *,
        urgent: bool = True,
        drafts: Sequence[Any] | None = None,
    ) -> Step:
        """Hash the step's new tokens per sequence and start fetching every layer's rows.

        ``pieces[i]`` holds the new token ids of sequence ``seq_ids[i]`` (a prefill chunk or
        one decode token); a decode step may also give ``pieces`` as one 1-d int array or
        tensor ``[S]``, a token per sequence (no per-sequence Python work). Returns the ``Step``; it also becomes ``current``.
        ``urgent=False`` marks a fetch ahead of need (e.g. a later prefill window): the
        workers serve it after every urgent step, yielding to new urgent steps between its parts.

        ``drafts[i]`` (None or empty: none) are draft tokens of sequence ``seq_ids[i]`` after
        this step's tokens: their rows are fetched in the background for the next step (see
        the module doc); they never change any step's rows.
        """
        if self._closed:
            raise ValueError("this prefetcher is closed: create a new one")
        if not all(w.is_alive() for w in self._workers):  # never expected: workers catch everything
            raise PrefetchError("the prefetch worker has stopped; create a new Prefetcher")
        seq_ids = tuple(map(int, seq_ids))
        one_each = _one_token_each(pieces)  # [S] (a decode step given as one array), else None
        if one_each is not None:
            if one_each.size != len(seq_ids):
                raise ValueError(f"{one_each.size} tokens for {len(seq_ids)} sequences: give one each")
            arrays = [one_each[i:i + 1] for i in range(one_each.size)] if dead is not None else []
        else:
            arrays = [np.asarray(p.detach().cpu() if isinstance(p, torch.Tensor) else p).reshape(-1) for p in pieces]
            if len(arrays) != len(seq_ids):
                raise ValueError(f"{len(arrays)} pieces for {len(seq_ids)} sequences")
            if arrays and all(a.size == 1 for a in arrays):
                one_each = np.concatenate(arrays)
        lengths = (1,) * len(seq_ids) if one_each is not None else tuple(a.size for a in arrays)
        # NumPy until the Step is made, hashed straight into table ids (see NgramHasher.table_ids)
        if dead is None and one_each is not None:
            table_ids = self.hasher.decode_ids(self.history, seq_ids, one_each, flat=True)  # [S, L, C]
        else:
            table_ids = self.hasher.pieces_ids(self.history, seq_ids, arrays, dead, flat=True)  # [T, L, C]
        if self.columns is not None:
            table_ids = shard_ids(table_ids, self.columns)  # [T, L, c1 - c0]
        d = dedup(table_ids)
        outputs = None
        if self._outputs is not None:
            assert self.sync is not None, "outputs are pooled only for a store with a DeviceSync"
            outputs = self._outputs.take()
        with self._lock:
            self._step_count += 1
            try:
                step = Step(self._step_count, seq_ids, lengths, table_ids, d,
                            self.config.layer_ids, self._parts(d.unique), outputs)
            except BaseException:
                if outputs is not None and self._outputs is not None:
                    self._outputs.give(outputs)  # e.g. a step over max_tokens: the set stays in the pool
                raise
            step.wait_s, step.source = self.wait_s, self._source
            self.current = step
            self._open.append(step)
        if outputs is not None:  # after the Step made (maybe allocated) its outputs on the caller's stream
            assert self.sync is not None
            self.sync.wait_stream(FETCH, MAIN)  # the ids are made and the last step's rows read
        with self._wake[False]:
            (self._urgent if urgent else self._background).append(step)
            self._wake_a_worker(urgent)
        if urgent:
            self._after_drafts(step, d.unique)
        if drafts is not None:
            self._fetch_drafts(seq_ids, drafts)
        return step

    # ------------------------------------------------------------------ drafts
    def _fetch_drafts(self, seq_ids: tuple[int, ...], drafts: Sequence[Any]) -> None:
        """Hash the draft tokens on a copy of their sequences' histories and queue their rows'
        fetch behind every urgent step (see the module doc)."""
        if len(drafts) != len(seq_ids):
            raise ValueError(f"{len(drafts)} drafts for {len(seq_ids)} sequences: give one (maybe empty) each")
        pairs = [(seq, np.asarray(tokens.detach().cpu() if isinstance(tokens, torch.Tensor) else tokens,
                                  dtype=np.int64).reshape(-1))
                 for seq, tokens in zip(seq_ids, drafts) if tokens is not None]
        pairs = [(seq, tokens) for seq, tokens in pairs if tokens.size]
        if not pairs:
            return
        ids = [seq for seq, _ in pairs]
        scratch = self.hasher.new_history(capacity=len(ids))
        slots, own = scratch.slots_for(ids), self.history.slots_for(ids)
        scratch.tokens[slots] = self.history.tokens[own]
        scratch.dead[slots] = self.history.dead[own]
        scratch.any_dead = bool(scratch.dead.any())
        table_ids = self.hasher.pieces_ids(scratch, ids, [tokens for _, tokens in pairs], flat=True)  # [K, L, C]
        if self.columns is not None:
            table_ids = shard_ids(table_ids, self.columns)
        d = dedup(table_ids)
        draft = _DraftStep(0, tuple(ids), tuple(t.size for _, t in pairs), table_ids, d, self.config.layer_ids,
                           [(0, int(d.unique.size), ())])
        with self._lock:
            stale, self._draft = self._draft, draft
            self._draft_counts["draft_steps"] += 1
            self._draft_counts["draft_rows"] += int(d.unique.size)
        if stale is not None:  # drafts no urgent step came for (e.g. only prefill since)
            stale.cancel()
        with self._wake[False]:
            # ahead of the windows fetched further ahead: the next step may need these rows
            self._background.appendleft(draft)
            self._wake_a_worker(False)

    def _after_drafts(self, step: Step, unique: np.ndarray) -> None:
        """The last drafts meet the step they were for (the next urgent step with one of their
        sequences): count the rows they had fetched, and
        let go of their pins once this step's own fetch holds its rows (at once, when the
        draft fetch has not started: the step reads them itself)."""
        with self._lock:
            draft = self._draft
            if draft is None or not set(step.seq_ids) & set(draft.seq_ids):
                return  # no drafts, or drafts for other sequences (a prefill window, say)
            self._draft = None
        fetched = draft.done() and not draft.skipping
        hits = int(np.isin(unique, draft.dedup.unique, assume_unique=True).sum()) if fetched else 0
        with self._lock:
            c = self._draft_counts
            c["next_steps"] += 1
            c["next_rows"] += int(unique.size)
            c["next_rows_fetched"] += hits
            c["draft_rows_unused"] += int(draft.dedup.unique.size) - hits
        if draft.done() or draft._handed_out:  # fetched or being fetched: keep its pins until the step's
            step.when_done(draft.cancel)
        else:
            draft.cancel()  # not started: skipped

    def wait_drafts(self, timeout: float | None = None) -> bool:
        """Wait until the last drafts' fetch has ended (fetched, failed or skipped); False on
        timeout. True when there are none."""
        with self._lock:
            draft = self._draft
        return True if draft is None else draft.wait_done(timeout)

    def draft_stats(self) -> dict[str, Any]:
        """Drafts so far: ``draft_steps``, ``draft_rows`` (distinct rows asked ahead),
        ``next_rows`` (distinct rows of the steps that followed drafts), ``next_rows_fetched``
        (of those, rows the drafts had already fetched), ``share_fetched``,
        ``draft_rows_unused`` (draft rows the next step did not ask for: the reads a wrong
        draft costs, at most) and ``unused_per_fetched``."""
        with self._lock:
            c: dict[str, Any] = dict(self._draft_counts)
        c["share_fetched"] = c["next_rows_fetched"] / c["next_rows"] if c["next_rows"] else 0.0
        c["unused_per_fetched"] = c["draft_rows_unused"] / c["next_rows_fetched"] if c["next_rows_fetched"] else None
        return c

    def _wake_a_worker(self, urgent: bool) -> None:
        """Wake one worker for a new step (the queue's lock held): the general one when it
        waits, else, for an urgent step, the urgent-only one (the general one is busy, maybe
        with a fetch ahead of need). Waking both for every step costs a thread switch each
        (tens of microseconds of CPU on a virtual machine) for a worker that mostly finds
        nothing left to do."""
        if self._idle[False]:
            self._wake[False].notify()
        elif urgent and self._idle[True]:
            self._wake[True].notify()

    def rows(self, layer_id: int, step: Step | None = None, *, timeout: float | None = None) -> torch.Tensor:
        """Rows of Engram layer ``layer_id`` for ``step`` (default: the current one):
        ``[T, C, head_dim]`` of ``dtype`` (``C``: the rank's columns); see ``Step.rows``. On a
        device they are a view of an output buffer the next step reuses: read them before
        ``end_step``."""
        step = step or self.current
        if step is None:
            raise ValueError("no step in flight: call begin_step(seq_ids, pieces) first")
        self._fetch_own_parts(step, layer_id)
        return step.rows(layer_id, timeout)

    def end_step(self, step: Step | None = None) -> None:
        """Finish a step: release its cache pins (waits for its fetch to end first)."""
        step = step or self.current
        if step is None:
            return
        if not step.wait_done(self.wait_s):
            raise TimeoutError(f"step {step.number}'s fetch did not end within {self.wait_s:g} s: {step.source} "
                               "did not return its rows; cancel the step (Prefetcher wait_s= sets the wait)")
        step.release()
        self._close_step(step, ended=True)

    def cancel(self, step: Step | None = None) -> None:
        """Cancel a step: its fetch is skipped if not started, and its pins are let go."""
        step = step or self.current
        if step is None:
            return
        step.cancel()
        self._close_step(step, ended=False)

    def _close_step(self, step: Step, ended: bool) -> None:
        with self._lock:
            closing = step in self._open
            if closing:
                self._open.remove(step)
                self.steps += ended
                self.stall_seconds += step.stall_seconds
            if self.current is step:
                self.current = None
        if closing and step.outputs is not None and self._outputs is not None:
            outputs, pool = step.outputs, self._outputs
            step.when_done(lambda: pool.give(outputs))  # once no part can still write them

    def release_sequence(self, seq_id: int) -> None:
        """Forget a finished sequence's hashing history."""
        self.history.release(seq_id)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"steps": self.steps, "failures": self.failures, "stall_seconds": self.stall_seconds,
                    "open_steps": len(self._open)}

    def close(self) -> None:
        """Cancel open steps and stop the workers; ``TimeoutError`` when a worker is still
        inside the store's fetch after ``wait_s``."""
        if self._closed:
            return
        self._closed = True
        draft, self._draft = self._draft, None
        if draft is not None:
            draft.cancel()
        for step in list(self._open):
            self.cancel(step)
        self._stop_workers()
        deadline = time.monotonic() + self.wait_s
        for worker in self._workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [w.name for w in self._workers if w.is_alive()]
        if stuck:
            raise TimeoutError(f"prefetch worker {', '.join(stuck)} still inside a fetch from {self.store!r} after "
                               f"{self.wait_s:g} s: the store does not answer (bound its own waits, e.g. "
                               "RowClient timeout_s=)")

    def _stop_workers(self) -> None:
        """Tell the workers to end once the queues are empty."""
        with self._wake[False]:
            self._stopping = True
            for wake in self._wake.values():
                wake.notify_all()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _one_token_each(pieces: Any) -> np.ndarray | None:
    """``pieces`` given as one 1-d integer array or tensor (a decode step's token per
    sequence) -> int ``[S]``; None for a sequence of pieces."""
    if isinstance(pieces, torch.Tensor):
        pieces = pieces.detach().cpu().numpy()
    if isinstance(pieces, np.ndarray) and pieces.ndim == 1:
        if pieces.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got an array of {pieces.dtype}")
        return pieces
    return None


def _columns(store: RowStore, columns: Columns | None, num_columns: int) -> Columns | None:
    """The Prefetcher's column shard: the store's, or ``columns`` over a store of every row."""
    own = store.columns
    if columns is None:
        return own
    columns = check_columns(columns, num_columns)
    if own is not None and own != columns:
        raise ValueError(f"the store serves columns {own}, not {columns}: drop columns= (the Prefetcher "
                         "takes the store's) or open the table with these columns")
    return columns
