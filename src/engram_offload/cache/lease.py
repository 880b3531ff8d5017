"""``Lease``: raw rows of distinct ids and the cache pins that keep them resident."""

from __future__ import annotations

import threading

import numpy as np
import torch

from .row_cache import RowCache

__all__ = ["Lease", "Pins"]

Pins = list[tuple[RowCache, np.ndarray]]  # [(cache level, pinned slots)]


class Lease:
    """Raw rows of distinct ids (``raw: uint8 [u, row_bytes]``) and the cache pins behind them.

    ``ready``: for rows delivered to a device, the ``DeviceSync`` event after which ``raw``
    holds them (wait for it on the stream that reads them); None when they are there now.
    ``release()`` (or leaving the ``with`` block) unpins; releasing twice is harmless.
    """

    def __init__(self, ids: np.ndarray, raw: torch.Tensor, pins: Pins,
                 ready: object = None) -> None:
        self.ids = ids
        self.raw = raw
        self.ready = ready
        self._pins = pins
        self._lock = threading.Lock()

    @property
    def pinned_rows(self) -> int:
        return sum(int(s.size) for _, s in self._pins)

    def release(self) -> None:
        if not self._pins:  # nothing pinned (or already released): no lock needed
            return
        with self._lock:
            pins, self._pins = self._pins, []
        for level, slots in pins:
            level.release(slots)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a forgotten lease must not pin rows forever
        try:
            self.release()
        except Exception:
            pass
