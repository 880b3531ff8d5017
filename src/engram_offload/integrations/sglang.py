"""The SGLang plugin: DeepSeek-V4.1's Engram table served from an engram-offload tier.

Installed as the ``sglang.srt.plugins`` entry point ``engram_offload``. SGLang configures
Engram by environment variables, so the settings are one: ``ENGRAM_OFFLOAD_CONFIG``, the same
JSON keys as the vLLM plugin's (``settings``). Without it ``register`` does nothing. With it,
``register`` checks SGLang (every name the plugin uses, ``missing_names``; a version not in
``TESTED_VERSIONS`` only with ``"allow_untested_engine": true``, warned) and registers a REPLACE
hook of ``sglang.srt.layers.engram.EngramEmbedding`` (SGLang's ``HookRegistry`` also rebinds the
name in the modules that imported it, e.g. ``engram_staging``).

The replacement keeps SGLang's own row split (``shard_range``: whole heads when the columns
divide evenly over the TP ranks, else equal rows) and its ``forward`` (zero rows for ids the
rank does not own, then SGLang's all-reduce); only ``_owned_rows`` changes, dequantized as
SGLang's torch path does (fp8 value times the e8m0 scale as float32, so scale byte 0 gives
``2**-127`` here, where vLLM gives 0.0). A split by whole heads opens the store with the rank's
columns (a resident tier holds only the rank's rows); an equal-row split opens the whole table.
``tier: "auto"`` is resolved once a process, at the first Engram layer (``auto.resolve_tier`` for
SGLang's TP ranks and DP replicas), and its choice logged.

- In-place tiers (``memory``, ``pinned``, ``shared``): the GPU gathers the owned rows from the
  store's host rows (``DeviceTable.gather_raw`` on the current stream, ids masked on the device,
  no host sync), so SGLang keeps its CUDA graphs.
- Host-read tiers (``direct``, ``mmap``, ``remote``, a row server): the rows are read on the
  host in the layer (the CPU waits), which no captured graph can replay: with SGLang capturing
  graphs (its resolved server args; ``captures_graphs``) the first Engram layer refuses to
  build, naming the flags that turn them off.

Its ``weight``/``scale`` are empty placeholders whose loader compares a few checkpoint rows with
the table's and keeps nothing. SGLang's scheduler-side stager (``EngramRowStager``) is not
replaced: it asserts SGLang's own shared host table.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from typing import Any, Sequence

import numpy as np
import torch

from ..buffers.hostmem import device_reads_in_place
from ..engram.config import EngramConfig
from ..gpu.device_table import DeviceTable
from ..serving.sharding import Columns, column_range
from ..serving.store import RowStore
from .auto import resolve_tier
from .lookup import LayerShard, flat_ids
from .settings import AUTO, ENGRAM_BLOCK, OffloadSettings, check_graph_mode, open_store, settings_from_json

__all__ = ["ENV", "GRAPH_FIX", "OwnedRows", "TARGET", "TESTED_VERSIONS", "captures_graphs", "check_column_bounds",
           "check_engine", "embedding_class", "missing_names", "refusing_class", "register"]

log = logging.getLogger("engram_offload.integrations.sglang")

ENV = "ENGRAM_OFFLOAD_CONFIG"
TESTED_VERSIONS = ("0.5.23",)
TARGET = "sglang.srt.layers.engram.EngramEmbedding"
CHECKED_ROWS = 8
GRAPH_FIX = "start SGLang with --cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled"
# every SGLang name the plugin uses, by module
NAMES = {
    "sglang.srt.plugins.hook_registry": ("HookRegistry.register", "HookType.REPLACE"),
    "sglang.srt.layers.engram": ("EngramEmbedding._owned_rows", "EngramEmbedding.finish_load", "shard_range"),
    "sglang.srt.runtime_context": ("get_parallel",),
    "sglang.srt.model_executor.cuda_graph_config": ("cuda_graph_fully_disabled",),
}


def register() -> None:
    """SGLang's ``sglang.srt.plugins`` hook: replace ``EngramEmbedding`` when ``ENGRAM_OFFLOAD_CONFIG`` is set.

    A bad setting, an SGLang without a name the plugin uses or an untested one raises
    ``ValueError`` in one line. SGLang 0.5.23's ``load_plugins`` logs a plugin's exception and
    goes on, which would serve SGLang's own table (all of it in GPU memory): so where SGLang has
    the names, the replacement is registered first, as a class whose construction raises that
    same line, and the model stops loading at its first Engram layer.
    """
    text = os.environ.get(ENV)
    if not text:
        return
    try:
        settings = settings_from_json(text, ENV)
        version = _sglang_version()
        if version is None:
            log.warning("engram-offload: %s is set but SGLang is not installed; nothing to do", ENV)
            return
        check_engine(settings, version)
    except ValueError as exc:
        try:
            _replace_embedding(refusing_class(str(exc)))
        except Exception:  # an SGLang without those names: the exception is all there is
            pass
        raise
    _replace_embedding(embedding_class(settings))


def _sglang_version() -> str | None:
    """The installed SGLang's version; None without SGLang."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_names() -> list[str]:
    """The SGLang names the plugin uses (``NAMES``) that the installed SGLang lacks."""
    missing = []
    for module, names in NAMES.items():
        try:
            found: Any = importlib.import_module(module)
        except Exception:
            missing.append(module)
            continue
        for name in names:
            value = found
            for part in name.split("."):
                value = getattr(value, part, None)
            if value is None:
                missing.append(f"{module}.{name}")
    return missing


