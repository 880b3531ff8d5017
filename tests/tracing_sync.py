"""``TracingSync``: a ``DeviceSync`` for tests that checks, on a CPU, the ordering a GPU needs.

It runs work at once like ``ImmediateSync`` but keeps a vector clock per stream and raises
``OrderingError`` when a piece of work touches a buffer whose previous writer, or for a
write, previous readers, do not happen-before it through the recorded events, waits and host
synchronizations: a bug that would be a race on a GPU is an exception on a CPU. It also keeps
every host-to-device ``copy``'s source (``copies``), so a test can check rows only ever leave
from pinned staging buffers (``upload_buffers``, a ``StagingRing``).

``TracingSync(tensors=True)``, inside ``with sync.tracking():``, also follows every tensor
the code touches (a ``TorchDispatchMode``; kernel launches declare theirs through
``gpu.sync.kernel_access``), whether or not it is named:

- an allocation is a write by the stream that allocates it (the caller's stream outside
  ``run``), so a buffer allocated on one stream and written or read on another needs a
  recorded dependency (a wait, or an event the host waited on);
- work outside ``run`` is work on ``"main"``, so a copy kernel the code launches between
  two waits is seen where a GPU would run it;
- a block freed while work on another stream may still use it needs that stream's
  ``keep_alive`` (CUDA's ``record_stream``) or a dependency on it, else the caching
  allocator can hand it to the next allocation of its stream;
- host memory made from NumPy or a list (``torch.from_numpy``, ``torch.tensor``) or
  allocated by host work, read by device work, is a pageable copy: on a GPU it blocks the
  host (or faults); pinned or registered host memory is declared with ``host_mapped``.

Words (``write_value``, ``wait_value``, ``read_value``) order like events: a wait that sees a
value, or a host read of it, happens after the write that put it there. ``wait_value`` blocks
the caller until the word holds the value (work runs when enqueued), at most ``wait_limit_s``:
longer is a hang on a GPU, an ``OrderingError`` here.

``with sync.capture() as graph:`` records, as a CUDA graph capture would, the device work the
calling thread enqueues instead of running it, and ``graph.replay()`` runs that work again
(the Python that enqueued it does not run). It raises ``CaptureError`` for what a capture
refuses or would not replay: host work or a host wait in the capturing thread, work on a stream
that has not joined the capture (a wait on an event recorded in it), a wait on an event recorded
outside it, and a stream's work not joined back into the capturing stream at the end. A replay
forks every captured stream from the capturing stream and joins them back, as a graph launch.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engram_offload.gpu.sync import HOST, MAIN, Access, DeviceSync, OrderingError, PageableCopyError, _local, poll

__all__ = ["TracingSync", "Graph", "CaptureError", "upload_buffers"]

_capture = threading.local()  # .graph: the capture the calling thread records into


class CaptureError(OrderingError):
    """Work a CUDA graph capture would refuse, or would not replay."""


def upload_buffers(sync: DeviceSync) -> list[torch.Tensor]:
    """The pinned buffers of ``sync``'s upload rings (copies leave from these or a staging ring)."""
    return [b for ring in sync.__dict__.get("_upload_rings", {}).values() for b in ring.buffers]


@dataclass(frozen=True)
class _Op:
    stream: str
    seq: int
    label: str


@dataclass
class _Event:
    clock: dict[str, int]


@dataclass
class _BufferState:
    writer: _Op | None = None
    readers: list[_Op] = field(default_factory=list)


@dataclass
class _Storage:
    """A tensor storage the tracer follows: where it lives, who allocated it, its accesses."""

    place: str  # "device", "host" (pageable) or "mapped" (pinned or registered host memory)
    stream: str | None  # the allocating stream (None: not allocated under the trace)
    label: str
    state: _BufferState = field(default_factory=_BufferState)
    kept: set[str] = field(default_factory=set)  # streams given by keep_alive


class _Captured:
    """An event recorded during a capture: a replay records a fresh one in its place."""

    def __init__(self, graph: "Graph", stream: str, index: int) -> None:
        self.graph, self.stream, self.index = graph, stream, index


