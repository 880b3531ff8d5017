"""``Lease``: raw rows of distinct ids and the cache pins that keep them resident."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .row_cache import RowCache

__all__ = ["Lease", "Pins", "RowsInPlace", "require_hold"]

Pins = list[tuple[RowCache, np.ndarray]]  # [(cache level, pinned slots)]


@dataclass(frozen=True)
class RowsInPlace:
    """Rows a host cache served whole and left where it holds them, pinned by the lease:
    row i is ``arena[slots[i]]``. A decoder reads them there (``decode_rows(arena,
    slots=slots)``): no copy of the raw rows on the way."""

    arena: np.ndarray  # uint8 [capacity, row_bytes]: the cache's rows
    slots: np.ndarray  # int64 [u]

    def copy(self, out: np.ndarray | None = None) -> np.ndarray:
        """The rows as one array, uint8 ``[u, row_bytes]``: a new one, or ``out``."""
        return np.take(self.arena, self.slots, axis=0, out=out)


def require_hold(in_place: bool, hold: bool) -> None:
    """A fetch may leave rows in a cache (``in_place``) only if it pins them (``hold``)."""
    if in_place and not hold:
        raise ValueError("fetch(in_place=True) needs hold=True: rows left in a cache stay there only while pinned")


class Lease:
    """Raw rows of distinct ids (``raw: uint8 [u, row_bytes]``) and the cache pins behind them.

    ``ready``: for rows delivered to a device, the ``DeviceSync`` event after which ``raw``
    holds them (wait for it on the stream that reads them); None when they are there now.
    ``release()`` (or leaving the ``with`` block) unpins; releasing twice is harmless.

    Host rows may come as a NumPy array: ``host_raw`` reads them as one, and the tensor
    ``raw`` is made only when asked for (a tensor's end lets go of the GIL, which costs a
    thread switch when another thread waits for it). They may also have been left in a
    host cache (``fetch(..., in_place=True)``): ``in_place`` says where, and ``raw`` and
    ``host_raw`` copy them out when asked for, while the lease still pins them.
    """

    def __init__(self, ids: np.ndarray, raw: torch.Tensor | np.ndarray | RowsInPlace, pins: Pins,
                 ready: object = None) -> None:
        self.ids = ids
        self.in_place = raw if isinstance(raw, RowsInPlace) else None
        self._raw = raw
        self.ready = ready
        self._pins = pins
        self._lock = threading.Lock()

    @property
    def raw(self) -> torch.Tensor:
        """uint8 ``[u, row_bytes]`` (on the store's device)."""
        if not isinstance(self._raw, torch.Tensor):
            self._raw = torch.from_numpy(self.host_raw)
        return self._raw

    @property
    def host_raw(self) -> np.ndarray:
        """uint8 ``[u, row_bytes]`` as a NumPy array (host rows only)."""
        if isinstance(self._raw, RowsInPlace):
            if not self._pins:
                raise RuntimeError("this lease was released: its rows, left in the cache, may be gone; "
                                   "read them before releasing it")
            self._raw = self._raw.copy()
        return self._raw if isinstance(self._raw, np.ndarray) else self._raw.numpy()

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
