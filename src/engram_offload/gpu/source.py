"""``RowSource``: the adapter a serving engine calls to get Engram rows on its device.

At forward entry the engine passes the step's precomputed ids (engines hash on the GPU)::

    handle = source.start(layer_local_ids)          # [T, L, C], on the device or the host
    ...
    rows = handle.rows(layer_id)                    # [T, c1 - c0, head_dim] on the device

``start`` builds every layer's global ids on the main stream (one contiguous ``[L, T*c]``
tensor), then enqueues every layer's fetch on a side stream after the work the main stream
has enqueued so far (which made the ids and read the previous step's rows); the host never
waits for the device there. ``rows`` makes the main stream wait for that layer's event and
returns a view of a persistent buffer, so a CUDA graph can be captured around the consuming
layers while the fetch stays outside it. With ``max_tokens`` the buffers are allocated once,
at construction, and never move (a larger step raises); without it they grow, to new
addresses, when a step has more tokens than any before.

A tensor-parallel rank owns the columns ``tp_columns(C, tp_size, rank)``: ``cdiv(C, tp)``
consecutive columns, as vLLM's ``ParallelEngramEmbedding`` shards its heads.

Three ways to reach the rows:
- ``RowSource.from_table(table, ...)``: a table the device reads directly (pinned host
  memory over UVA, or device memory); one kernel per layer gathers and dequantizes.
- ``RowSource.from_store(store, ...)``: any ``open_table`` store. One opened with
  ``device=`` fetches each layer's distinct rows onto the device itself (HBM hits, UVA reads
  or pinned staging) and one kernel per layer puts them in order and dequantizes; a host
  store is read through ``read_raw``, as below.
- ``RowSource(read_raw, ...)``: any host function ``read_raw(flat_ids int64 [n]) -> uint8
  [n, row_bytes]``; rows go through a pinned staging ring to the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, TypedDict, Unpack

import numpy as np
import torch

from ..engram.config import EngramConfig
from .kernels import gather_raw, gather_rows
from .staging import StagingRing
from .sync import FETCH, MAIN, DeviceSync, make_sync

if TYPE_CHECKING:
    from ..serving.store import RowStore

__all__ = ["RowSource", "RowHandle", "tp_columns"]

FETCH_STREAM = FETCH
ReadRaw = Callable[[np.ndarray], "torch.Tensor | np.ndarray"]


class SourceOptions(TypedDict, total=False):
    """``RowSource``'s keyword options, as ``from_table`` and ``from_store`` pass them on."""

    sync: DeviceSync | None
    dequantize: bool
    dtype: torch.dtype
    stream: str
    staging_buffers: int
    max_tokens: int | None


