"""``DeviceSync``: the streams and events that order device work, behind one small interface;
``StagingRing``: the pinned host buffers every host-to-device copy of rows and ids leaves from.

Code that moves rows names its streams (``"main"`` is the caller's current stream,
``"host"`` the calling thread; any other name is a side stream made on first use) and says
which buffers each piece of work reads and writes, named by ``{name: indices}``: ``indices``
are the parts touched (say the slots of an HBM cache) or ``None`` for the whole buffer. Two
implementations: ``CudaSync`` (real CUDA streams and events) and ``ImmediateSync`` (the CPU:
work runs at once, in call order, and every event is done); the tests add one that checks the
ordering on a CPU, which ``kernel_access``, ``host_mapped`` and ``release_host`` inform.

Host-to-device copies go through ``copy``: ``CudaSync`` refuses a pageable source (such a
copy blocks the host and stages through a driver buffer). They leave from a ``StagingRing``:
host work fills buffer ``k``, a ``non_blocking`` copy moves it to the device and records an
event, and buffer ``k`` is written again only after that event, so the host never overwrites
bytes a copy may still be reading. Small host arrays (ids, slot maps, fill indices) go
through ``upload``, a ring per device whose buffers grow to the largest array.

A ring's copy stream does not wait for the stream that allocated ``dst``: allocate it on the
copy stream (``sync.empty(ring.stream, ...)``) and ``keep_alive`` it on the streams that read
it, or make the copy stream wait for the allocating stream first; the caching allocator
orders a block's reuse only on its own stream.

Words of pinned host memory order a stream and a host thread without either blocking the other
(``write_value``, ``wait_value``, ``read_value``): on CUDA the stream memory operations of
``gpu.stream_ops``, which a CUDA graph captures and replays; on a CPU, where work runs when
enqueued, the caller of ``wait_value`` polls the word (bounded). ``capturing()`` says whether
the current stream is being captured into a graph (where no host wait may run).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from . import stream_ops

__all__ = ["DeviceSync", "CudaSync", "ImmediateSync", "StagingRing", "OrderingError", "PageableCopyError",
           "make_sync", "kernel_access", "poll"]

Access = Mapping[str, Iterable[int] | np.ndarray | None]
HOST = "host"
MAIN = "main"
FETCH = "engram_fetch"  # the side stream that fetches a step's rows
COPY_STREAM = "staging_copy"

UPLOAD_BUFFERS = 32  # pinned buffers of the upload ring: the host waits for the copy 32 uploads back
UPLOAD_MIN_BYTES = 1 << 16
WORD_WAIT_LIMIT_S = 120.0  # the longest a host waits in wait_value (a protocol bounds it far lower)
POLL_MIN_S, POLL_MAX_S = 20e-6, 200e-6  # a host polling a word sleeps this long, doubling
_RING_NUMBERS = itertools.count()
_local = threading.local()  # .tracer: a tracing sync following tensors in this thread; .paused


class OrderingError(AssertionError):
    """Device work touched a buffer before the work it depends on was known to be finished."""


class PageableCopyError(OrderingError):
    """Device work read pageable host memory: on a GPU a blocking copy (or a fault)."""


def poll(ready: Callable[[], bool], limit_s: float) -> bool:
    """Call ``ready`` until it returns True (then True) or ``limit_s`` has passed (then its last
    answer), sleeping from ``POLL_MIN_S`` doubling to ``POLL_MAX_S`` in between."""
    deadline = time.monotonic() + limit_s
    delay = POLL_MIN_S
    while not ready():
        if time.monotonic() > deadline:
            return ready()
        time.sleep(delay)
        delay = min(POLL_MAX_S, 2 * delay)
    return True


class DeviceSync(ABC):
    """Streams by name, work on a stream, events recorded and waited on, words written and
    waited on."""

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

    def write_value(self, stream: str, word: torch.Tensor, value: int) -> None:
        """Enqueue on ``stream`` a write of ``value`` into ``word`` (one int32 or int64 of pinned
        host memory), after the stream's earlier work and its writes; ``"host"`` writes it now."""
        word.fill_(value)

    def wait_value(self, stream: str, word: torch.Tensor, value: int) -> None:
        """Later work on ``stream`` starts once ``word`` holds ``value``; on a CPU the caller
        waits for it (at most ``WORD_WAIT_LIMIT_S``, then ``TimeoutError``)."""
        if not poll(lambda: int(word) == value, WORD_WAIT_LIMIT_S):
            raise TimeoutError(f"{stream} waited {WORD_WAIT_LIMIT_S:g} s for a word to hold {value}: whatever "
                               "should write it has stopped; check the thread that answers it")

    def read_value(self, word: torch.Tensor) -> int:
        """The host reads ``word`` (what a stream or another thread wrote there)."""
        return int(word)

    def stream_memops(self) -> bool:
        """Whether ``write_value``/``wait_value`` work on device streams (a CPU runs them at once)."""
        return True

    def capturing(self) -> bool:
        """Whether the calling thread's current stream is being captured into a CUDA graph."""
        return False

    def host_mapped(self, tensor: torch.Tensor) -> None:
        """Declare ``tensor`` pinned or registered host memory the device may read (tracing only)."""

    def release_host(self, tensor: torch.Tensor) -> None:
        """The host takes ``tensor``'s memory back (unregisters or frees it): every device use
        of it must be known to be finished (checked by the tracing sync)."""

    def empty(self, stream: str, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
        """A new tensor allocated for work on ``stream`` (from that stream's pool on CUDA)."""
        return self.run(stream, lambda: torch.empty(shape, dtype=dtype, device=device))

    def upload(self, stream: str, array: np.ndarray, device: torch.device | str) -> torch.Tensor:
        """``array`` (host, small: ids, slot maps, fill indices) on ``device`` for work on
        ``stream``: copied ``non_blocking`` from this sync's upload ring for ``device`` into a
        tensor allocated on ``stream``; the host never blocks on the device unless the ring has
        come round to a buffer whose copy has not finished."""
        array = np.ascontiguousarray(array)
        dtype = torch.from_numpy(array[:0].reshape(-1)).dtype
        if array.nbytes == 0:
            return self.empty(stream, array.shape, dtype, device)
        rings = self.__dict__.setdefault("_upload_rings", {})
        device = torch.device(device)
        ring = rings.get(str(device))
        if ring is None:
            ring = rings[str(device)] = StagingRing(UPLOAD_BUFFERS, UPLOAD_MIN_BYTES, device=device, sync=self,
                                                    grow=True)
        flat = array.reshape(-1).view(np.uint8)

        def write(buffer: torch.Tensor) -> int:
            buffer[:flat.size].numpy()[:] = flat
            return flat.size

        dst = self.empty(stream, (flat.size,), torch.uint8, device)
        ring.stage(write, dst, stream=stream)
        return dst.view(dtype).view(array.shape)


class StagingRing:
    """``count`` pinned host buffers of ``buffer_bytes`` each, used round robin (see the module
    doc); with ``grow`` a buffer grows to hold what it is asked to carry."""

    def __init__(self, count: int, buffer_bytes: int, *, device: torch.device | str,
                 sync: DeviceSync | None = None, stream: str = COPY_STREAM, grow: bool = False) -> None:
        if count < 1 or buffer_bytes < 1:
            raise ValueError(f"a staging ring needs at least one buffer of at least one byte, "
                             f"got {count} buffers of {buffer_bytes} bytes")
        self.device = torch.device(device)
        self.sync = sync or ImmediateSync()
        self.stream = stream
        self.grow = grow
        self.buffers = [self._pinned(buffer_bytes) for _ in range(count)]
        self._events: list[object] = [None] * count
        self._next = 0
        self._lock = threading.Lock()
        self.name = f"staging{next(_RING_NUMBERS)}"  # this ring's buffers, as DeviceSync names them

    def _pinned(self, nbytes: int) -> torch.Tensor:
        pin = self.device.type == "cuda"  # a CPU-only run has no pinned memory to ask for
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.sync.host_mapped(buffer)
        return buffer

    @property
    def buffer_bytes(self) -> int:
        return self.buffers[0].numel()

    def claim(self, nbytes: int = 0) -> int:
        """The next buffer's index, once the copy out of it has finished (the host blocks only
        when the ring comes round to a copy still running); with ``grow``, it holds ``nbytes``."""
        k = self._next
        self._next = (k + 1) % len(self.buffers)
        self.sync.synchronize(self._events[k])
        if self.grow and nbytes > self.buffers[k].numel():
            self.buffers[k] = self._pinned(max(UPLOAD_MIN_BYTES, 1 << (nbytes - 1).bit_length()))
        return k

    def send(self, k: int, src: torch.Tensor, dst: torch.Tensor, *, stream: str | None = None,
             writes: Access | None = None) -> object:
        """Copy ``src`` (a view of buffer ``k``, filled by host work) into ``dst`` on ``stream``
        (the ring's by default) after the host work so far; returns the copy's event, after
        which buffer ``k`` may be written again."""
        stream = stream or self.stream
        self.sync.wait(stream, self.sync.record(HOST))
        self.sync.copy(stream, dst, src, reads={self.name: [k]}, writes=writes)
        event = self._events[k] = self.sync.record(stream)
        return event

    def hold(self, k: int, event: object) -> None:
        """Buffer ``k`` is written again only after ``event`` too (work after its copy that
        still reads what the copy wrote, perhaps on another stream)."""
        self._events[k] = event

    def stage(self, read_into: Callable[[torch.Tensor], int], dst: torch.Tensor, *, stream: str | None = None,
              writes: Access | None = None) -> object:
        """Fill the next buffer with ``read_into(buffer) -> bytes read`` (on the host), then copy
        those bytes into the flat ``uint8`` device tensor ``dst`` (``writes``: how ``DeviceSync``
        names it); returns the copy's event."""
        if dst.dtype != torch.uint8 or dst.dim() != 1:
            raise ValueError(f"dst must be a flat uint8 tensor, got {dst.dtype} {tuple(dst.shape)}")
        with self._lock:
            k = self.claim(dst.numel())
            buffer = self.buffers[k]
            nbytes = self.sync.run(HOST, lambda: int(read_into(buffer)), writes={self.name: [k]})
            if not 0 <= nbytes <= min(buffer.numel(), dst.numel()):
                raise ValueError(f"read_into returned {nbytes} bytes; buffer holds {buffer.numel()}, "
                                 f"dst {dst.numel()}")
            return self.send(k, buffer[:nbytes], dst[:nbytes], stream=stream, writes=writes)


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
    """CUDA streams (made on first use on ``device``) and events.

    ``priorities`` maps stream names to CUDA stream priorities (lower is sooner; torch clamps
    to the device's range): the fetch stream defaults to the highest, since the first Engram
    layer needs its rows almost at once and a side stream at default priority waits behind
    the main stream's kernels for SMs."""

    def __init__(self, device: torch.device | str | int | None = None, *,
                 priorities: Mapping[str, int] | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaSync needs a CUDA device; use ImmediateSync on a CPU")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        self._streams: dict[str, torch.cuda.Stream] = {}
        self.priorities = {FETCH: -1, **(priorities or {})}

    def stream(self, name: str) -> torch.cuda.Stream:
        if name == MAIN:
            return torch.cuda.current_stream(self.device)
        if name not in self._streams:
            self._streams[name] = torch.cuda.Stream(self.device, priority=self.priorities.get(name, 0))
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

    def write_value(self, stream, word, value):
        if stream == HOST:
            return super().write_value(stream, word, value)
        stream_ops.write_value(self.stream(stream), word, value)

    def wait_value(self, stream, word, value):
        if stream == HOST:
            return super().wait_value(stream, word, value)
        stream_ops.wait_value(self.stream(stream), word, value)

    def stream_memops(self):
        return stream_ops.supported(self.device)

    def capturing(self):
        return torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def kernel_access(reads: Iterable[torch.Tensor | None], writes: Iterable[torch.Tensor | None],
                  label: str = "kernel") -> Iterator[None]:
    """Around a kernel launch: a tracing sync following tensors in this thread records the
    launch as one piece of work reading ``reads`` and writing ``writes`` on the current stream,
    and does not look inside it. Costs nothing otherwise."""
    tracer = getattr(_local, "tracer", None)
    if tracer is None or getattr(_local, "paused", False):
        yield
        return
    tracer._kernel(label, [t for t in reads if t is not None], [t for t in writes if t is not None])
    _local.paused = True
    try:
        yield
    finally:
        _local.paused = False


def make_sync(device: torch.device | str | None = None) -> DeviceSync:
    """``CudaSync`` for a CUDA device, else ``ImmediateSync``."""
    if device is not None and torch.device(device).type == "cuda":
        return CudaSync(device)
    return ImmediateSync()
