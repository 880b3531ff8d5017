"""The vLLM plugin: DeepSeek-V4.1's Engram table served from an engram-offload tier.

Installed as the ``vllm.general_plugins`` entry point ``engram_offload``, so vLLM calls
``register()`` in every process before any model is built. ``register`` imports nothing
heavy: it arranges for two methods of ``vllm.models.deepseek_v41.common.engram.Engram`` to be
replaced when that module is imported (at once when it already is), provided every vLLM name
the plugin uses is there (``missing_names``; else it logs them and does nothing):

- ``Engram._create_embedding(layout, layer_hash_index)``, which builds each Engram layer's
  table module. The replacement reads ``get_current_vllm_config().additional_config``; unless
  it holds ``"engram_offload": {...}`` it calls vLLM's own method (vLLM's table, as before).
  Otherwise it checks vLLM's version (``check_engine``: an untested one is refused unless
  ``allow_untested_engine``) and returns an ``OffloadedEngramEmbedding``: a
  ``ParallelEngramEmbedding`` built without its constructor (no table allocated), holding this
  rank's columns (vLLM's split, rank and size from vLLM's tensor-parallel group, no
  collective) and a lookup from ``integrations.lookup``. The store is opened with the rank's
  columns, so a ``memory`` or ``pinned`` table holds only the rank's share of the rows. It
  reports ``dp_size = 1``: each data-parallel replica looks up its own tokens
  (``nvidia/model.py`` then gathers no ids). Its ``weight``/``weight_scale_inv`` are empty
  placeholders whose loader compares a few of the checkpoint's rows with the table's (a table
  converted from another checkpoint is refused) and keeps nothing.
- ``Engram._finish_prefetch(event)``, which a layer calls before it reads its rows: for a
  host-read tier it enqueues the wait for the read and the copy to the GPU. Where the driver
  has stream memory operations (``gpu.stream_ops``) the GPU itself waits for the host read
  (``docs/in-graph-reads.md``), so FULL CUDA graphs replay it; elsewhere the CPU waits here.

An in-place tier's rows are read by the GPU where they lie; where it cannot (a read-only
``shared`` segment on a GPU that cannot register read-only memory, no coherent UVA) they are
staged like a host-read tier's, and the start-up line says which.

Start-up fails closed (one line each): an untested vLLM; a table whose Engram layout is not
the checkpoint's; a host-read (or staged) tier under a CUDA-graph mode with FULL graphs on a
driver without stream memory operations (the CPU's wait would be captured once and never run
again: ``--enforce-eager``, or ``-cc.cudagraph_mode=PIECEWISE``).
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import sys
import threading
from types import ModuleType
from typing import Any

import numpy as np
import torch

from ..buffers.hostmem import device_reads_in_place
from ..engram.config import EngramConfig
from ..gpu import stream_ops
from ..gpu.device_table import DeviceTable
from ..gpu.sync import make_sync
from ..serving.sharding import column_range
from ..serving.store import RowStore
from ..table.format import read_header
from .auto import resolve_tier
from .lookup import AddressableLookup, HostReadLookup, LayerShard
from .settings import AUTO, ENGRAM_BLOCK, OffloadSettings, check_graph_mode, check_layout, open_store, parse_settings

__all__ = ["ENGRAM_MODULE", "SETTINGS_KEY", "TESTED_VERSIONS", "register", "settings_from_vllm", "stats"]

log = logging.getLogger("engram_offload.integrations.vllm")

TESTED_VERSIONS = ("0.33.0", "0.34.0")
ENGRAM_MODULE = "vllm.models.deepseek_v41.common.engram"
SETTINGS_KEY = "engram_offload"  # in --additional-config
CHECKED_ROWS = 8  # checkpoint rows compared with the table's, per tensor and rank
GRAPH_FIX = ("start vLLM with --enforce-eager, or with -cc.cudagraph_mode=PIECEWISE (with vLLM's breakable CUDA "
             "graphs, on by itself for DeepSeek-V4.1: leave VLLM_USE_BREAKABLE_CUDAGRAPH unset)")

_PATCHED = "_engram_offload_patched"
_lock = threading.Lock()
_stores: dict[tuple[Any, ...], tuple[RowStore, Any]] = {}  # one store per process and column shard
_tables: dict[tuple[Any, ...], DeviceTable] = {}  # one device view of each resident store
_modules: list[Any] = []  # every OffloadedEngramEmbedding built in this process


# ---------------------------------------------------------------------- the entry point
def register() -> None:
    """vLLM's ``general_plugins`` hook: patch ``Engram`` when vLLM's Engram module loads.

    Any vLLM version is patched (the patch calls vLLM's own methods unless ``engram_offload``
    settings are given); the version is judged when settings are (``check_engine``)."""
    if _vllm_version() is None:
        log.warning("engram-offload: vLLM is not installed; the plugin does nothing")
        return
    module = sys.modules.get(ENGRAM_MODULE)
    if module is not None:
        patch(module)
        return
    with _lock:
        if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _PatchOnImport())


def _vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_engine(settings: OffloadSettings) -> None:
    """Refuse an untested vLLM when settings are given, unless ``allow_untested_engine`` (then warn
    once); the seams were checked when the module was patched."""
    version = _vllm_version()
    if version in TESTED_VERSIONS:
        return
    tested = ", ".join(TESTED_VERSIONS)
    if not settings.allow_untested_engine:
        raise ValueError(f"engram-offload was tested with vLLM {tested}, not {version}: install one of those, or "
                         'add "allow_untested_engine": true to the engram_offload settings to run it anyway '
                         "(every vLLM name the plugin uses is there)")
    if not _warned_untested:
        _warned_untested.append(version)
        log.warning("engram-offload: running on vLLM %s, which it was not tested with (%s), because "
                    "allow_untested_engine is set; every vLLM name it uses is there", version, tested)


_warned_untested: list[str | None] = []


def missing_names(engram: ModuleType) -> list[str]:
    """The vLLM names the plugin uses that ``engram`` (vLLM's Engram module) and vLLM lack."""
    missing = []
    cls = getattr(engram, "Engram", None)
    for name in ("_create_embedding", "_finish_prefetch"):
        if not callable(getattr(cls, name, None)):
            missing.append(f"Engram.{name}")
    if cls is not None and not hasattr(getattr(cls, "_finish_prefetch", None), "__wrapped__"):
        missing.append("Engram._finish_prefetch's eager_break_during_capture")
    if not isinstance(getattr(engram, "ParallelEngramEmbedding", None), type):
        missing.append("ParallelEngramEmbedding")
    for module, names in (("vllm.compilation.breakable_cudagraph", ("eager_break_during_capture",)),
                          ("vllm.config", ("get_current_vllm_config",)),
                          ("vllm.distributed", ("get_tensor_model_parallel_rank",
                                                "get_tensor_model_parallel_world_size"))):
        try:
            found = importlib.import_module(module)
        except ImportError:
            missing.extend(f"{module}.{n}" for n in names)
            continue
        missing.extend(f"{module}.{n}" for n in names if not hasattr(found, n))
    return missing


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches vLLM's Engram module right after it is executed (so ``register`` stays light)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != ENGRAM_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                original_exec = loader.exec_module

                def exec_module(module: ModuleType, _exec: Any = original_exec) -> None:
                    _exec(module)
                    patch(module)

                loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


def patch(engram: ModuleType) -> None:
    """Replace ``Engram._create_embedding`` and ``Engram._finish_prefetch`` (once); a vLLM that
    lacks a name the plugin uses is left alone, with an error line naming it."""
    with _lock:
        cls = getattr(engram, "Engram", None)
        if getattr(cls, _PATCHED, False):
            return
        missing = missing_names(engram)
        if missing:
            _refuse_settings(cls, missing)
            return
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture

        assert cls is not None
        create, finish = cls._create_embedding, cls._finish_prefetch
        finish_body = finish.__wrapped__  # under vLLM's capture decorator

        def _create_embedding(self: Any, layout: Any, layer_hash_index: int) -> Any:
            settings = settings_from_vllm()
            if settings is None:
                return create(self, layout, layer_hash_index)
            check_engine(settings)
            return build_embedding(engram, layout, layer_hash_index, settings)

        def _finish_prefetch(self: Any, event: Any) -> None:
            finish_body(self, event)
            finish_lookup = getattr(self.embed_tokens, "finish_lookup", None)
            if finish_lookup is not None:
                finish_lookup()

        _create_embedding.__doc__ = create.__doc__
        cls._create_embedding = _create_embedding
        cls._finish_prefetch = eager_break_during_capture(_finish_prefetch)
        setattr(cls, _PATCHED, True)


def _refuse_settings(cls: Any, missing: list[str]) -> None:
    """A vLLM without a name the plugin uses: vLLM's own table, and start-up stopped in one line
    where ``engram_offload`` settings are given (when ``_create_embedding`` is there to say it)."""
    names = ", ".join(missing)
    log.error("engram-offload: vLLM %s lacks %s, which the plugin uses: it cannot serve the Engram table",
              _vllm_version(), names)
    create = getattr(cls, "_create_embedding", None)
    if not callable(create) or "vllm.config.get_current_vllm_config" in missing:  # no way to see the settings
        return

    def _create_embedding(self: Any, layout: Any, layer_hash_index: int) -> Any:
        if settings_from_vllm() is not None:
            raise ValueError(f"engram_offload settings are given but vLLM {_vllm_version()} lacks {names}, which "
                             f"the plugin uses: install vLLM {' or '.join(TESTED_VERSIONS)}, or drop the settings")
        return create(self, layout, layer_hash_index)

    cls._create_embedding = _create_embedding
    setattr(cls, _PATCHED, True)


# ---------------------------------------------------------------------- settings
def settings_from_vllm() -> OffloadSettings | None:
    """The plugin's settings from the current vLLM config's ``additional_config`` (None: inert)."""
    from vllm.config import get_current_vllm_config

    extra = getattr(get_current_vllm_config(), "additional_config", None)
    if not isinstance(extra, dict) or SETTINGS_KEY not in extra:
        return None
    return parse_settings(extra[SETTINGS_KEY])


def _full_graphs() -> bool:
    """Whether vLLM will replay FULL CUDA graphs (``enforce_eager`` turns graphs off). Piecewise
    graphs run ``_finish_prefetch`` eagerly between them through vLLM's breakable graphs, which
    vLLM turns on for DeepSeek-V4.1 by itself (without them it runs V4.1 with no graphs)."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    model = getattr(config, "model_config", None)
    if model is not None and getattr(model, "enforce_eager", False):
        return False
    extra = getattr(config, "additional_config", None) or {}
    if isinstance(extra, dict) and extra.get("decode_backend") == "latency_specialized":
        return True  # specialized decode replays FULL graphs and reads the staged rows itself
    mode = getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None)
    return bool(mode is not None and mode.has_full_cudagraphs())


# ---------------------------------------------------------------------- the module
def build_embedding(engram: ModuleType, layout: Any, layer_hash_index: int, settings: OffloadSettings) -> Any:
    """An ``OffloadedEngramEmbedding`` for one Engram layer of this rank (after the checks)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    device = torch.get_default_device()
    # host reads break FULL graphs unless the GPU itself waits for them (stream memory operations)
    graphs_refuse = _full_graphs() and not stream_ops.supported(device)
    settings = _resolved(settings, world, graphs_refuse)
    layer_ids = tuple(int(i) for i in layout.layer_ids)
    layer_id = layer_ids[layer_hash_index]
    check_graph_mode(settings, graphs_refuse, GRAPH_FIX, layer_id)
    store, config = _store(settings, layout, rank, world)
    shard = LayerShard.of(config, layer_id, rank, world)
    tier, on_host = settings.tier_of(layer_id), settings.reads_on_host(layer_id)
    describe = f"{settings.table} on {settings.row_server or tier}"
    backend: AddressableLookup | HostReadLookup
    found = None if on_host else _device_table(settings, rank, world, store, layer_id, device)
    if found is not None:
        table, first = found
        backend = AddressableLookup(shard, store, table, config, first_row=first, describe=describe,
                                    log_every=settings.log_every)
        how = "read by the GPU in place"
    else:
        if not on_host:  # e.g. a read-only segment the device cannot register
            why = (f"this GPU cannot read the {tier} tier's rows in place (read-only host memory it "
                   "cannot register, or no coherent UVA)")
            if graphs_refuse:
                raise ValueError(f"{why}: they would be staged on the host, which a FULL CUDA graph cannot "
                                 f"replay: {GRAPH_FIX}, or use the pinned tier")
        backend = _host_read_backend(settings, shard, store, config, device, describe)
        waits = "the GPU waits for them in its stream" if backend.in_graph else "the CPU waits for them"
        how = f"read on the host, {waits}" + ("" if on_host else f" (staged: {why})")
    module = _embedding_class(engram)._build(layout, layer_hash_index, shard, store, backend, device, world)
    _modules.append(module)
    log.info("engram-offload: Engram layer %d of rank %d/%d on %s (%s backend, %s; columns [%d, %d) of %d)",
             layer_id, rank, world, describe, backend.kind, how, shard.c0, shard.c1, shard.num_columns)
    return module


def _resolved(settings: OffloadSettings, world: int, full_graphs: bool) -> OffloadSettings:
    """``settings`` with ``tier: "auto"`` resolved once a process (``auto.resolve_tier``), the choice logged."""
    if settings.tier != AUTO:
        return settings
    key = (settings.store_key(), world, full_graphs)
    with _lock:
        chosen = _resolutions.get(key)
        if chosen is None:
            from vllm.config import get_current_vllm_config

            parallel = getattr(get_current_vllm_config(), "parallel_config", None)
            replicas = int(getattr(parallel, "data_parallel_size_local", None)
                           or getattr(parallel, "data_parallel_size", 1) or 1)
            resolved, why = resolve_tier(settings, world, replicas=replicas,
                                         graphs_fix=GRAPH_FIX if full_graphs else None)
            chosen = _resolutions[key] = (resolved.tier, resolved.cache_bytes)
            log.info("engram-offload: %s (%s)", why, settings.table)
    return dataclasses.replace(settings, tier=chosen[0], cache_bytes=chosen[1])


_resolutions: dict[tuple[Any, ...], tuple[str, int | None]] = {}  # tier auto's choice, once a process


def _host_read_backend(settings: OffloadSettings, shard: LayerShard, store: RowStore, config: EngramConfig,
                       device: torch.device, describe: str) -> HostReadLookup:
    """A layer's host-read lookup, its pinned staging sized from vLLM's step and ``staging_bytes``."""
    from vllm.config import get_current_vllm_config

    max_tokens = int(get_current_vllm_config().scheduler_config.max_num_batched_tokens)
    slot_bytes = max_tokens * shard.part * config.row_bytes
    slots = 2
    if settings.staging_bytes is not None:
        if settings.staging_bytes < slot_bytes:
            raise ValueError(f"staging_bytes {settings.staging_bytes} holds less than one step's rows of layer "
                             f"{shard.layer_id} ({slot_bytes} bytes at {max_tokens} tokens): raise it")
        slots = max(1, min(4, settings.staging_bytes // slot_bytes))
    return HostReadLookup(shard, store, config, max_tokens=max_tokens, device=device, sync=make_sync(device),
                          slots=slots, timeout_s=settings.wait_timeout_s, describe=describe,
                          log_every=settings.log_every)


def _store(settings: OffloadSettings, layout: Any, rank: int, world: int) -> tuple[RowStore, EngramConfig]:
    """This process's store for the settings and the rank's columns, checked against the layout."""
    key = (settings.store_key(), rank, world)
    with _lock:
        found = _stores.get(key)
        if found is not None:
            return found
        columns = column_range((int(layout.max_ngram_size) - 1) * int(layout.n_heads), rank, world)

        def check(config: EngramConfig) -> None:
            check_layout(config, settings.table, layer_ids=layout.layer_ids, head_dim=int(layout.head_dim),
                         primes=layout.primes, num_embeddings=layout.num_embeddings)

        local_file = settings.row_server is None and not settings.table.startswith("redis://")
        if local_file:
            check(read_header(settings.table).config)  # before a resident tier loads the table
        store = open_store(settings, columns)  # the caches hold this rank's rows only
        try:
            if not local_file:
                check(store.config)
        except BaseException:
            store.close()
            raise
        _stores[key] = (store, store.config)
        return store, store.config


def _device_table(settings: OffloadSettings, rank: int, world: int, store: RowStore, layer_id: int,
                  device: torch.device) -> tuple[DeviceTable, int] | None:
    """The host rows holding ``layer_id``'s rows as the device reads them in place, and the
    flat table row of their row 0: one registration for every layer those rows hold. None
    where the device cannot read them in place (the rows are then staged)."""
    found = store.in_place_rows(layer_id)
    if found is None or not device_reads_in_place(found[0], device):
        return None
    rows, first = found
    key = (settings.store_key(), rank, world, rows.data_ptr())
    with _lock:
        table = _tables.get(key)
        if table is None:
            table = _tables[key] = DeviceTable(rows, device)
        return table, first


_classes: dict[int, type] = {}


def _embedding_class(engram: ModuleType) -> Any:
    """``OffloadedEngramEmbedding``, a subclass of this vLLM's ``ParallelEngramEmbedding``."""
    found = _classes.get(id(engram))
    if found is not None:
        return found
    base = engram.ParallelEngramEmbedding

    class OffloadedEngramEmbedding(base):  # type: ignore[misc, valid-type]
        """One Engram layer's rows from an engram-offload store (built by ``_build``, not ``__init__``)."""

        @classmethod
        def _build(cls, layout: Any, layer_hash_index: int, shard: LayerShard, store: RowStore,
                   backend: AddressableLookup | HostReadLookup, device: torch.device, world: int) -> Any:
            m = cls.__new__(cls)
            torch.nn.Module.__init__(m)
            heads = tuple(int(p) for order in layout.primes[layer_hash_index] for p in order)
            m.num_embeddings = int(layout.num_embeddings[layer_hash_index])
            m.dim, m.block_size = int(layout.head_dim), ENGRAM_BLOCK
            m.n_hash_cols, m.part_n_hash_cols, m.head_start = len(heads), shard.part, shard.c0
            m.tp_size, m.dp_size = world, 1
            m.vocab_start_idx, m.vocab_end_idx = shard.vocab_start, shard.vocab_end
            m.part_num_embeddings = shard.vocab_end - shard.vocab_start
            m.cpu_offload = device.type == "cuda"  # vLLM's side stream and event for the lookup
            m.dp_shared_memory, m.use_thp, m.peer_rows = False, False, 0
            m._views = m._view_src = None
            m._num_sms = 1
            m.engram_offload = backend
            m.engram_shard = shard
            scale_dim = m.dim // ENGRAM_BLOCK
            m.weight = torch.nn.Parameter(torch.empty(0, m.dim, dtype=torch.float8_e4m3fn, device="cpu"),
                                          requires_grad=False)
            m.weight_scale_inv = torch.nn.Parameter(torch.empty(0, scale_dim, dtype=torch.uint8, device="cpu"),
                                                    requires_grad=False)
            for param, values in ((m.weight, True), (m.weight_scale_inv, False)):
                param.weight_loader = _checking_loader(store, shard, int(layout.head_dim), values)
                param.engram_vocab_start = shard.vocab_start
            return m

        def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
            self.engram_offload.lookup(indices, out, background)

        def finish_lookup(self) -> None:
            """Called by the patched ``Engram._finish_prefetch`` before the rows are read."""
            self.engram_offload.finish()

        def collapse_huge_pages(self) -> None:
            """No vLLM-owned table pages to collapse."""

        def _storage(self) -> tuple[torch.Tensor, torch.Tensor]:
            raise RuntimeError("an engram-offload Engram table has no vLLM storage: its rows come from lookup()")

        def stats(self) -> dict[str, Any]:
            return self.engram_offload.stats()

    _classes[id(engram)] = OffloadedEngramEmbedding
    return OffloadedEngramEmbedding


def _checking_loader(store: RowStore, shard: LayerShard, head_dim: int, values: bool) -> Any:
    """A weight loader that compares ``CHECKED_ROWS`` of the checkpoint's rows in the rank's range
    with the table's and keeps nothing (``values``: the fp8 values, else the ue8m0 scales)."""

    def load(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
        rows = shard.vocab_end - shard.vocab_start
        if rows <= 0:
            return
        local = np.unique(np.linspace(shard.vocab_start, shard.vocab_end - 1, CHECKED_ROWS).astype(np.int64))
        theirs = loaded_weight.index_select(0, torch.from_numpy(local)).contiguous().view(torch.uint8)
        table = store.read_raw(local + shard.row_base)  # [k, row_bytes]
        ours = table[:, :head_dim] if values else table[:, head_dim:]
        if not torch.equal(ours.to(theirs.device), theirs.reshape(ours.shape)):
            bad = int(local[(ours.to(theirs.device) != theirs.reshape(ours.shape)).any(1).nonzero()[0, 0]])
            raise ValueError(f"the Engram table does not hold this checkpoint's rows (layer {shard.layer_id}, row "
                             f"{bad} of its {'values' if values else 'scales'} differs): convert this checkpoint's "
                             "table with `engram-offload convert CHECKPOINT TABLE`")

    return load


def stats() -> list[dict[str, Any]]:
    """Every offloaded Engram layer's counters in this process (tier, lookups, hit rate, stall)."""
    return [m.stats() for m in _modules]


