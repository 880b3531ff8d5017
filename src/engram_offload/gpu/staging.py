"""``StagingRing``: pinned host buffers that carry rows read from NVMe to the device.

A read lands in buffer ``k`` (host work), a ``non_blocking`` copy on a copy stream moves it
to the device and records an event, and buffer ``k`` is written again only after that
event: the host never overwrites bytes a copy may still be reading. Device copies come only
from pinned buffers (a pageable copy would block and stage through a driver buffer).

The copy stream does not wait for the stream that allocated ``dst``: allocate it on the
copy stream (``sync.empty(ring.stream, ...)``) and ``keep_alive`` it on the streams that
read it, or make the copy stream wait for the allocating stream first; the caching
allocator orders a block's reuse only on its own stream.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from .sync import HOST, Access, DeviceSync, ImmediateSync

__all__ = ["StagingRing"]

COPY_STREAM = "staging_copy"
_RING_NUMBERS = itertools.count()


class StagingRing:
    """``count`` host buffers of ``buffer_bytes`` each, used round robin."""

    def __init__(self, count: int, buffer_bytes: int, *, device: torch.device | str,
                 sync: DeviceSync | None = None, stream: str = COPY_STREAM) -> None:
        if count < 1 or buffer_bytes < 1:
            raise ValueError(f"a staging ring needs at least one buffer of at least one byte, "
                             f"got {count} buffers of {buffer_bytes} bytes")
        self.device = torch.device(device)
        self.sync = sync or ImmediateSync()
        self.stream = stream
        pin = self.device.type == "cuda"  # a CPU-only run has no pinned memory to ask for
        self.buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]
        for buffer in self.buffers:
            self.sync.host_mapped(buffer)
        self._events: list[object] = [None] * count
        self._next = 0
        self.name = f"staging{next(_RING_NUMBERS)}"  # this ring's buffers, as DeviceSync names them

    @property
    def buffer_bytes(self) -> int:
        return self.buffers[0].numel()

    def stage(self, read_into: Callable[[torch.Tensor], int], dst: torch.Tensor, *,
              writes: Access | None = None) -> object:
        """Fill the next buffer with ``read_into(buffer) -> bytes read`` (on the host), then copy
        those bytes into the flat ``uint8`` device tensor ``dst`` (``writes``: how ``DeviceSync``
        names it); returns the copy's event."""
        k = self._next
        self._next = (k + 1) % len(self.buffers)
        buffer = self.buffers[k]
        self.sync.synchronize(self._events[k])  # the previous copy out of buffer k has finished

        def read() -> int:
            return int(read_into(buffer))

        if dst.dtype != torch.uint8 or dst.dim() != 1:
            raise ValueError(f"dst must be a flat uint8 tensor, got {dst.dtype} {tuple(dst.shape)}")
        nbytes = self.sync.run(HOST, read, writes={self.name: [k]})
        if not 0 <= nbytes <= min(buffer.numel(), dst.numel()):
            raise ValueError(f"read_into returned {nbytes} bytes; buffer holds {buffer.numel()}, "
                             f"dst {dst.numel()}")
        self.sync.wait(self.stream, self.sync.record(HOST))
        self.sync.copy(self.stream, dst[:nbytes], buffer[:nbytes], reads={self.name: [k]}, writes=writes)
        event = self.sync.record(self.stream)
        self._events[k] = event
        return event