class Graph:
    """The device work a capture recorded, in order, and the streams that joined it."""

    def __init__(self, sync: "TracingSync", origin: str) -> None:
        self.sync, self.origin = sync, origin
        self.ops: list[tuple[str, tuple[Any, ...]]] = []
        self.joined = {origin}
        self._last: dict[str, int] = {}  # stream -> index of its last captured op
        self._joined_back: dict[str, int] = {}  # stream -> index of its last op the origin waited for

    def add(self, kind: str, stream: str, args: tuple[Any, ...]) -> int:
        if stream == HOST:
            raise CaptureError(f"{kind} on the host during a capture: a graph replays device work only")
        if stream not in self.joined:
            raise CaptureError(f"{kind} on {stream}, which has not joined the capture of {self.origin}: make it "
                               "wait for an event recorded in the capture first")
        self.ops.append((kind, args))
        self._last[stream] = len(self.ops) - 1
        return len(self.ops) - 1

    def record(self, stream: str) -> _Captured:
        event = _Captured(self, stream, len(self.ops))
        self.add("record", stream, (stream, event))
        return event

    def wait(self, stream: str, event: Any) -> None:
        if not isinstance(event, _Captured) or event.graph is not self:
            raise CaptureError(f"{stream} waits during a capture on an event recorded outside it")
        self.joined.add(stream)
        if stream == self.origin:
            self._joined_back[event.stream] = max(self._joined_back.get(event.stream, -1), event.index)
        self.add("wait", stream, (stream, event))

    def end(self) -> None:
        for stream in self.joined - {self.origin}:
            if self._last.get(stream, -1) > self._joined_back.get(stream, -1):
                raise CaptureError(f"the work captured on {stream} is not joined back into {self.origin}: make "
                                   f"{self.origin} wait for an event recorded on {stream} after it")

    def replay(self) -> None:
        """Run the captured work again on the capturing stream (a graph launch), in this thread."""
        sync = self.sync
        start = sync.record(self.origin)
        for stream in self.joined - {self.origin}:
            sync.wait(stream, start)
        events: dict[int, Any] = {}
        for kind, args in self.ops:
            if kind == "run":
                stream, fn, reads, writes = args
                sync.run(stream, fn, reads=reads, writes=writes)
            elif kind == "record":
                events[id(args[1])] = sync.record(args[0])
            elif kind == "wait":
                sync.wait(args[0], events[id(args[1])])
            elif kind == "write_value":
                sync.write_value(*args)
            else:
                sync.wait_value(*args)
        for stream in self.joined - {self.origin}:
            sync.wait(self.origin, sync.record(stream))


def _stream_stack() -> list[str]:
    stack = getattr(_local, "streams", None)
    if stack is None:
        stack = _local.streams = []
    return stack


class _TensorMode(TorchDispatchMode):
    def __init__(self, tracer: "TracingSync") -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_local, "paused", False):
            return func(*args, **kwargs)
        before = self.tracer._before_op(func, args, kwargs)
        out = func(*args, **kwargs)
        self.tracer._after_op(func, before, out)
        return out


def _storages(values: Iterable[Any]) -> dict[int, torch.Tensor]:
    """Storage address -> one tensor on it, for the tensors among ``values`` (empty ones skipped)."""
    found: dict[int, torch.Tensor] = {}
    for v in values:
        if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes():
            found.setdefault(v.untyped_storage().data_ptr(), v)
    return found