def tp_columns(num_columns: int, tp_size: int, rank: int) -> tuple[int, int]:
    """The columns ``(c0, c1)`` tensor-parallel ``rank`` of ``tp_size`` owns: ``cdiv(C, tp)`` of them."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {tp_size}")
    per_rank = -(-num_columns // tp_size)
    c0 = rank * per_rank
    if c0 >= num_columns:
        raise ValueError(f"{num_columns} columns over {tp_size} ranks leave rank {rank} without columns")
    return c0, min(num_columns, c0 + per_rank)


class RowHandle:
    """One step's rows, fetched in the background; ``rows(layer_id)`` waits for that layer only."""

    def __init__(self, source: "RowSource", buffers: list[torch.Tensor], events: list[object]) -> None:
        self._source = source
        self._buffers = buffers
        self._events = events

    def rows(self, layer_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``layer_id``'s rows ``[T, c1 - c0, head_dim]`` (or raw ``row_bytes``), ready on
        the main stream; a view of a persistent buffer unless ``out`` is given."""
        index = self._source.layer_index(layer_id)
        sync = self._source.sync
        sync.wait(MAIN, self._events[index])
        rows = self._buffers[index]
        if out is None:
            sync.run(MAIN, lambda: None, reads={"engram_rows": [index]})
            return rows
        if out.shape != rows.shape or out.dtype != rows.dtype:
            raise ValueError(f"out must be {rows.dtype} {list(rows.shape)}, got {out.dtype} {list(out.shape)}")
        return sync.run(MAIN, lambda: out.copy_(rows), reads={"engram_rows": [index]})


class RowSource:
    """Fetches a step's Engram rows onto ``device`` for the layers of ``config``."""

    def __init__(self, read_raw: ReadRaw | None = None, *, config: EngramConfig,
                 device: torch.device | str, table: torch.Tensor | None = None,
                 sync: DeviceSync | None = None, dequantize: bool = True,
                 dtype: torch.dtype = torch.bfloat16, stream: str = FETCH_STREAM,
                 staging_buffers: int = 2, store: "RowStore | None" = None,
                 max_tokens: int | None = None) -> None:
        if sum(x is not None for x in (read_raw, table, store)) != 1:
            raise ValueError("give RowSource exactly one of read_raw (a host row reader), table or store")
        if store is not None and (store.sync is None or store.device != torch.device(device)):
            raise ValueError(f"the store delivers rows to {store.device}, not {device}: use RowSource.from_store")
        if table is not None and (table.dtype != torch.uint8 or tuple(table.shape) != (config.num_rows, config.row_bytes)):
            raise ValueError(f"table must be uint8 [{config.num_rows}, {config.row_bytes}] for this config, "
                             f"got {table.dtype} {tuple(table.shape)}")
        self.config = config
        self.device = torch.device(device)
        self.read_raw = read_raw
        self.table = table
        self.store = store
        self.sync = sync or (store.sync if store is not None else None) or make_sync(self.device)
        self.dequantize = dequantize
        self.dtype = dtype
        self.stream = stream
        self._staging_buffers = staging_buffers
        self._ring: StagingRing | None = None
        if table is not None and table.device.type == "cpu":
            self.sync.host_mapped(table)  # pinned or registered: the device reads it in place
        # [L] on the device, made once: start() never copies from the host
        self._bases = self.sync.upload(MAIN, np.asarray(config.layer_row_bases, dtype=np.int64), self.device)
        self.max_tokens = max_tokens
        self._buffers: list[torch.Tensor] = []  # per layer [T_max, c, width], fixed addresses
        if max_tokens is not None:
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
            self._allocate(max_tokens, config.cols_per_layer)

    @classmethod
    def from_table(cls, table: torch.Tensor, *, config: EngramConfig, device: torch.device | str,
                   **options: Unpack[SourceOptions]) -> "RowSource":
        """A source over a table the device reads directly (pinned host memory or device memory)."""
        return cls(None, config=config, device=device, table=table, **options)

    @classmethod
    def from_store(cls, store: "RowStore", *, device: torch.device | str | None = None,
                   **options: Unpack[SourceOptions]) -> "RowSource":
        """A source over an ``open_table`` store: one that delivers rows to ``device`` (default:
        the store's) fetches them there, with its own ``DeviceSync``; a host store is read on
        the host and staged."""
        device = torch.device(device) if device is not None else store.device
        if store.sync is not None:
            return cls(None, config=store.config, device=device, store=store, **options)
        if store.device.type != "cpu":
            raise ValueError(f"this store keeps rows on {store.device}; open the table with device= to serve a device")
        return cls(store.read_raw, config=store.config, device=device, **options)

    def layer_index(self, layer_id: int) -> int:
        try:
            return self.config.layer_ids.index(layer_id)
        except ValueError:
            raise KeyError(f"layer {layer_id} has no Engram; Engram layers are {list(self.config.layer_ids)}") from None

    def _width(self) -> tuple[int, torch.dtype]:
        if self.dequantize:
            return self.config.head_dim, self.dtype
        return self.config.row_bytes, torch.uint8

    def _allocate(self, tokens: int, columns: int) -> None:
        """Per-layer flat buffers for ``[tokens, columns, width]`` on the main stream, kept alive
        on the fetch stream (which writes them)."""
        width, dtype = self._width()
        self._buffers = [self.sync.empty(MAIN, (tokens * columns * width,), dtype, self.device)
                         for _ in self.config.layer_ids]
        for buffer in self._buffers:
            self.sync.keep_alive(buffer, self.stream)

    def _layer_buffers(self, tokens: int, columns: int) -> list[torch.Tensor]:
        """Per-layer output views ``[tokens, columns, width]`` at the start of each buffer: of
        the buffers made for ``max_tokens`` (never moved), else reallocated when too small."""
        width, _ = self._width()
        need = tokens * columns * width
        if self.max_tokens is not None:
            if tokens > self.max_tokens:
                raise ValueError(f"a step of {tokens} tokens is more than max_tokens={self.max_tokens}: the "
                                 "output buffers keep their addresses (for CUDA graphs); make the source with "
                                 "a larger max_tokens")
        elif not self._buffers or self._buffers[0].numel() < need:
            self._allocate(tokens, columns)
        return [b[:need].view(tokens, columns, width) for b in self._buffers]

    def start(self, layer_local_ids: torch.Tensor, *, columns: tuple[int, int] | None = None) -> RowHandle:
        """Begin fetching rows ``layer_local_ids [T, L, C]`` (ids within each layer's table);
        ``columns=(c0, c1)`` keeps that column range (a tensor-parallel rank's share)."""
        config = self.config
        expected = (len(config.layer_ids), config.cols_per_layer)
        if layer_local_ids.dim() != 3 or tuple(layer_local_ids.shape[1:]) != expected:
            raise ValueError(f"layer_local_ids must be [T, {expected[0]}, {expected[1]}], "
                             f"got {tuple(layer_local_ids.shape)}")
        c0, c1 = columns if columns is not None else (0, config.cols_per_layer)
        if not 0 <= c0 < c1 <= config.cols_per_layer:
            raise ValueError(f"columns {(c0, c1)} are not a range within [0, {config.cols_per_layer}]")
        tokens = layer_local_ids.shape[0]
        buffers = self._layer_buffers(tokens, c1 - c0)
        local = layer_local_ids
        if local.device != self.device:  # host ids: through the pinned upload ring, not a blocking copy
            local = self.sync.upload(MAIN, local.numpy(), self.device)
        bases = self._bases

        def global_ids() -> torch.Tensor:
            # layer-major and contiguous: [L, T*c], every layer's ids a plain view
            ids = local[:, :, c0:c1].permute(1, 0, 2).to(torch.int64) + bases[:, None, None]  # [L, T, c]
            return ids.contiguous().view(len(config.layer_ids), -1)

        ids = self.sync.run(MAIN, global_ids)  # made before the fetch stream waits for the main one
        self.sync.keep_alive(ids, self.stream)
        self.sync.wait_stream(self.stream, MAIN)  # ids are made and the last step's rows read
        if self.table is not None:
            events = [self._fetch_from_table(ids[i], buffers[i], i) for i in range(len(config.layer_ids))]
        else:
            ids_host = ids.cpu().numpy()  # the store and the reader dedup on the host: one copy a step
            fetch = self._fetch_from_store if self.store is not None else self._fetch_from_reader
            events = [fetch(ids_host[i], buffers[i], i) for i in range(len(config.layer_ids))]
        return RowHandle(self, buffers, events)

    def gather(self, layer_local_ids: torch.Tensor, layer_id: int, *, out: torch.Tensor | None = None,
               columns: tuple[int, int] | None = None) -> torch.Tensor:
        """Layer ``layer_id``'s rows ``[T, c1 - c0, width]`` gathered on the caller's stream, now:
        no side stream, no event, no host work on the device's data. With ``layer_local_ids``
        and ``out`` static device tensors it can be captured in a CUDA graph with the layers
        around it (vLLM's way: the lookup inside the graph). Only for a source over a table
        the device reads (``from_table``); a store's tiers read on the host cannot be captured."""
        if self.table is None:
            raise ValueError("gather() reads a table the device reads directly: make the source with from_table")
        config = self.config
        index = self.layer_index(layer_id)
        c0, c1 = columns if columns is not None else (0, config.cols_per_layer)
        if not 0 <= c0 < c1 <= config.cols_per_layer:
            raise ValueError(f"columns {(c0, c1)} are not a range within [0, {config.cols_per_layer}]")
        tokens = layer_local_ids.shape[0]
        width, dtype = self._width()
        if out is None:
            out = torch.empty((tokens, c1 - c0, width), dtype=dtype, device=self.device)
        elif tuple(out.shape) != (tokens, c1 - c0, width) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"out must be contiguous {dtype} {[tokens, c1 - c0, width]}, "
                             f"got {out.dtype} {list(out.shape)}")
        table = self.table

        def gather() -> torch.Tensor:
            ids = (layer_local_ids[:, index, c0:c1].to(torch.int64) + self._bases[index]).reshape(-1)  # [T*c]
            flat = out.view(-1, width)
            if self.dequantize:
                return gather_rows(table, ids, config, out=flat)
            return gather_raw(table, ids, out=flat)

        self.sync.run(MAIN, gather)
        return out

    def _gather_into(self, table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, index: int) -> object:
        """One kernel on the fetch stream: rows ``ids [n]`` of ``table`` (dequantized unless
        raw rows are asked for) into layer ``index``'s ``out [T, c, width]``; returns its event."""
        flat = out.view(-1, out.shape[-1])

        def gather() -> None:
            if self.dequantize:
                gather_rows(table, ids, self.config, out=flat, background=True)
            else:
                gather_raw(table, ids, out=flat, background=True)

        self.sync.run(self.stream, gather, writes={"engram_rows": [index]})
        return self.sync.record(self.stream)

    def _fetch_from_table(self, ids: torch.Tensor, out: torch.Tensor, index: int) -> object:
        """Rows ``ids [n]`` (on the device) straight from the table the device reads."""
        assert self.table is not None, "start() reads from the table only when there is one"
        return self._gather_into(self.table, ids, out, index)

    def _fetch_from_store(self, ids_host: np.ndarray, out: torch.Tensor, index: int) -> object:
        """The distinct rows fetched onto the device by the store, then put in order."""
        assert self.store is not None, "start() fetches from the store only when there is one"
        unique, inverse = np.unique(ids_host, return_inverse=True)
        lease = self.store.fetch(unique, hold=False, requested=ids_host.size)
        self.sync.wait(self.stream, lease.ready)
        self.sync.keep_alive(lease.raw, self.stream)
        order = self.sync.upload(self.stream, inverse.reshape(-1), self.device)  # [T*c] rows of lease.raw
        return self._gather_into(lease.raw, order, out, index)

    def _fetch_from_reader(self, ids_host: np.ndarray, out: torch.Tensor, index: int) -> object:
        """Read the distinct rows on the host, stage them (once each) to the device, put them
        in order and dequantize there."""
        read_raw = self.read_raw
        assert read_raw is not None, "without a table or a store, a source has read_raw"
        unique, inverse = np.unique(ids_host, return_inverse=True)
        row_bytes = self.config.row_bytes
        nbytes = unique.size * row_bytes
        if self._ring is None or self._ring.buffer_bytes < nbytes:
            self._ring = StagingRing(self._staging_buffers, max(nbytes, 1 << 20), device=self.device, sync=self.sync)
        ring = self._ring
        # allocated on the copy stream that writes it, kept alive on the fetch stream that reads it
        raw_dev = self.sync.empty(ring.stream, (nbytes,), torch.uint8, self.device)  # [u * row_bytes]
        self.sync.keep_alive(raw_dev, self.stream)
        order = self.sync.upload(self.stream, inverse.reshape(-1), self.device)  # [T*c] rows of raw_dev

        def read_into(buffer: torch.Tensor) -> int:
            raw = torch.as_tensor(read_raw(unique))
            if raw.dtype != torch.uint8 or tuple(raw.shape) != (unique.size, row_bytes):
                raise ValueError(f"read_raw must return uint8 [{unique.size}, {row_bytes}], "
                                 f"got {raw.dtype} {tuple(raw.shape)}")
            buffer[:nbytes].view(unique.size, row_bytes).numpy()[:] = raw.numpy()
            return nbytes

        staged = ring.stage(read_into, raw_dev)
        self.sync.wait(self.stream, staged)
        return self._gather_into(raw_dev.view(unique.size, row_bytes), order, out, index)
