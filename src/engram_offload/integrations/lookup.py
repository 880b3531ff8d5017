"""One Engram layer's rank-local lookup, as serving engines call it: ids in, rows written into ``out``.

An engine hands a layer's ids ``int32 [T, C]`` (every column, ids local to the layer, often a
strided view) and a buffer ``out``: bf16 ``[T, part, head_dim]`` or packed bytes ``uint8
[T, part * row_bytes]`` (``row_bytes`` 264 for V4.1: 256 fp8 values, then 8 ue8m0 scales).
``LayerShard`` is what this rank owns, by vLLM's rule: ``part = cdiv(C, world)`` columns from
``c0 = rank * part`` (the last rank's columns past ``C`` are padding), i.e. the layer-local ids
``[vocab_start, vocab_end)``. Each written row is exactly what vLLM's own lookup writes for it:
the fp8 values times ``2**(scale byte - 127)`` in float32, rounded to bf16 (scale byte 0 gives
0.0, 255 inf), and a zero row for an id of ``-1``, an id outside the rank's range, or a padding
column. A table id is the layer's first row (``config.layer_row_bases``) plus the layer-local id.

Two backends:

- ``AddressableLookup``: the table in host memory the device reads in place (``memory``,
  ``pinned``, ``shared``): one gather kernel (``gpu.gather_rows`` / ``gather_raw``) on the current
  stream, ids masked on the device, and its counters added up on the device too. No host sync,
  so a CUDA graph can capture it, and a replay counts as a lookup.
- ``HostReadLookup``: a host-read tier (``direct``, ``mmap``, ``remote``, a row server). ``lookup``
  copies the rank's ids into a slot of its pinned ``StagingRing`` on the current stream and
  hands the slot to this layer's worker thread; the worker waits for that copy, reads the rows
  into the slot and then raises the slot's flag (zeros and the error on failure: the flag is
  always raised, so nothing waits for ever). ``finish`` (the consumer, before the rows are
  read) waits for the flag (bounded by ``timeout_s``), raises a failed read, and enqueues the
  ring's copy to the device and the dequantization into ``out`` on the current stream. A slot
  is written again only after the event recorded after its rows were consumed. Every piece of
  device work goes through a ``DeviceSync``, so a test checks this order on a CPU.

  In-graph (``in_graph``, chosen on CUDA where the driver has stream memory operations) no CPU
  waits: ``lookup`` enqueues the ids' copy and a request written to host memory by the stream,
  a process-wide poller thread hands it to the reader, which answers in host memory, and
  ``finish`` enqueues the stream's wait for that answer before the copy. A CUDA graph captures
  all of it and replays it with new ids; a failed or late read releases the stream with an
  error value, its rows are NaN and the lookup raises at its next call (``docs/in-graph-reads.md``).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..buffers.hostmem import uva_view
from ..engram.config import EngramConfig
from ..errors import PrefetchError
from ..gpu.device_table import DeviceTable
from ..gpu.kernels import dequant_rows
from ..gpu.sync import HOST, MAIN, POLL_MAX_S, POLL_MIN_S, DeviceSync, StagingRing, poll
from ..serving.sharding import column_range
from ..serving.store import RowStore

__all__ = ["AddressableLookup", "HostReadLookup", "LayerShard", "LookupStats", "flat_ids"]

log = logging.getLogger("engram_offload.integrations")

RING_SLOTS = 2  # pinned slots per layer: a step's lookup never waits for the step before it
REQUESTED, ANSWERED = 1, 2  # an in-graph slot's state: a request made (by the stream), answered (by the host)
POISON = 0xFF  # the raw rows of a failed step: fp8 NaN values, scale 2**128, NaN however decoded
CONSUMED_GRACE_S = 0.1  # how long a reader gives a slot's done word to show its last consumer ran


@dataclass(frozen=True)
class LayerShard:
    """What one tensor-parallel rank owns of one Engram layer (vLLM's split)."""

    layer_id: int
    num_columns: int  # C: columns of the layer, (N-1) * H
    part: int  # columns of the rank's output: cdiv(C, world) (padding past C)
    c0: int  # first column (vLLM's head_start)
    c1: int  # one past the last real column, <= C
    vocab_start: int  # layer-local ids of the rank: [vocab_start, vocab_end)
    vocab_end: int
    row_base: int  # the layer's first row in the table's flat row space

    @classmethod
    def of(cls, config: EngramConfig, layer_id: int, rank: int, world: int) -> "LayerShard":
        """``rank`` of ``world``'s part of ``layer_id`` (vLLM: ``part_n_hash_cols``, ``head_start``)."""
        num_columns = config.cols_per_layer
        part = -(-num_columns // world)
        if (world - 1) * part >= num_columns:
            raise ValueError(f"{num_columns} Engram columns over {world} tensor-parallel ranks leave the last "
                             "rank without columns (as vLLM refuses): use fewer ranks")
        c0, c1 = column_range(num_columns, rank, world)
        sizes = config.head_sizes(layer_id)
        return cls(layer_id, num_columns, part, c0, c1, sum(sizes[:c0]), sum(sizes[:c0 + part]),
                   config.layer_row_bases[config.layer_ids.index(layer_id)])

    @property
    def columns(self) -> tuple[int, int]:
        return self.c0, self.c1


def flat_ids(shard: LayerShard, indices: torch.Tensor, first_row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer-local ids ``[T, C]`` (any integer dtype and strides, any device) -> the rank's table
    ids ``int64 [T, part]`` (0 where not owned) and whether each is owned ``bool [T, part]``.
    ``first_row``: the ids count from that flat row (rows held from there on)."""
    if indices.dim() != 2 or indices.shape[1] != shard.num_columns:
        raise ValueError(f"Engram ids must be [T, {shard.num_columns}] (every column of layer {shard.layer_id}), "
                         f"got {tuple(indices.shape)}")
    local = indices[:, shard.c0:shard.c1].to(torch.int64)  # [T, c]
    pad = shard.part - (shard.c1 - shard.c0)
    if pad:
        local = torch.nn.functional.pad(local, (0, pad), value=-1)  # [T, part]
    owned = (local >= shard.vocab_start) & (local < shard.vocab_end)
    return torch.where(owned, local + (shard.row_base - first_row), 0), owned


def _out_rows(out: torch.Tensor, n: int, width: int) -> torch.Tensor | None:
    """``out`` as ``[n, width]`` rows when it is one contiguous block, else None."""
    return out.view(n, width) if out.is_contiguous() else None


def _check_out(shard: LayerShard, out: torch.Tensor, t: int, head_dim: int, row_bytes: int) -> bool:
    """Whether ``out`` takes packed rows (else bf16 values); ``ValueError`` for any other buffer."""
    if out.dtype == torch.uint8 and tuple(out.shape) == (t, shard.part * row_bytes):
        return True
    if out.dtype == torch.bfloat16 and tuple(out.shape) == (t, shard.part, head_dim):
        return False
    raise ValueError(f"Engram rows of layer {shard.layer_id} go into bf16 [{t}, {shard.part}, {head_dim}] or "
                     f"uint8 [{t}, {shard.part * row_bytes}], got {out.dtype} {tuple(out.shape)}")


@dataclass
class LookupStats:
    """Counters of one layer's lookups kept on the host (``stats()``)."""

    lookups: int = 0
    rows: int = 0
    stall_s: float = 0.0  # host time ``finish`` waited for the worker
    max_stall_s: float = 0.0
    failures: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"lookups": self.lookups, "rows": self.rows, "stall_s": self.stall_s,
                "max_stall_s": self.max_stall_s, "failures": self.failures}


class _Logged:
    """Counting and the periodic log line shared by both backends."""

    kind = ""
    not_counted: tuple[str, ...] = ()  # counters this backend cannot measure (left at 0)

    def __init__(self, shard: LayerShard, store: RowStore, describe: str, log_every: int) -> None:
        self.shard = shard
        self.store = store
        self.describe = describe
        self.log_every = log_every
        self.counters = LookupStats()
        self._logged = 0  # lookups at the last periodic line

    def _count(self, rows: int) -> None:
        c = self.counters
        c.lookups += 1
        c.rows += rows
        if self.log_every and c.lookups % self.log_every == 0:
            self.stats()  # logs the line

    def _totals(self) -> tuple[int, int]:
        """Lookups and rows so far."""
        return self.counters.lookups, self.counters.rows

    def stats(self) -> dict[str, Any]:
        """This layer's counters plus the store's hit rate (None where the store has no caches).

        ``rows``: ids x the rank's columns (padding tokens and columns included); ``not_counted``
        names the counters this backend cannot measure. Logs the periodic line when ``lookups``
        passed another multiple of ``log_every`` since the last one.
        """
        lookups, rows = self._totals()
        out = {"layer": self.shard.layer_id, "backend": self.kind, "table": self.describe,
               "columns": list(self.shard.columns), **self.counters.as_dict(), "lookups": lookups, "rows": rows,
               "not_counted": list(self.not_counted)}
        try:
            store = self.store.stats()
        except Exception:  # a closed store or a row server gone: the counters still stand
            store = {}
        out["hit_rate"] = (store.get("store") or {}).get("hit_rate")
        out["store"] = store
        if self.log_every and lookups // self.log_every > self._logged // self.log_every:
            self._logged = lookups
            hit = out["hit_rate"]
            log.info("engram-offload layer %d (%s, %s): %d lookups, %d rows, hit rate %s, stall %.1f ms total, "
                     "%.1f ms max", self.shard.layer_id, self.kind, self.describe, lookups, rows,
                     "n/a" if hit is None else f"{hit:.3f}", 1e3 * out["stall_s"], 1e3 * out["max_stall_s"])
        return out


class AddressableLookup(_Logged):
    """Rows gathered by the device from a table it reads in place (``DeviceTable``).

    ``first_row``: the flat table row that is the device table's row 0 (a rank holding only its
    share of the layer's rows). The lookups and rows are counted on the device, in the work a
    CUDA graph captures, so replays count; ``stats()`` reads them (one host sync). No Python
    runs per replay, so the periodic log line appears when ``stats()`` is called (the plugin's
    ``stats()``) after another ``log_every`` lookups.
    """

    kind = "addressable"
    not_counted = ("stall_s", "max_stall_s")  # the wait for host memory is inside the gather kernel

    def __init__(self, shard: LayerShard, store: RowStore, table: DeviceTable, config: EngramConfig, *,
                 first_row: int = 0, describe: str = "", log_every: int = 0) -> None:
        super().__init__(shard, store, describe, log_every)
        lo, hi = shard.row_base + shard.vocab_start, shard.row_base + shard.vocab_end
        if lo < hi and not first_row <= lo < hi <= first_row + table.num_rows:
            raise ValueError(f"the device table holds flat rows [{first_row}, {first_row + table.num_rows}), not "
                             f"rows [{lo}, {hi}) of layer {shard.layer_id}'s columns {list(shard.columns)}: give "
                             "the rows holding them and the flat row of their row 0")
        self.table = table
        self.config = config
        self.first_row = first_row
        self.device_counts = torch.zeros(2, dtype=torch.int64, device=table.device)  # [2]: lookups, rows

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        """Enqueue on the current stream the gather of ``indices [T, C]``'s rows into ``out`` and
        the counters' update."""
        t = int(indices.shape[0])
        cfg = self.config
        packed = _check_out(self.shard, out, t, cfg.head_dim, cfg.row_bytes)
        n = t * self.shard.part
        if n == 0:
            return
        flat, owned = flat_ids(self.shard, indices.to(out.device), self.first_row)  # [T, part] each
        width = cfg.row_bytes if packed else cfg.head_dim
        rows = _out_rows(out, n, width)
        target = rows if rows is not None else torch.empty((n, width), dtype=out.dtype, device=out.device)
        if packed:
            self.table.gather_raw(flat.reshape(-1), target, background=background)
        else:
            self.table.gather_rows(flat.reshape(-1), cfg, out=target, background=background)
        target.masked_fill_(~owned.reshape(n, 1), 0)
        if rows is None:
            out.copy_(target.view(out.shape))
        self.device_counts[0].add_(1)
        self.device_counts[1].add_(n)

    def _totals(self) -> tuple[int, int]:
        lookups, rows = self.device_counts.tolist()
        return int(lookups), int(rows)

    def finish(self, out: torch.Tensor | None = None) -> None:
        """Nothing to finish: the rows are written by the gather on the stream."""


@dataclass
class _Job:
    slot: int
    tokens: int
    ids_ready: object  # the event after which the ids are in the slot (in-graph: the request is made)
    done: threading.Event = field(default_factory=threading.Event)
    flag: object = None  # the host event after which the slot's rows are written
    error: BaseException | None = None
    out: torch.Tensor | None = None


@dataclass
class _Request:
    """A request a stream made in a slot (in-graph), as the poller took it."""

    slot: int
    seq: int  # its number: slot k's n-th request is k + 1 + (n - 1) * slots
    tokens: int
    prev: int  # the slot's request before it (0: none)
    deadline: float  # when the watchdog answers it with the error value
    lock: threading.Lock = field(default_factory=threading.Lock)
    answered: bool = False


class _Poller:
    """One thread a process: takes every in-graph lookup's requests and bounds each device wait
    (``HostReadLookup._poll``), polling with a bounded backoff."""

    def __init__(self) -> None:
        self._lookups: weakref.WeakSet[HostReadLookup] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        atexit.register(self._stop)

    def add(self, lookup: "HostReadLookup") -> None:
        with self._lock:
            self._lookups.add(lookup)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="engram-offload-poller", daemon=True)
                self._thread.start()

    def _stop(self) -> None:
        """At interpreter exit: end the loop before the interpreter goes (a bounded join)."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join(1.0)

    def _run(self) -> None:
        delay = POLL_MIN_S
        while not self._stopping:
            busy = self._round()
            if busy is None:
                return
            delay = POLL_MIN_S if busy else min(POLL_MAX_S, 2 * delay)
            time.sleep(delay)

    def _round(self) -> bool | None:
        """Poll every lookup once: whether a request is in flight (None: no lookup is left, and
        the thread ends; a new lookup starts it again)."""
        with self._lock:
            lookups = list(self._lookups)
            if not lookups:
                self._thread = None
                return None
        busy = False
        for lookup in lookups:
            try:
                busy |= lookup._poll(time.monotonic())
            except Exception:  # noqa: BLE001 - one lookup's fault must not stop the others' answers
                log.exception("engram-offload: polling Engram layer %d's requests failed", lookup.shard.layer_id)
        return busy


_POLLER = _Poller()


class HostReadLookup(_Logged):
    """Rows read by a host thread from any store, staged through pinned slots (see the module doc).

    ``in_graph``: the device waits for each read on a word of host memory, so a CUDA graph can
    capture the lookup (None: where the sync has stream memory operations, on CUDA only);
    False: the CPU waits in ``finish``.
    """

    kind = "host-read"

    def __init__(self, shard: LayerShard, store: RowStore, config: EngramConfig, *, max_tokens: int,
                 device: torch.device | str, sync: DeviceSync, slots: int = RING_SLOTS, timeout_s: float = 60.0,
                 describe: str = "", log_every: int = 0, ids_stream: str = MAIN, in_graph: bool | None = None) -> None:
        super().__init__(shard, store, describe, log_every)
        if max_tokens < 1 or slots < 1:
            raise ValueError(f"a host-read lookup needs max_tokens >= 1 and slots >= 1, got {max_tokens}, {slots}")
        self.config = config
        self.device = torch.device(device)
        self.sync = sync
        self.timeout_s = float(timeout_s)
        self.max_tokens = int(max_tokens)
        # the stream current when the engine calls lookup (vLLM: its prefetch stream, the consumer's
        # "main" in CUDA terms too); a trace names it apart from the consumer's
        self.ids_stream = ids_stream
        memops = sync.stream_memops()
        self.in_graph = memops and self.device.type == "cuda" if in_graph is None else bool(in_graph)
        if self.in_graph and not memops:
            raise ValueError("this CUDA driver has no stream memory operations (cuStreamWaitValue32_v2), so the GPU "
                             "cannot wait for host reads: leave in_graph unset to have the CPU wait")
        total = slots + 1 if self.in_graph else slots  # in-graph: one more slot, the one graphs capture
        rb, part, c = config.row_bytes, shard.part, shard.c1 - shard.c0
        # per slot, one pinned buffer: the rank's ids int32 [max_tokens, c], then their rows
        # [max_tokens * part, row_bytes]; the rows are copied to the device on the consumer's stream
        ids_bytes, rows_bytes = max_tokens * c * 4, max_tokens * part * rb
        self.ring = StagingRing(total, ids_bytes + rows_bytes, device=self.device, sync=sync, stream=MAIN)
        self._ids = [b[:ids_bytes].view(torch.int32).view(max_tokens, c) for b in self.ring.buffers]
        self._rows = [b[ids_bytes:].view(max_tokens * part, rb) for b in self.ring.buffers]
        self._device_rows = [torch.empty((max_tokens * part, rb), dtype=torch.uint8, device=self.device)
                             for _ in range(total)]
        self._flags: list[object] = [None] * total  # the host event after a slot's ids were last read
        self._abandoned: list[_Job | None] = [None] * total  # a read ``finish`` gave up waiting for
        self._pending: _Job | None = None
        self._failed: BaseException | None = None  # a failure not yet raised to the engine
        self._fail_lock = threading.Lock()
        name = f"engram_l{shard.layer_id}_{id(self):x}"
        self._names = {"ids": f"{name}_ids", "device": f"{name}_device"}
        self._jobs: queue.Queue[_Job | _Request | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name=f"engram-offload-l{shard.layer_id}", daemon=True)
        self.closed = False
        self._worker.start()
        if self.in_graph:
            self._words_of(total)
            self.not_counted = ("stall_s", "max_stall_s")  # the device waits, not the host
            _POLLER.add(self)

    def _words_of(self, total: int) -> None:
        """The in-graph protocol's words, in pinned host memory, for ``total`` slots."""
        pin = self.device.type == "cuda"
        # per slot: int32 state (REQUESTED by the stream, ANSWERED by the host) and the request's tokens;
        # int64 seq (the request's number, by the stream), ready (the host's answer: seq, or -seq for an
        # error) and done (by the consumer: seq, or -seq where the answer was not this request's rows)
        self._state = torch.zeros((total, 2), dtype=torch.int32, pin_memory=pin)
        self._words = torch.zeros((total, 3), dtype=torch.int64, pin_memory=pin)
        self.sync.host_mapped(self._state)
        self.sync.host_mapped(self._words)
        self._device_words = uva_view(self._words, self.device) if pin else self._words
        # [slots] on the device: each slot's last request number (before its first: k + 1 - slots)
        self._expect = (torch.arange(1, total + 1, dtype=torch.int64) - total).to(self.device)
        self._turn = 0  # the next eager slot
        self._last = [0] * total  # the last request taken in each slot
        self._taken: list[_Request | None] = [None] * total  # the request being read in each slot
        self._answered = [(0, True)] * total  # each slot's last answer: its number, whether it was rows
        self._consumed: list[object] = [None] * total  # the event after each slot's last eager consumer

    @property
    def slot_bytes(self) -> int:
        return int(self._rows[0].numel())

    # ------------------------------------------------------------------ the engine's side
    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        """Start reading ``indices [T, C]``'s rows for ``out``; without ``background`` also
        ``finish`` (the rows are in ``out`` on the current stream when this returns)."""
        if self.closed:
            raise ValueError(f"the Engram lookup of layer {self.shard.layer_id} is closed")
        if self._pending is not None:
            self.finish()  # an engine that never called finish: the last step's rows first
        self.check()
        t = int(indices.shape[0])
        _check_out(self.shard, out, t, self.config.head_dim, self.config.row_bytes)
        if t > self.max_tokens:
            raise ValueError(f"{t} tokens in one step, more than the {self.max_tokens} the Engram staging of "
                             f"layer {self.shard.layer_id} was sized for")
        if indices.dim() != 2 or indices.shape[1] != self.shard.num_columns:
            raise ValueError(f"Engram ids must be [T, {self.shard.num_columns}], got {tuple(indices.shape)}")
        if self.in_graph:
            self._pending = self._request(indices, t, out)
        else:
            if self.sync.capturing():
                raise RuntimeError(f"the host read of Engram layer {self.shard.layer_id} waits on the CPU, which a "
                                   "CUDA graph would replay stale for ever: turn off graph capture for this layer, or "
                                   "use a driver with stream memory operations (in-graph reads)")
            k = self.ring.claim()  # the slot's rows were consumed by the step before
            self._settle(k)
            self.sync.wait(self.ids_stream, self._flags[k])  # and its ids read
            ids = indices[:, self.shard.c0:self.shard.c1]  # [T, c], a view of the engine's ids
            self.sync.copy(self.ids_stream, self._ids[k][:t], ids, writes={self._names["ids"]: [k]})
            job = _Job(k, t, self.sync.record(self.ids_stream), out=out)
            self._pending = job
            self._jobs.put(job)
        if not background:
            self.finish(out)

    def finish(self, out: torch.Tensor | None = None) -> None:
        """Enqueue the rows' copy and dequantization into ``out`` on the current stream: in-graph
        after the stream's wait for the read, else after the CPU's (at most ``timeout_s``); raise
        a failed read (in-graph, any failure recorded so far: its rows are NaN on the device)."""
        job = self._pending
        if job is None:
            return
        self._pending = None
        if self.in_graph:
            target = job.out if out is None else out
            assert target is not None
            self._consume(job, target)
            job.out = None
            self.check()
            return
        t0 = time.perf_counter()
        if not job.done.wait(self.timeout_s):
            self._abandoned[job.slot] = job  # its slot is written again only once it has ended
            raise TimeoutError(f"the host read of Engram layer {self.shard.layer_id}'s rows took over "
                               f"{self.timeout_s:g} s ({self.describe}): check the tier, or raise wait_timeout_s")
        stall = time.perf_counter() - t0
        self._flags[job.slot] = job.flag  # the slot's ids were read, whether the read worked or not
        c = self.counters
        c.stall_s += stall
        c.max_stall_s = max(c.max_stall_s, stall)
        self._raise_failed()
        out = job.out if out is None else out
        assert out is not None
        k, n = job.slot, job.tokens * self.shard.part
        self.sync.wait(MAIN, job.flag)  # the rows are in the pinned slot
        device_rows = self._device_rows[k][:n]
        self.ring.send(k, self._rows[k][:n], device_rows, writes={self._names["device"]: [k]})
        self.sync.run(MAIN, self._writer(device_rows, out), reads={self._names["device"]: [k]},
                      writes={"engram_out": None})
        self.ring.hold(k, self.sync.record(MAIN))  # the slot's device rows are read until here
        job.out = None
        self._count(n)

    def check(self) -> None:
        """Raise a failure recorded since the last call (a failed or late read, the reader gone,
        an answer the device did not take) as a ``PrefetchError``; in-graph, the rows of the
        failed step were NaN on the device. Reads host memory only: cheap, and never blocks."""
        if self.in_graph:
            for k, (seq, ok) in enumerate(self._answered):
                if ok and seq and int(self._words[k, 2]) == -seq:
                    self._answered[k] = (seq, False)
                    self._fail(RuntimeError(f"the device did not take request {seq}'s answer in slot {k} as its "
                                            "rows and poisoned them: a fault of the in-graph protocol, report it"))
        self._raise_failed()

    def stats(self) -> dict[str, Any]:
        """``_Logged.stats``; in-graph, a recorded failure raises first (as ``check``)."""
        if self.in_graph:
            self.check()  # no Python of the lookup runs in a graph replay: failures surface here too
        return super().stats()

    def _writer(self, device_rows: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """The device work writing raw ``device_rows [n, row_bytes]`` into ``out`` (as they are, or dequantized)."""
        n, config = int(device_rows.shape[0]), self.config
        packed = out.dtype == torch.uint8
        width = config.row_bytes if packed else config.head_dim

        def write_rows() -> None:
            rows = _out_rows(out, n, width)
            if packed:
                if rows is not None:
                    rows.copy_(device_rows)
                else:
                    out.copy_(device_rows.view(out.shape))
            elif rows is not None:
                dequant_rows(device_rows, config, out=rows)
            else:
                out.copy_(dequant_rows(device_rows, config, dtype=out.dtype).view(out.shape))

        return write_rows

    def _settle(self, k: int) -> None:
        """Before slot ``k`` is used again: the read abandoned there has ended (bounded wait)."""
        job = self._abandoned[k]
        if job is None:
            return
        if not job.done.wait(self.timeout_s):
            raise TimeoutError(f"the host read of Engram layer {self.shard.layer_id}'s rows is still running after "
                               f"{2 * self.timeout_s:g} s ({self.describe}): check the tier")
        self._abandoned[k] = None
        self._flags[k] = job.flag

    def _fail(self, error: BaseException) -> None:
        """Keep ``error`` for the engine's next call (the first, when several come before it)."""
        with self._fail_lock:
            if self._failed is None:
                self._failed = error

    def _raise_failed(self) -> None:
        with self._fail_lock:
            error, self._failed = self._failed, None
        if error is not None:
            self.counters.failures += 1
            raise PrefetchError(f"reading Engram layer {self.shard.layer_id}'s rows failed ({self.describe}): "
                                f"{type(error).__name__}: {error}") from error

    # ------------------------------------------------------------------ in-graph: the stream's side
    def _request(self, indices: torch.Tensor, t: int, out: torch.Tensor) -> _Job:
        """Enqueue on the ids stream the ids' copy into a slot, then the request: its number (a
        device counter), its tokens and the state REQUESTED, each written to host memory."""
        total = len(self._taken)
        if self.sync.capturing():
            k = total - 1  # the graphs' slot: a replay is ordered after the last by its launch
        else:
            k, self._turn = self._turn, (self._turn + 1) % (total - 1)
            self.sync.wait(self.ids_stream, self._consumed[k])  # the slot's last rows were consumed
        ids = indices[:, self.shard.c0:self.shard.c1]  # [T, c], a view of the engine's ids
        self.sync.copy(self.ids_stream, self._ids[k][:t], ids, writes={self._names["ids"]: [k]})
        expect, seq = self._expect, self._device_words[k, 0]

        def stamp() -> None:
            expect[k:k + 1].add_(total)  # [1]: this request's number
            seq.copy_(expect[k])

        self.sync.run(self.ids_stream, stamp)
        self.sync.write_value(self.ids_stream, self._state[k, 1], t)
        self.sync.write_value(self.ids_stream, self._state[k, 0], REQUESTED)  # fenced: ids, number, tokens first
        return _Job(k, t, self.sync.record(self.ids_stream), out=out)

    def _consume(self, job: _Job, out: torch.Tensor) -> None:
        """Enqueue on the current stream the wait for the slot's answer, the rows' copy (poisoned
        unless the answer is this request's number) and their writing into ``out``."""
        k, n = job.slot, job.tokens * self.shard.part
        self.sync.wait(MAIN, job.ids_ready)  # after the request
        self.sync.wait_value(MAIN, self._state[k, 0], ANSWERED)
        device_rows = self._device_rows[k][:n]  # [n, row_bytes]
        self.sync.copy(MAIN, device_rows, self._rows[k][:n], reads={self.ring.name: [k]},
                       writes={self._names["device"]: [k]})
        ready, done, expect = self._device_words[k, 1], self._device_words[k, 2], self._expect[k]

        def check() -> None:
            bad = ready != expect  # [] bool: an error value, or not this request's answer
            device_rows.masked_fill_(bad, POISON)
            done.copy_(torch.where(bad, -expect, expect))

        self.sync.run(MAIN, check, writes={self._names["device"]: [k]})
        self.sync.run(MAIN, self._writer(device_rows, out), reads={self._names["device"]: [k]},
                      writes={"engram_out": None})
        self._consumed[k] = self.sync.record(MAIN)

    # ------------------------------------------------------------------ in-graph: the host's side
    def _poll(self, now: float) -> bool:
        """The poller's turn: take new requests (never one taken before), and answer with the
        error value those past their deadline or left without a reader; whether any is in flight."""
        layer, busy = self.shard.layer_id, False
        alive = self._worker.is_alive()
        gone = RuntimeError(f"the Engram lookup of layer {layer} is closed: close it only once the engine replays no "
                            "graph that captured it") if self.closed else \
            RuntimeError(f"the reader thread of Engram layer {layer}'s lookup has ended (its error is in the log): "
                         "restart the engine")
        for k in range(len(self._taken)):
            req = self._taken[k]
            if req is not None:
                busy = True
                if not alive:
                    self._answer(req, error=gone)
                elif now > req.deadline:
                    self._answer(req, error=TimeoutError(
                        f"the host read of Engram layer {layer}'s rows took over {self.timeout_s:g} s "
                        f"({self.describe}): check the tier, or raise wait_timeout_s"))
                continue
            if self.sync.read_value(self._state[k, 0]) != REQUESTED:
                continue
            seq, tokens = int(self._words[k, 0]), int(self._state[k, 1])
            if seq <= self._last[k]:
                continue  # taken before
            req = self._taken[k] = _Request(k, seq, tokens, self._last[k], now + self.timeout_s)
            self._last[k] = seq
            busy = True
            if self.closed or not alive:
                self._answer(req, error=gone)
            elif not 0 <= tokens <= self.max_tokens:
                self._answer(req, error=ValueError(f"request {seq} of Engram layer {layer} names {tokens} tokens: "
                                                   "a fault of the in-graph protocol, report it"))
            else:
                self._jobs.put(req)
        return busy

    def _serve(self, req: _Request) -> None:
        """The reader's part of a request: its ids, its rows through the store, its answer (always)."""
        k, t = req.slot, req.tokens
        try:
            done = self._words[k, 2]
            grace = min(CONSUMED_GRACE_S, max(0.0, req.deadline - time.monotonic()))
            if not poll(lambda: abs(int(done)) == req.prev or req.answered, grace):
                raise TimeoutError(f"request {req.prev}'s rows of Engram layer {self.shard.layer_id} were never "
                                   "consumed, so the next cannot use its slot: call finish after every lookup")
            with req.lock:
                if req.answered:
                    return

                def take_ids() -> torch.Tensor:
                    return self._ids[k][:t].clone()  # [T, c]

                ids = self.sync.run(HOST, take_ids, reads={self._names["ids"]: [k]})
            owned, got = self._fetch(ids)
        except BaseException as exc:  # noqa: BLE001 - answered with the error value, raised at the next call
            self._answer(req, error=exc)
            return
        self._answer(req, owned=owned, got=got)

    def _answer(self, req: _Request, *, error: BaseException | None = None, owned: torch.Tensor | None = None,
                got: torch.Tensor | None = None) -> None:
        """Answer ``req`` once (its reader and the watchdog race): its rows into the slot and its
        number as the ready value, or ``error`` recorded and the error value; then ANSWERED,
        which releases the device. Never raises."""
        with req.lock:
            if req.answered:
                return
            req.answered = True
            k, n = req.slot, req.tokens * self.shard.part
            if error is None:
                rows = self._rows[k][:n]

                def place() -> None:
                    self._place(rows, owned, got)

                try:
                    self.sync.run(HOST, place, writes={self.ring.name: [k]})
                except BaseException as exc:  # noqa: BLE001
                    error = exc
            if error is not None:
                self._fail(error)  # recorded before the device is released
            self._taken[k] = None
            self._answered[k] = (req.seq, error is None)
            try:
                self.sync.write_value(HOST, self._words[k, 1], req.seq if error is None else -req.seq)
                self.sync.write_value(HOST, self._state[k, 0], ANSWERED)
            except BaseException as exc:  # noqa: BLE001 - the device is released whatever the sync says
                self._state[k, 0].fill_(ANSWERED)
                self._fail(exc)
            if error is None:
                self.counters.lookups += 1
                self.counters.rows += n

    # ------------------------------------------------------------------ the reader
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, _Request):
                self._serve(job)
                continue
            try:
                self._read(job)
            except BaseException as exc:  # noqa: BLE001 - kept for the engine, raised at its next call
                self._fail(exc)
                job.error = exc
            finally:
                job.flag = self.sync.record(HOST)  # the flag: raised whether the read worked or not
                job.done.set()

    def _fetch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rank's ids ``int32 [T, c]`` -> which of the ``T * part`` rows it owns ``bool [n]``,
        and those rows through the store ``uint8 [owned, row_bytes]`` (None: none owned)."""
        full = torch.full((int(ids.shape[0]), self.shard.num_columns), -1, dtype=torch.int32)
        full[:, self.shard.c0:self.shard.c1] = ids
        flat, owned = flat_ids(self.shard, full)  # [T, part] each
        owned_rows = owned.reshape(-1)
        wanted = flat.reshape(-1)[owned_rows]
        return owned_rows, self.store.read_raw(wanted.numpy()) if wanted.numel() else None

    @staticmethod
    def _place(rows: torch.Tensor, owned: torch.Tensor | None, got: torch.Tensor | None) -> None:
        """``rows [n, row_bytes]``: ``got`` where ``owned``, zeros elsewhere."""
        assert owned is not None
        rows[~owned] = 0
        if got is not None:
            rows[owned] = got

    def _read(self, job: _Job) -> None:
        """The slot's ids -> its rows (zeros where not owned), on this thread."""
        k, t = job.slot, job.tokens
        n = t * self.shard.part
        self.sync.synchronize(job.ids_ready)  # the ids' copy into the slot has finished
        rows = self._rows[k][:n]  # [n, row_bytes]

        def read() -> None:
            try:
                owned, got = self._fetch(self._ids[k][:t])
                self._place(rows, owned, got)
            except BaseException:
                rows.zero_()  # never stale rows of another step
                raise

        self.sync.run(HOST, read, reads={self._names["ids"]: [k]}, writes={self.ring.name: [k]})

    def close(self) -> None:
        """Stop the reader (after the job it is on); in-graph, requests made later are answered
        with the error value (a graph replayed after close never hangs)."""
        if not self.closed:
            self.closed = True
            self._jobs.put(None)
            self._worker.join(self.timeout_s)
