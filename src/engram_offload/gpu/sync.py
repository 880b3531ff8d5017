"""``DeviceSync``: the streams and events that order device work, behind one small interface.

Code that moves rows names its streams (``"main"`` is the caller's current stream,
``"host"`` the calling thread; any other name is a side stream made on first use) and says
which buffers each piece of work reads and writes. Three implementations:

- ``CudaSync``: real CUDA streams and events.
- ``ImmediateSync``: the CPU; work runs at once, in call order, and every event is done.
- ``TracingSync`` (tests): runs work at once like ``ImmediateSync`` but keeps a vector
  clock per stream and raises ``OrderingError`` when a piece of work touches a buffer
  whose previous writer, or for a write, previous readers, do not happen-before it
  through the recorded events, waits and host synchronizations. A bug that would be a
  race on a GPU is an exception on a CPU. It also keeps every host-to-device ``copy``'s
  source, so a test can check rows only ever leave from pinned staging buffers.

Host-to-device copies go through ``copy``: ``CudaSync`` refuses a pageable source (such a
copy blocks the host and stages through a driver buffer).

Buffers are named by ``{name: indices}``: ``indices`` are the parts touched (say the slots
of an HBM cache) or ``None`` for the whole buffer.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

__all__ = ["DeviceSync", "CudaSync", "ImmediateSync", "TracingSync", "OrderingError", "make_sync"]

Access = Mapping[str, Iterable[int] | np.ndarray | None]
HOST = "host"
MAIN = "main"
FETCH = "engram_fetch"  # the side stream that fetches a step's rows


class OrderingError(AssertionError):
    """Device work touched a buffer before the work it depends on was known to be finished."""


class DeviceSync(ABC):
    """Streams by name, work on a stream, events recorded and waited on."""

    @abstractmethod
    def run(self, stream: str, fn: Callable[[], Any], *, reads: Access | None = None,
            writes: Access | None = None) -> Any:
        """Enqueue ``fn`` (which launches device work) on ``stream``; return what it returns."""

    @abstractmethod
    def record(self, stream: str) -> Any:
        """An event that completes when the work enqueued on ``stream`` so far has finished."""

    @abstractmethod
    def wait(self, stream: str, event: Any) -> None:
        """Later work on ``stream`` starts after ``event`` (the host does not block)."""

    @abstractmethod
    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""

    @abstractmethod
    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed (never blocks)."""

    def copy(self, stream: str, dst: torch.Tensor, src: torch.Tensor, *, reads: Access | None = None,
             writes: Access | None = None) -> None:
        """Enqueue ``dst.copy_(src, non_blocking=True)`` on ``stream``."""

        def copy() -> None:
            dst.copy_(src, non_blocking=True)

        self.run(stream, copy, reads=reads, writes=writes)

    def wait_stream(self, stream: str, other: str) -> None:
        """Later work on ``stream`` starts after the work enqueued on ``other`` so far."""
        self.wait(stream, self.record(other))

    def keep_alive(self, tensor: torch.Tensor, stream: str) -> None:
        """Tell the allocator ``tensor`` is used on ``stream`` (CUDA's ``record_stream``)."""


class ImmediateSync(DeviceSync):
    """The CPU: work runs when enqueued, so every event is complete when recorded."""

    def run(self, stream, fn, *, reads=None, writes=None):
        return fn()

    def record(self, stream):
        return None

    def wait(self, stream, event):
        return None

    def synchronize(self, event):
        return None

    def done(self, event):
        return True


