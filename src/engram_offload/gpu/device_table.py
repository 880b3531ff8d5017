"""``DeviceTable``: a table in host memory that the device reads in place, over UVA.

A ``memory`` or ``pinned`` tier keeps the whole table as dense rows ``uint8 [R, row_bytes]``
in host memory. ``DeviceTable(tier.rows, device)`` makes those bytes readable by the GPU
without a second copy: memory that is already pinned is used as it is, other memory is
page-locked in place (``register_host``) until ``close()``. Its gathers run the UVA kernels
(``gather_raw``, ``gather_rows``): one launch reads random rows straight from host memory.

On a CPU device nothing is registered, and the gathers are the CPU ones (the references, or
the Triton interpreter under ``TRITON_INTERPRET=1``), so the same code is tested without a GPU.
"""

from __future__ import annotations

import torch

from ..buffers.hostmem import HostRegistration, register_host
from ..engram.config import EngramConfig
from .kernels import gather_raw, gather_rows, head_dim_of

__all__ = ["DeviceTable"]


class DeviceTable:
    """``table uint8 [R, row_bytes]`` in host memory, readable by ``device``."""

    def __init__(self, table: torch.Tensor, device: torch.device | str) -> None:
        if table.device.type != "cpu" or table.dtype != torch.uint8 or table.dim() != 2:
            raise ValueError(f"DeviceTable takes host rows uint8 [rows, row_bytes], got {table.dtype} "
                             f"{tuple(table.shape)} on {table.device}")
        self.table = table
        self.device = torch.device(device)
        self.registration: HostRegistration | None = None
        if self.device.type == "cuda" and not table.is_pinned():
            self.registration = register_host(table)  # in place: no second copy of the table

    @property
    def num_rows(self) -> int:
        return int(self.table.shape[0])

    def gather_raw(self, ids: torch.Tensor, out: torch.Tensor | None = None, *,
                   background: bool = False) -> torch.Tensor:
        """Rows ``ids [n]`` as stored -> ``uint8 [n, row_bytes]`` on the device."""
        if out is None:
            out = torch.empty((ids.shape[0], self.table.shape[1]), dtype=torch.uint8, device=self.device)
        return gather_raw(self.table, ids, out=out, background=background)

    def gather_rows(self, ids: torch.Tensor, config_or_format: EngramConfig | str, *,
                    out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                    background: bool = False) -> torch.Tensor:
        """Rows ``ids [n]`` dequantized -> ``[n, head_dim]`` of ``dtype`` on the device."""
        if out is None:
            fmt = config_or_format.row_format if isinstance(config_or_format, EngramConfig) else config_or_format
            head_dim = head_dim_of(fmt, self.table.shape[1])
            out = torch.empty((ids.shape[0], head_dim), dtype=dtype, device=self.device)
        return gather_rows(self.table, ids, config_or_format, out=out, background=background)

    def close(self) -> None:
        """Unregister the pages (the table itself stays its owner's)."""
        if self.registration is not None:
            self.registration.close()
            self.registration = None

    def __enter__(self) -> "DeviceTable":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
