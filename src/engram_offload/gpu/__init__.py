"""Rows on the GPU: gathers from pinned host memory and HBM, an HBM hot-row cache, pinned
staging, and the streams and events that order them.

Importing this package needs neither Triton nor CUDA: the kernels are imported when they
first run, and every kernel has a pure-torch reference that CPU tensors fall back to.
Install the kernels with ``pip install 'engram-offload[gpu]'``.
"""

from __future__ import annotations

from ..buffers.hostmem import HostRegistration, page_span, register_host, uva_coherent, uva_view
from .hbm_cache import HbmRowCache
from .kernels import dequant_rows, gather_raw, gather_rows, head_dim_of, runs_triton, tiered_gather
from .reference import dequant_rows_ref, gather_raw_ref, gather_rows_ref, tiered_gather_ref
from .sync import CudaSync, DeviceSync, ImmediateSync, OrderingError, StagingRing, make_sync

__all__ = [
    "gather_raw",
    "gather_rows",
    "dequant_rows",
    "tiered_gather",
    "head_dim_of",
    "runs_triton",
    "gather_raw_ref",
    "gather_rows_ref",
    "dequant_rows_ref",
    "tiered_gather_ref",
    "register_host",
    "HostRegistration",
    "page_span",
    "uva_view",
    "uva_coherent",
    "HbmRowCache",
    "StagingRing",
    "DeviceSync",
    "CudaSync",
    "ImmediateSync",
    "OrderingError",
    "make_sync",
]