class CudaSync(DeviceSync):
    """CUDA streams (made on first use on ``device``) and events."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaSync needs a CUDA device; use ImmediateSync on a CPU")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        self._streams: dict[str, torch.cuda.Stream] = {}

    def stream(self, name: str) -> torch.cuda.Stream:
        if name == MAIN:
            return torch.cuda.current_stream(self.device)
        if name not in self._streams:
            self._streams[name] = torch.cuda.Stream(self.device)
        return self._streams[name]

    def run(self, stream, fn, *, reads=None, writes=None):
        if stream == HOST:
            return fn()
        with torch.cuda.stream(self.stream(stream)):
            return fn()

    def record(self, stream):
        if stream == HOST:
            return None
        event = torch.cuda.Event()
        event.record(self.stream(stream))
        return event

    def wait(self, stream, event):
        if event is None:
            return
        if stream == HOST:
            event.synchronize()
        else:
            self.stream(stream).wait_event(event)

    def synchronize(self, event):
        if event is not None:
            event.synchronize()

    def done(self, event):
        return event is None or event.query()

    def copy(self, stream, dst, src, *, reads=None, writes=None):
        if dst.is_cuda and src.device.type == "cpu" and not src.is_pinned():
            raise ValueError("a host-to-device copy from pageable memory: stage the rows through pinned "
                             "buffers (StagingRing)")
        super().copy(stream, dst, src, reads=reads, writes=writes)

    def keep_alive(self, tensor, stream):
        if stream != HOST and tensor.is_cuda:
            tensor.record_stream(self.stream(stream))


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


class TracingSync(DeviceSync):
    """Runs work at once and checks happens-before on every buffer it touches (test-only)."""

    def __init__(self) -> None:
        self._clocks: dict[str, dict[str, int]] = defaultdict(dict)  # stream -> vector clock
        self._buffers: dict[tuple[str, int | None], _BufferState] = defaultdict(_BufferState)
        self.log: list[str] = []
        self.copies: list[tuple[str, torch.Tensor]] = []  # (stream, source) of every copy
        self._lock = threading.RLock()  # a consumer thread and worker threads share one trace

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

    def _check(self, op: _Op, key: tuple[str, int | None], writing: bool) -> None:
        state = self._buffers[key]
        # A whole-buffer key conflicts with its parts' keys: check both ways.
        states = [state] + ([self._buffers[(key[0], None)]] if key[1] is not None else [])
        if key[1] is None:
            states += [s for (n, i), s in self._buffers.items() if n == key[0] and i is not None]
        for s in states:
            if s.writer is not None and not self._happened(s.writer, op.stream):
                raise OrderingError(f"{op.label} on {op.stream} touches {key} before its writer "
                                    f"{s.writer.label} on {s.writer.stream} is known to be finished")
            if writing:
                for reader in s.readers:
                    if not self._happened(reader, op.stream):
                        raise OrderingError(f"{op.label} on {op.stream} overwrites {key} before its reader "
                                            f"{reader.label} on {reader.stream} is known to be finished")

    def copy(self, stream, dst, src, *, reads=None, writes=None):
        with self._lock:
            self.copies.append((stream, src))
            super().copy(stream, dst, src, reads=reads, writes=writes)

    def run(self, stream, fn, *, reads=None, writes=None):
        with self._lock:
            return self._run(stream, fn, reads, writes)

    def _run(self, stream, fn, reads, writes):
        clock = self._clocks[stream]
        clock[stream] = clock.get(stream, 0) + 1
        op = _Op(stream, clock[stream], getattr(fn, "__name__", "work"))
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
        return fn()

    def record(self, stream):
        with self._lock:
            return _Event(dict(self._clocks[stream]))

    def wait(self, stream, event):
        if event is None:
            return
        with self._lock:
            clock = self._clocks[stream]
            for s, seq in event.clock.items():
                clock[s] = max(clock.get(s, 0), seq)

    def synchronize(self, event):
        self.wait(HOST, event)

    def done(self, event):
        """Work runs at once, so it is done; the host now knows it (as after a real query)."""
        self.synchronize(event)
        return True


def make_sync(device: torch.device | str | None = None) -> DeviceSync:
    """``CudaSync`` for a CUDA device, else ``ImmediateSync``."""
    if device is not None and torch.device(device).type == "cuda":
        return CudaSync(device)
    return ImmediateSync()