def check_engine(settings: OffloadSettings, version: str) -> None:
    """Refuse an SGLang that lacks a name the plugin uses, or an untested one unless
    ``allow_untested_engine`` (then warn), in one line."""
    missing = missing_names()
    if missing:
        raise ValueError(f"SGLang {version} lacks {', '.join(missing)}, which engram-offload uses: install SGLang "
                         f"{' or '.join(TESTED_VERSIONS)}")
    if version in TESTED_VERSIONS:
        return
    tested = ", ".join(TESTED_VERSIONS)
    if not settings.allow_untested_engine:
        raise ValueError(f"engram-offload was tested with SGLang {tested}, not {version}: install one of those, or "
                         f'add "allow_untested_engine": true to {ENV} to run it anyway (every SGLang name the '
                         "plugin uses is there)")
    log.warning("engram-offload: running on SGLang %s, which it was not tested with (%s), because "
                "allow_untested_engine is set; every SGLang name it uses is there", version, tested)


def _replace_embedding(cls: type) -> None:
    """Register ``cls`` as SGLang's ``EngramEmbedding`` (applied by SGLang's ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, cls, HookType.REPLACE)


def captures_graphs() -> bool:
    """Whether SGLang captures CUDA graphs of a phase (its resolved ``cuda_graph_config``, as
    its own ``cuda_graph_fully_disabled`` reads it; assumed before its server args are published)."""
    from sglang.srt.model_executor.cuda_graph_config import cuda_graph_fully_disabled

    return not cuda_graph_fully_disabled()


def check_column_bounds(config: EngramConfig, layer_id: int, column_bounds: Sequence[int], where: str) -> None:
    """Refuse a table whose layer differs from the checkpoint's (``column_bounds``: SGLang's
    ``[0, ..., num_embeddings]`` head boundaries of the layer), in one line."""
    if layer_id not in config.layer_ids:
        raise ValueError(f"the table {where} has no Engram layer {layer_id} (it has {list(config.layer_ids)}): "
                         "convert this checkpoint's table with `engram-offload convert CHECKPOINT TABLE`")
    ours = [0, *np.cumsum(config.head_sizes(layer_id)).tolist()]
    if [int(b) for b in column_bounds] != ours:
        raise ValueError(f"the table {where} was converted from another model (layer {layer_id}'s heads differ): "
                         "convert this checkpoint's table with `engram-offload convert CHECKPOINT TABLE`")


def _dequant(raw: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Packed rows ``uint8 [n, row_bytes]`` -> bf16 ``[n, head_dim]``, as SGLang's torch path:
    fp8 value times the e8m0 scale in float32 (scale byte 0 gives ``2**-127``; zero bytes give +0)."""
    values = raw[:, :head_dim].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (-1, ENGRAM_BLOCK))
    scales = raw[:, head_dim:].contiguous().view(torch.float8_e8m0fnu).float()  # [n, head_dim / 32]
    return (values * scales.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


class OwnedRows:
    """One layer's rows ``[row_start, row_start + rows)`` (layer-local) from a store, as SGLang's
    ``_owned_rows`` computes them. With ``table`` (the store's host rows as the device reads them
    in place, and the flat table row of their row 0) the device gathers them; else they are read
    on the host."""

    def __init__(self, store: RowStore, config: EngramConfig, layer_id: int, row_start: int, rows: int,
                 table: tuple[DeviceTable, int] | None = None) -> None:
        self.store = store
        self.config = config
        self.layer_id = layer_id
        self.row_start, self.rows = int(row_start), int(rows)
        self.row_base = config.layer_row_bases[config.layer_ids.index(layer_id)]
        self.table = table
        c = config.cols_per_layer  # every column, SGLang's rows of the layer
        self.shard = LayerShard(layer_id, c, c, 0, c, self.row_start, self.row_start + self.rows, self.row_base)

    def owned_rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Layer-local ids ``[..., C]`` -> bf16 ``[..., C, head_dim]``: owned rows, zeros elsewhere."""
        d = self.config.head_dim
        if self.rows <= 0:
            return torch.zeros((*indices.shape, d), dtype=torch.bfloat16, device=indices.device)
        if self.table is not None:
            table, first = self.table
            ids, owned = flat_ids(self.shard, indices.reshape(-1, indices.shape[-1]).to(table.device), first)  # [T, C]
            raw = table.gather_raw(ids.reshape(-1))  # uint8 [T * C, row_bytes], on the current stream
            raw.masked_fill_(~owned.reshape(-1, 1), 0)
            return _dequant(raw, d).view(*indices.shape, d)
        out = torch.zeros((*indices.shape, d), dtype=torch.bfloat16, device=indices.device)
        local = indices.to(torch.int64) - self.row_start
        owned = (local >= 0) & (local < self.rows)
        if not bool(owned.any()):
            return out
        flat = (indices.to(torch.int64)[owned] + self.row_base).cpu().numpy()
        out[owned] = _dequant(self.store.read_raw(flat).to(out.device), d)  # the CPU waits for the read
        return out

    def check_checkpoint(self, loaded: torch.Tensor, values: bool) -> None:
        """Compare ``CHECKED_ROWS`` of the checkpoint's layer tensor (the fp8 values, else the
        scales) with the table's; ``ValueError`` in one line when they differ."""
        if self.rows <= 0:
            return
        local = np.unique(np.linspace(self.row_start, self.row_start + self.rows - 1, CHECKED_ROWS).astype(np.int64))
        theirs = loaded.index_select(0, torch.from_numpy(local).to(loaded.device)).contiguous().view(torch.uint8)
        raw = self.store.read_raw(local + self.row_base)
        ours = raw[:, :self.config.head_dim] if values else raw[:, self.config.head_dim:]
        if not torch.equal(ours, theirs.cpu().reshape(ours.shape)):
            raise ValueError(f"the Engram table does not hold this checkpoint's rows (layer {self.layer_id}): "
                             "convert this checkpoint's table with `engram-offload convert CHECKPOINT TABLE`")