class TracingSync(DeviceSync):
    """Runs work at once and checks happens-before on every buffer it touches;
    ``tensors=True`` also follows tensors inside ``tracking()`` (see the module doc)."""

    def __init__(self, *, tensors: bool = False) -> None:
        self._clocks: dict[str, dict[str, int]] = defaultdict(dict)  # stream -> vector clock
        self._buffers: dict[tuple[str, int | None], _BufferState] = defaultdict(_BufferState)
        self.log: list[str] = []
        self.copies: list[tuple[str, torch.Tensor]] = []  # (stream, source) of every copy
        self._lock = threading.RLock()  # a consumer thread and worker threads share one trace
        self.tensors = tensors
        self._tracking = False
        self._storages: dict[int, _Storage] = {}  # storage address -> what the tracer knows
        self._error: OrderingError | None = None  # found in a finalizer, raised at the next call
        self._words: dict[int, tuple[int, dict[str, int]]] = {}  # word address -> last value written, its clock
        self.wait_limit_s = 30.0  # a wait_value longer than this is a hang

    # ------------------------------------------------------------------ named buffers
    def _happened(self, op: _Op, stream: str) -> bool:
        """Whether ``op`` happens-before the next work on ``stream``."""
        return op.stream == stream or self._clocks[stream].get(op.stream, 0) >= op.seq

    def _parts(self, access: Access | None) -> Iterable[tuple[str, int | None]]:
        for name, indices in (access or {}).items():
            if indices is None:
                yield name, None
            else:
                for i in np.asarray(indices, dtype=np.int64).reshape(-1).tolist():
                    yield name, i

    def _check_state(self, op: _Op, s: _BufferState, what: object, writing: bool) -> None:
        if s.writer is not None and not self._happened(s.writer, op.stream):
            raise OrderingError(f"{op.label} on {op.stream} touches {what} before its writer "
                                f"{s.writer.label} on {s.writer.stream} is known to be finished")
        if writing:
            for reader in s.readers:
                if not self._happened(reader, op.stream):
                    raise OrderingError(f"{op.label} on {op.stream} overwrites {what} before its reader "
                                        f"{reader.label} on {reader.stream} is known to be finished")

    def _check(self, op: _Op, key: tuple[str, int | None], writing: bool) -> None:
        state = self._buffers[key]
        # A whole-buffer key conflicts with its parts' keys: check both ways.
        states = [state] + ([self._buffers[(key[0], None)]] if key[1] is not None else [])
        if key[1] is None:
            states += [s for (n, i), s in self._buffers.items() if n == key[0] and i is not None]
        for s in states:
            self._check_state(op, s, key, writing)

    def copy(self, stream, dst, src, *, reads=None, writes=None):
        with self._lock:
            self.copies.append((stream, src))
            super().copy(stream, dst, src, reads=reads, writes=writes)

    def run(self, stream, fn, *, reads=None, writes=None):
        graph = self._graph()
        if graph is not None:
            graph.add("run", stream, (stream, fn, reads, writes))
            return None
        with self._lock:
            self._raise_found()
            return self._run(stream, fn, reads, writes)

    def _tick(self, stream: str, label: str) -> _Op:
        clock = self._clocks[stream]
        clock[stream] = clock.get(stream, 0) + 1
        return _Op(stream, clock[stream], label)

    def _run(self, stream, fn, reads, writes):
        op = self._tick(stream, getattr(fn, "__name__", "work"))
        read_keys, write_keys = list(self._parts(reads)), list(self._parts(writes))
        for key in read_keys:
            self._check(op, key, writing=False)
        for key in write_keys:
            self._check(op, key, writing=True)
        for key in read_keys:
            self._buffers[key].readers.append(op)
        for key in write_keys:
            self._buffers[key] = _BufferState(writer=op)
        self.log.append(f"{stream}:{op.label}")
        stack = _stream_stack()
        stack.append(stream)
        pushed = self._enter_mode()
        try:
            return fn()
        finally:
            if pushed is not None:
                pushed.__exit__(None, None, None)
                _local.tracer = None
            stack.pop()

    def record(self, stream):
        graph = self._graph()
        if graph is not None:
            return graph.record(stream)
        with self._lock:
            self._raise_found()
            return _Event(dict(self._clocks[stream]))

    def wait(self, stream, event):
        if event is None:
            return
        graph = self._graph()
        if graph is not None:
            return graph.wait(stream, event)
        if isinstance(event, _Captured):
            raise CaptureError(f"{stream} waits on an event recorded during a capture, outside it")
        with self._lock:
            self._merge(stream, event.clock)

    def _merge(self, stream: str, clock: dict[str, int]) -> None:
        mine = self._clocks[stream]
        for s, seq in clock.items():
            mine[s] = max(mine.get(s, 0), seq)

    def synchronize(self, event):
        self._host_waits("synchronize")
        self.wait(HOST, event)

    def done(self, event):
        """Work runs at once, so it is done; the host now knows it (as after a real query)."""
        self.synchronize(event)
        return True

    # ------------------------------------------------------------------ words and captures
    def _graph(self) -> Graph | None:
        graph = getattr(_capture, "graph", None)
        return graph if graph is not None and graph.sync is self else None

    def _host_waits(self, what: str) -> None:
        if self._graph() is not None:
            raise CaptureError(f"{what} in the capturing thread: the host waits for device work during a capture")

    def capturing(self):
        return self._graph() is not None

    @contextlib.contextmanager
    def capture(self, stream: str = MAIN) -> Iterator[Graph]:
        """Record the device work this thread enqueues (not running it) into a ``Graph``."""
        if self._graph() is not None:
            raise CaptureError("a capture inside a capture")
        graph = _capture.graph = Graph(self, stream)
        try:
            yield graph
        finally:
            _capture.graph = None
        graph.end()

    def write_value(self, stream, word, value):
        graph = self._graph()
        if graph is not None:
            graph.add("write_value", stream, (stream, word, value))
            return
        with self._lock:
            self._raise_found()
            self._tick(stream, "write_value")
            with self.paused():
                word.fill_(value)
            self._words[word.data_ptr()] = (int(value), dict(self._clocks[stream]))
            self.log.append(f"{stream}:write_value")

    def _acquire(self, stream: str, word: torch.Tensor, value: int) -> None:
        written = self._words.get(word.data_ptr())
        if written is not None and written[0] == value:
            self._merge(stream, written[1])

    def wait_value(self, stream, word, value):
        graph = self._graph()
        if graph is not None:
            graph.add("wait_value", stream, (stream, word, value))
            return
        with self.paused():
            seen = poll(lambda: int(word) == value, self.wait_limit_s)
        if not seen:
            raise OrderingError(f"{stream} waited {self.wait_limit_s:g} s for a word to hold {value}: on a GPU, a hang")
        with self._lock:
            self._raise_found()
            self._tick(stream, "wait_value")
            self._acquire(stream, word, value)
            self.log.append(f"{stream}:wait_value")

    def read_value(self, word):
        self._host_waits("read_value")
        with self._lock, self.paused():
            value = int(word)
            self._acquire(HOST, word, value)
            return value

    def host_knows_finished(self, stream: str) -> bool:
        """Whether the host has waited for (or seen finished) all work enqueued on ``stream``."""
        with self._lock:
            return self._clocks[HOST].get(stream, 0) >= self._clocks[stream].get(stream, 0)

    # ------------------------------------------------------------------ tensors
    @contextlib.contextmanager
    def tracking(self) -> Iterator["TracingSync"]:
        """Follow tensors in this thread (and inside ``run`` in any thread) until the block ends."""
        if not self.tensors:
            raise ValueError("this TracingSync does not follow tensors: make it with TracingSync(tensors=True)")
        self._tracking = True
        mode = self._enter_mode()
        try:
            yield self
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
                _local.tracer = None
            self._tracking = False
        self.check()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Tensor work in this block is not followed (a test's own checks)."""
        was = getattr(_local, "paused", False)
        _local.paused = True
        try:
            yield
        finally:
            _local.paused = was

    def check(self) -> None:
        """Raise what a finalizer found (a block freed while another stream might use it)."""
        with self._lock:
            self._raise_found()

    def _raise_found(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _enter_mode(self) -> TorchDispatchMode | None:
        if not self._tracking or getattr(_local, "tracer", None) is not None:
            return None
        mode = _TensorMode(self)
        mode.__enter__()
        _local.tracer = self
        return mode

    def _current(self) -> str:
        stack = _stream_stack()
        return stack[-1] if stack else MAIN

    def _storage(self, t: torch.Tensor) -> _Storage | None:
        return self._storages.get(t.untyped_storage().data_ptr())

    def _new(self, t: torch.Tensor, place: str, stream: str | None, label: str) -> _Storage:
        storage = t.untyped_storage()
        address = storage.data_ptr()
        known = _Storage(place, stream, label)
        self._storages[address] = known
        weakref.finalize(storage, self._freed, address, known)
        return known

    def _freed(self, address: int, known: _Storage) -> None:
        """A storage died: its block goes back to its stream's pool, reusable by that stream's
        next allocation; a use on another stream must be kept alive or ordered before it."""
        with self._lock:
            if self._storages.get(address) is known:
                del self._storages[address]
            if known.place != "device" or known.stream is None:
                return
            state = known.state
            for op in ([state.writer] if state.writer else []) + state.readers:
                if op.stream in (known.stream, HOST) or op.stream in known.kept:
                    continue
                if not self._happened(op, known.stream) and self._error is None:
                    self._error = OrderingError(
                        f"{known.label} (allocated on {known.stream}) was freed while {op.label} on {op.stream} "
                        f"may still use it: keep_alive it on {op.stream} or order {op.stream} before its reuse")

    def _access(self, label: str, reads: Iterable[torch.Tensor], writes: Iterable[torch.Tensor],
                allocs: Iterable[torch.Tensor]) -> None:
        stream = self._current()
        op = self._tick(stream, label)
        reads, writes, allocs = list(reads), list(writes), list(allocs)
        for t in reads + writes:
            known = self._storage(t)
            if known is None:
                continue
            if known.place == "host" and stream != HOST:
                raise PageableCopyError(
                    f"{label} on {stream} uses pageable host memory ({known.label}): on a GPU that is a "
                    "blocking copy; send it with DeviceSync.upload or a StagingRing")
            self._check_state(op, known.state, known.label, writing=any(t is w for w in writes))
        for t in reads:
            known = self._storage(t)
            if known is not None:
                known.state.readers.append(op)
        for t in writes:
            known = self._storage(t)
            if known is not None:
                known.state = _BufferState(writer=op)
        for t in allocs:
            self._new(t, "host" if stream == HOST else "device", stream, f"a tensor from {label}").state.writer = op

    def _kernel(self, label: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
        with self._lock:
            self._raise_found()
            self._access(label, reads, writes, [])

    def _before_op(self, func: Any, args: tuple, kwargs: dict) -> tuple:
        schema = func._schema
        flat_in, _ = tree_flatten((args, kwargs))
        inputs = _storages(flat_in)
        written: dict[int, torch.Tensor] = {}
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.update(_storages(tree_flatten(value)[0]))
        return inputs, written

    def _after_op(self, func: Any, before: tuple, out: Any) -> None:
        inputs, written = before
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        with self._lock:
            self._raise_found()
            if view:
                if func is torch.ops.aten.lift_fresh.default:  # a tensor made from NumPy or a list
                    for address, t in inputs.items():
                        if address not in self._storages:
                            self._new(t, "host", None, "host memory from NumPy or a list")
                return
            outputs = _storages(tree_flatten(out)[0])
            allocs = [t for a, t in outputs.items() if a not in inputs and a not in self._storages]
            reads = [t for a, t in inputs.items() if a not in written]
            self._access(str(func.overloadpacket.__name__), reads, list(written.values()), allocs)

    def keep_alive(self, tensor, stream):
        with self._lock:
            known = self._storage(tensor) if tensor.untyped_storage().nbytes() else None
            if known is not None:
                known.kept.add(stream)

    def host_mapped(self, tensor):
        with self._lock:
            if tensor.untyped_storage().nbytes():
                self._new(tensor, "mapped", None, "mapped host memory")

    def release_host(self, tensor):
        with self._lock:
            self._raise_found()
            known = self._storage(tensor) if tensor.untyped_storage().nbytes() else None
            if known is None:
                return
            op = _Op(HOST, self._clocks[HOST].get(HOST, 0) + 1, "release_host")
            self._check_state(op, known.state, known.label, writing=True)
