"""A prefetched step's device output buffers: one ``[T_max, C, head_dim]`` buffer per Engram
layer, reused from step to step so their addresses stay fixed (a CUDA graph can be captured
around the layers that read them)."""

from __future__ import annotations

import threading

import torch

from ..gpu.sync import FETCH, MAIN, DeviceSync

__all__ = ["OutputPool", "Outputs"]


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


class OutputPool:
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