_stores: dict[Any, RowStore] = {}  # one store per process and column shard
_resolutions: dict[Any, OffloadSettings] = {}  # tier auto's choice, once a process


def _resolved(settings: OffloadSettings, parallel: Any, graphs: bool) -> OffloadSettings:
    """``settings`` with ``tier: "auto"`` resolved once a process (``auto.resolve_tier`` for SGLang's
    TP ranks and DP replicas), the choice logged."""
    if settings.tier != AUTO:
        return settings
    key = (settings.store_key(), parallel.tp_size)
    if key not in _resolutions:
        try:
            replicas = int(parallel.dp_size)
        except (ValueError, RuntimeError, AttributeError):  # SGLang's server args not published
            replicas = 1
        _resolutions[key], why = resolve_tier(settings, parallel.tp_size, replicas=replicas,
                                              graphs_fix=GRAPH_FIX if graphs else None)
        log.info("engram-offload: %s (%s)", why, settings.table)
    return _resolutions[key]


def _store(settings: OffloadSettings, num_columns: int, rank: int, world: int) -> RowStore:
    """This process's store for ``settings`` and the rank's share: its columns where SGLang's
    split is whole heads (``shard_range``), else the whole table."""
    whole_heads = num_columns % world == 0
    columns: Columns | None = column_range(num_columns, rank, world) if world > 1 and whole_heads else None
    key = (settings.store_key(), columns)
    if key not in _stores:
        if not whole_heads:
            log.info("engram-offload: SGLang splits each Engram layer's rows equally over %d TP ranks (%d columns "
                     "do not divide), so each rank opens the whole table", world, num_columns)
        _stores[key] = open_store(settings, columns)
    return _stores[key]


