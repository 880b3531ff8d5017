"""``RowSource``: the adapter a serving engine calls to get Engram rows on its device.

At forward entry the engine passes the step's precomputed ids (engines hash on the GPU)::

    handle = source.start(layer_local_ids)          # [T, L, C], on the device or the host
    ...
    rows = handle.rows(layer_id)                    # [T, c1 - c0, head_dim] on the device

``start`` enqueues every layer's fetch on a side stream (after the work the main stream has
enqueued so far, which made the ids and read the previous step's rows); ``rows`` makes the
main stream wait for that layer's event and returns a view of a persistent buffer, so a
CUDA graph can be captured around the consuming layers while the fetch stays outside it.

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
from .kernels import dequant_rows, gather_raw, gather_rows
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
                 staging_buffers: int = 2, store: "RowStore | None" = None) -> None:
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
        self._bases = torch.tensor(config.layer_row_bases, dtype=torch.int64)  # [L]
        self._buffers: list[torch.Tensor] = []  # per layer [T_max, c, width], fixed addresses

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

    def _layer_buffers(self, tokens: int, columns: int) -> list[torch.Tensor]:
        """Per-layer output views ``[tokens, columns, width]``, reallocated only when too small."""
        width = self.config.head_dim if self.dequantize else self.config.row_bytes
        dtype = self.dtype if self.dequantize else torch.uint8
        layers = len(self.config.layer_ids)
        if not self._buffers or self._buffers[0].shape[0] < tokens or self._buffers[0].shape[1:] != (columns, width) \
                or self._buffers[0].dtype != dtype:
            self._buffers = [torch.empty((tokens, columns, width), dtype=dtype, device=self.device)
                             for _ in range(layers)]
        return [b[:tokens] for b in self._buffers]

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
        # Global row ids, layer-major: [L, T, c].
        ids = layer_local_ids[:, :, c0:c1].to(torch.int64).permute(1, 0, 2)
        ids = ids + self._bases.to(ids.device)[:, None, None]
        self.sync.wait_stream(self.stream, MAIN)  # ids are made and the last step's rows read
        fetch = self._fetch_from_table if self.table is not None else \
            self._fetch_from_store if self.store is not None else self._fetch_from_reader
        events = [fetch(ids[i].reshape(-1), buffers[i], i) for i in range(len(config.layer_ids))]
        return RowHandle(self, buffers, events)

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
        """Rows ``ids [n]`` straight from the table the device reads (host ids are checked, then
        moved on the fetch stream)."""
        assert self.table is not None, "start() reads from the table only when there is one"
        return self._gather_into(self.table, ids, out, index)

    def _fetch_from_store(self, ids: torch.Tensor, out: torch.Tensor, index: int) -> object:
        """The distinct rows fetched onto the device by the store, then put in order."""
        assert self.store is not None, "start() fetches from the store only when there is one"
        ids_host = ids.cpu().numpy()
        unique, inverse = np.unique(ids_host, return_inverse=True)
        lease = self.store.fetch(unique, hold=False, requested=ids_host.size)
        self.sync.wait(self.stream, lease.ready)
        self.sync.keep_alive(lease.raw, self.stream)
        return self._gather_into(lease.raw, torch.from_numpy(inverse.reshape(-1)), out, index)

    def _fetch_from_reader(self, ids: torch.Tensor, out: torch.Tensor, index: int) -> object:
        """Read unique rows on the host, stage them to the device, dequantize there."""
        read_raw = self.read_raw
        assert read_raw is not None, "without a table or a store, a source has read_raw"
        ids_host = ids.cpu().numpy()
        unique, inverse = np.unique(ids_host, return_inverse=True)
        row_bytes = self.config.row_bytes
        nbytes = ids_host.size * row_bytes
        if self._ring is None or self._ring.buffer_bytes < nbytes:
            self._ring = StagingRing(self._staging_buffers, nbytes, device=self.device, sync=self.sync)
        raw_dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

        def read_into(buffer: torch.Tensor) -> int:
            raw = torch.as_tensor(read_raw(unique))
            if raw.dtype != torch.uint8 or tuple(raw.shape) != (unique.size, row_bytes):
                raise ValueError(f"read_raw must return uint8 [{unique.size}, {row_bytes}], "
                                 f"got {raw.dtype} {tuple(raw.shape)}")
            rows = buffer[:nbytes].view(ids_host.size, row_bytes)
            torch.index_select(raw, 0, torch.from_numpy(inverse.reshape(-1)), out=rows)
            return nbytes

        staged = self._ring.stage(read_into, raw_dev)
        self.sync.keep_alive(raw_dev, self._ring.stream)
        self.sync.wait(self.stream, staged)
        flat = out.view(-1, out.shape[-1])
        raw = raw_dev.view(ids_host.size, row_bytes)

        def decode() -> None:
            if self.dequantize:
                dequant_rows(raw, self.config, out=flat, background=True)
            else:
                flat.copy_(raw)
            self.sync.keep_alive(raw_dev, self.stream)

        self.sync.run(self.stream, decode, writes={"engram_rows": [index]})
        return self.sync.record(self.stream)
