"""The SGLang plugin: DeepSeek-V4.1's Engram table served from an engram-offload tier.

Installed as the ``sglang.srt.plugins`` entry point ``engram_offload``. SGLang configures
Engram by environment variables, so the settings are one: ``ENGRAM_OFFLOAD_CONFIG``, the same
JSON keys as the vLLM plugin's (``settings``). Without it ``register`` does nothing. With it,
``register`` checks SGLang's version and registers a REPLACE hook of
``sglang.srt.layers.engram.EngramEmbedding`` (SGLang's ``HookRegistry`` also rebinds the name in
the modules that imported it, e.g. ``engram_staging``).

The replacement keeps SGLang's own row split (``shard_range``: whole heads when the columns
divide evenly over the TP ranks, else equal rows) and its ``forward`` (zero rows for ids the
rank does not own, then SGLang's all-reduce); only ``_owned_rows`` changes: the owned rows are
read from the store (``OwnedRows``) and dequantized as SGLang's torch path does (fp8 value times
the e8m0 scale as float32, so scale byte 0 gives ``2**-127`` here, where vLLM gives 0.0). Its
``weight``/``scale`` are empty placeholders whose loader compares a few checkpoint rows with the
table's and keeps nothing. The read is synchronous (the CPU waits in the layer): a host-read
tier needs ``--disable-cuda-graph``. SGLang's scheduler-side stager (``EngramRowStager``) is not
replaced: it asserts SGLang's own shared host table.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from typing import Any, Sequence

import numpy as np
import torch

from ..engram.config import EngramConfig
from ..serving.store import RowStore
from .settings import ENGRAM_BLOCK, OffloadSettings, open_store, settings_from_json

__all__ = ["ENV", "OwnedRows", "TARGET", "TESTED_VERSIONS", "check_column_bounds", "embedding_class", "refusing_class",
           "register"]

log = logging.getLogger("engram_offload.integrations.sglang")

ENV = "ENGRAM_OFFLOAD_CONFIG"
TESTED_VERSIONS = ("0.5.23",)
TARGET = "sglang.srt.layers.engram.EngramEmbedding"
CHECKED_ROWS = 8


def register() -> None:
    """SGLang's ``sglang.srt.plugins`` hook: replace ``EngramEmbedding`` when ``ENGRAM_OFFLOAD_CONFIG`` is set.

    A bad setting raises ``ValueError`` in one line. SGLang 0.5.23's ``load_plugins`` logs a
    plugin's exception and goes on, which would serve SGLang's own table (all of it in GPU
    memory): so with a tested SGLang the replacement is registered first, as a class whose
    construction raises that same line, and the model stops loading at its first Engram layer.
    """
    text = os.environ.get(ENV)
    if not text:
        return
    try:
        settings = settings_from_json(text, ENV)
    except ValueError as exc:
        if _sglang_version() in TESTED_VERSIONS:
            _replace_embedding(refusing_class(str(exc)))
        raise
    version = _sglang_version()
    if version is None:
        log.warning("engram-offload: %s is set but SGLang is not installed; nothing to do", ENV)
        return
    if version not in TESTED_VERSIONS:
        log.warning("engram-offload: SGLang %s is not a tested version (%s); the plugin does nothing", version,
                    ", ".join(TESTED_VERSIONS))
        return
    _replace_embedding(embedding_class(settings))


def _sglang_version() -> str | None:
    """The installed SGLang's version; None without SGLang."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _replace_embedding(cls: type) -> None:
    """Register ``cls`` as SGLang's ``EngramEmbedding`` (applied by SGLang's ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, cls, HookType.REPLACE)


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


class OwnedRows:
    """One layer's rows ``[row_start, row_start + rows)`` (layer-local) from a store, as SGLang's
    ``_owned_rows`` computes them."""

    def __init__(self, store: RowStore, config: EngramConfig, layer_id: int, row_start: int, rows: int) -> None:
        self.store = store
        self.config = config
        self.layer_id = layer_id
        self.row_start, self.rows = int(row_start), int(rows)
        self.row_base = config.layer_row_bases[config.layer_ids.index(layer_id)]

    def owned_rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Layer-local ids (any shape) -> bf16 ``[*indices.shape, head_dim]``: owned rows, zeros elsewhere."""
        d = self.config.head_dim
        out = torch.zeros((*indices.shape, d), dtype=torch.bfloat16, device=indices.device)
        local = indices.to(torch.int64) - self.row_start
        owned = (local >= 0) & (local < self.rows)
        if not bool(owned.any()):
            return out
        flat = (indices.to(torch.int64)[owned] + self.row_base).cpu().numpy()
        raw = self.store.read_raw(flat)  # uint8 [m, row_bytes]
        values = raw[:, :d].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (-1, ENGRAM_BLOCK))
        scales = raw[:, d:].contiguous().view(torch.float8_e8m0fnu).float()  # SGLang's: byte 0 is 2**-127
        rows = (values * scales.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)  # [m, d]
        out[owned] = rows.to(out.device)
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


_stores: dict[Any, RowStore] = {}


def _checking_loader(rows: OwnedRows, values: bool) -> Any:
    """SGLang's ``weight_loader(param, loaded)``: check the checkpoint's rows, keep nothing."""

    def load(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
        rows.check_checkpoint(loaded, values)

    return load


def refusing_class(message: str) -> type:
    """A stand-in for SGLang's ``EngramEmbedding`` whose construction raises ``ValueError(message)``."""
    from sglang.srt.layers import engram as S

    class RefusedEngramEmbedding(S.EngramEmbedding):  # type: ignore[misc, name-defined]
        """Refuses to build: ``ENGRAM_OFFLOAD_CONFIG`` is set but not valid."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ValueError(message)

    return RefusedEngramEmbedding


def embedding_class(settings: OffloadSettings) -> type:
    """``OffloadedEngramEmbedding``, a subclass of SGLang's ``EngramEmbedding`` reading ``settings``' table."""
    from sglang.srt.layers import engram as S
    from sglang.srt.runtime_context import get_parallel

    class OffloadedEngramEmbedding(S.EngramEmbedding):  # type: ignore[misc, name-defined]
        """SGLang's Engram embedding with its owned rows read from an engram-offload store."""

        def __init__(self, num_embeddings: int, dim: int, layer_id: int, column_bounds: tuple[int, ...]) -> None:
            torch.nn.Module.__init__(self)
            parallel = get_parallel()
            self.dim, self.tp_size = dim, parallel.tp_size
            self.row_start, row_end = S.shard_range(num_embeddings, column_bounds, parallel.tp_rank, parallel.tp_size)
            self.rows = row_end - self.row_start
            self.host_table, self._sort_host_reads, self.staged_by_scheduler, self.peer = None, False, False, None
            key = settings.store_key()
            if key not in _stores:
                _stores[key] = open_store(settings, None)
            store = _stores[key]
            check_column_bounds(store.config, layer_id, column_bounds, settings.table)
            self.engram_offload = OwnedRows(store, store.config, layer_id, self.row_start, self.rows)
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
