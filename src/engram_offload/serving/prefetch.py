"""``Prefetcher``: fetch a step's Engram rows in the background while the backbone runs.

``begin_step`` hashes the step's tokens, deduplicates every layer's ids at once and queues
the ``Step`` (``step``) for two worker threads; ``rows(layer_id)`` returns a layer's rows,
waiting only if they are not there yet. Drafts are in ``drafts``, device output buffers in
``outputs``; docs/prefetch.md has the design.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from typing import Any, Sequence

import numpy as np
import torch

from ..buffers.recycle import RecycledArrays
from ..engram.hashing import NgramHasher, SequenceHistory
from ..errors import PrefetchError, StepCancelled
from ..gpu.kernels import gather_rows
from ..gpu.sync import FETCH, MAIN
from .dedup import dedup
from .drafts import Drafts
from .outputs import OutputPool
from .sharding import Columns, check_columns, shard_ids
from .step import Part, Step
from .store import RowLease, RowStore

__all__ = ["Prefetcher", "PrefetchError", "Step", "StepCancelled"]

SPLIT_MIN_ROWS = 512  # a step with fewer distinct rows is fetched in one part (one fetch call)


class Prefetcher:
    """Background fetch of each step's rows from ``store`` for the layers of ``hasher.config``.

    Rows are decoded to ``dtype`` on ``device``, which must be the store's (the default): a
    store opened with ``device=`` delivers to that device, and the step's rows are then
    dequantized there on the fetch stream (docs/prefetch.md). Two worker threads serve
    steps in order, urgent ones first, and each step's parts in order; one of them serves
    only urgent steps. A caller asking for host rows whose part no worker has taken yet,
    both being busy, fetches the step's parts up to it itself rather than wait behind them.
    Use as a context manager or call ``close``.

    ``columns``: the column shard ``[c0, c1)`` whose rows ``rows()`` returns (default: the
    store's ``columns``, else every column; docs/prefetch.md).

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
        self._outputs = None if self.sync is None else OutputPool(
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
        self._drafts = Drafts(hasher, self.history, self.columns, self._queue_draft)
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
                                     in_place=step.outputs is None)
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
        docs/prefetch.md); they never change any step's rows.
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
            arrays = [a if a.size else np.empty(0, np.int64) for a in arrays]  # no new tokens: [] is float64
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
            self._drafts.meet(step, d.unique)
        if drafts is not None:
            self._drafts.fetch(seq_ids, drafts)
        return step

    def _queue_draft(self, draft: Step) -> None:
        """Queue a drafts' fetch ahead of the windows fetched further ahead: the next step may need its rows."""
        with self._wake[False]:
            self._background.appendleft(draft)
            self._wake_a_worker(False)

    def wait_drafts(self, timeout: float | None = None) -> bool:
        """Wait until the last drafts' fetch has ended (fetched, failed or skipped); False on
        timeout. True when there are none."""
        return self._drafts.wait(timeout)

    def draft_stats(self) -> dict[str, Any]:
        """Drafts so far: ``draft_steps``, ``draft_rows`` (distinct rows asked ahead),
        ``next_rows`` (distinct rows of the steps that followed drafts), ``next_rows_fetched``
        (of those, rows the drafts had already fetched), ``share_fetched``,
        ``draft_rows_unused`` (draft rows the next step did not ask for: the reads a wrong
        draft costs, at most) and ``unused_per_fetched``."""
        return self._drafts.stats()

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
        self._drafts.cancel()
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
