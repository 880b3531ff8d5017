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

    Host rows may come as a NumPy array: ``host_raw`` reads them as one, and the tensor
    ``raw`` is made only when asked for (a tensor's end lets go of the GIL, which costs a
    thread switch when another thread waits for it).
    """

    def __init__(self, ids: np.ndarray, raw: torch.Tensor | np.ndarray, pins: Pins,
                 ready: object = None) -> None:
        self.ids = ids
        self._raw = raw
        self.ready = ready
        self._pins = pins
        self._lock = threading.Lock()

    @property
    def raw(self) -> torch.Tensor:
        """uint8 ``[u, row_bytes]`` (on the store's device)."""
        if isinstance(self._raw, np.ndarray):
            self._raw = torch.from_numpy(self._raw)
        return self._raw

    @property
    def host_raw(self) -> np.ndarray:
        """uint8 ``[u, row_bytes]`` as a NumPy array (host rows only)."""
        return self._raw if isinstance(self._raw, np.ndarray) else self._raw.numpy()

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