def _device_table(store: RowStore, layer_id: int, device: torch.device) -> tuple[DeviceTable, int] | None:
    """The store's host rows holding ``layer_id``'s rows as ``device`` reads them in place, and the
    flat table row of their row 0; None where it cannot (rows not resident, or not readable there)."""
    found = store.in_place_rows(layer_id)
    if found is None or not device_reads_in_place(found[0], device):
        return None
    return DeviceTable(found[0], device), int(found[1])


def refusing_class(message: str) -> type:
    """A stand-in for SGLang's ``EngramEmbedding`` whose construction raises ``ValueError(message)``."""
    from sglang.srt.layers import engram as S

    class RefusedEngramEmbedding(S.EngramEmbedding):  # type: ignore[misc, name-defined]
        """Refuses to build: ``ENGRAM_OFFLOAD_CONFIG`` is set but cannot be served."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ValueError(message)

    return RefusedEngramEmbedding


def _checking_loader(rows: OwnedRows, values: bool) -> Any:
    """SGLang's ``weight_loader(param, loaded)``: check the checkpoint's rows, keep nothing."""

    def load(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
        rows.check_checkpoint(loaded, values)

    return load


def embedding_class(settings: OffloadSettings) -> type:
    """``OffloadedEngramEmbedding``, a subclass of SGLang's ``EngramEmbedding`` reading ``settings``' table."""
    from sglang.srt.layers import engram as S
    from sglang.srt.runtime_context import get_parallel

    class OffloadedEngramEmbedding(S.EngramEmbedding):  # type: ignore[misc, name-defined]
        """SGLang's Engram embedding with its owned rows from an engram-offload store."""

        def __init__(self, num_embeddings: int, dim: int, layer_id: int, column_bounds: tuple[int, ...]) -> None:
            torch.nn.Module.__init__(self)
            parallel = get_parallel()
            graphs = captures_graphs()
            chosen = _resolved(settings, parallel, graphs)
            check_graph_mode(chosen, graphs, GRAPH_FIX)
            self.dim, self.tp_size = dim, parallel.tp_size
            self.row_start, row_end = S.shard_range(num_embeddings, column_bounds, parallel.tp_rank, parallel.tp_size)
            self.rows = row_end - self.row_start
            self.host_table, self._sort_host_reads, self.staged_by_scheduler, self.peer = None, False, False, None
            store = _store(chosen, len(column_bounds) - 1, parallel.tp_rank, parallel.tp_size)
            check_column_bounds(store.config, layer_id, column_bounds, chosen.table)
            table = None if chosen.host_read else _device_table(store, layer_id, torch.get_default_device())
            if table is None and not chosen.host_read and graphs:
                raise ValueError(f"this GPU cannot read the {chosen.tier} tier's rows in place (read-only host "
                                 "memory it cannot register, or no coherent UVA), and rows read on the host cannot "
                                 f"run in a CUDA graph: {GRAPH_FIX}, or use the pinned tier")
            self.engram_offload = OwnedRows(store, store.config, layer_id, self.row_start, self.rows, table)
            self.weight = torch.nn.Parameter(torch.empty(0, dim, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.scale = torch.nn.Parameter(torch.empty(0, dim // ENGRAM_BLOCK, dtype=torch.float8_e8m0fnu),
                                            requires_grad=False)
            for param, values in ((self.weight, True), (self.scale, False)):
                param.weight_loader = _checking_loader(self.engram_offload, values)  # type: ignore[attr-defined]

        def _owned_rows(self, indices: torch.Tensor) -> torch.Tensor:
            return self.engram_offload.owned_rows(indices)

        def finish_load(self, label: str) -> None:
            """Nothing was loaded: the rows stay in the table."""

    return OffloadedEngramEmbedding
