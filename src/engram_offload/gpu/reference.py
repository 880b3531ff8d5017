"""Pure-torch references of the gather kernels: the test oracle and the CPU fallback.

Each function computes what its Triton kernel computes, from ``index_select`` and
``rows.decode_rows``; they run on any device and never need Triton.
"""

from __future__ import annotations

import torch

from ..engram import rows

__all__ = ["gather_raw_ref", "dequant_rows_ref", "gather_rows_ref", "tiered_gather_ref"]


def gather_raw_ref(table: torch.Tensor, ids: torch.Tensor, *, zero_bad: bool = False) -> torch.Tensor:
    """``table [R, row_bytes]`` rows ``ids [n]`` -> ``[n, row_bytes]``; ``zero_bad``: zeros for
    ids outside the table (device ids, as the kernels do), else such an id raises."""
    ids = ids.to(device=table.device, dtype=torch.int64)  # [n]
    if not zero_bad:
        return table.index_select(0, ids)
    ok = (ids >= 0) & (ids < table.shape[0])  # [n]
    return table.index_select(0, torch.where(ok, ids, 0)) * ok[:, None].to(table.dtype)


def dequant_rows_ref(raw: torch.Tensor, fmt: str, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Raw rows ``uint8 [n, row_bytes]`` -> values ``[n, head_dim]`` of ``dtype``."""
    return rows.decode_rows(raw, fmt, head_dim, dtype)


def gather_rows_ref(
    table: torch.Tensor, ids: torch.Tensor, fmt: str, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """``table [R, row_bytes]`` rows ``ids [n]`` dequantized -> ``[n, head_dim]``."""
    return dequant_rows_ref(gather_raw_ref(table, ids), fmt, head_dim, dtype)


def tiered_gather_ref(
    host_table: torch.Tensor, hbm_slots: torch.Tensor, slot_of_row: torch.Tensor, ids: torch.Tensor, *,
    slots_by_position: bool = False,
) -> torch.Tensor:
    """Raw rows ``[n, row_bytes]``: ``hbm_slots[slot_of_row[id]]`` (``slot_of_row[i]`` with
    ``slots_by_position``) where that slot is >= 0, else ``host_table[id]``."""
    ids = ids.to(device=host_table.device, dtype=torch.int64)  # [n]
    slot_map = slot_of_row.to(host_table.device)
    slots = (slot_map if slots_by_position else slot_map.index_select(0, ids)).to(torch.int64)  # [n]
    hit = slots >= 0
    from_host = host_table.index_select(0, ids)  # [n, row_bytes]
    from_hbm = hbm_slots.to(host_table.device).index_select(0, slots.clamp(min=0))  # [n, row_bytes]
    return torch.where(hit[:, None], from_hbm, from_host)
