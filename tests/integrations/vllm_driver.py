"""Drives vLLM's own Engram code (0.33.0 or 0.34.0) on a CPU through the installed engram-offload plugin.

Run by ``test_vllm_engine.py`` in a subprocess, with ``CUDA_VISIBLE_DEVICES=""`` (else vLLM
swaps Triton for placeholders when no GPU driver is active) and ``TRITON_INTERPRET=1`` (vLLM's
Triton kernels then run on CPU tensors), both set before vLLM is imported. Prints one JSON
object on its last line: each check's name -> its result.

    python vllm_driver.py checks SPEC.json    # one rank: plugin loading, names, hasher, tiers
    python vllm_driver.py rank SPEC.json      # one rank of a gloo group (SPEC has rank, world)

SPEC: {"table", "other_table", "socket", "server_tier", "port", "rank", "world", "tokens", "pool_table"}.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import traceback
import types
from contextlib import contextmanager

import numpy as np
import torch

ENGRAM = "vllm.models.deepseek_v41.common.engram"
results: dict = {}


@contextmanager
def logged(name):
    """The messages logged at INFO or above by the logger ``name`` itself (not its children)."""
    lines, logger = [], logging.getLogger(name)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: lines.append(r.getMessage()) if r.name == name else None
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def record(name, fn):
    try:
        results[name] = fn()
    except Exception as exc:  # the test names the check that failed and why
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}


def load_plugin():
    before = ENGRAM in sys.modules
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.models.deepseek_v41.common import engram as E

    return {"imported_before": before, "patched": bool(getattr(E.Engram, "_engram_offload_patched", False)),
            "plugins": sorted(ep.name for ep in __import__("importlib.metadata").metadata.entry_points(
                group="vllm.general_plugins"))}


def init_group(rank, world, port):
    from vllm.config import DeviceConfig, EngramConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    cfg.engram_config = EngramConfig(cpu_offload=False)
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(world, 1)


def vllm_config(additional, full_graphs=False, eager=None):
    from vllm.config import DeviceConfig, EngramConfig, VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), additional_config=additional)
    cfg.engram_config = EngramConfig(cpu_offload=False)
    cfg.scheduler_config.max_num_batched_tokens = 64
    if full_graphs:
        cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    if eager is not None:  # a ModelConfig needs a model to read: only the flag the plugin reads
        cfg.model_config = types.SimpleNamespace(enforce_eager=eager)
    return cfg


def test_layout(E, config):
    """vLLM's EngramLayout for the table's config (as vLLM reads it from the checkpoint's config)."""
    ns = types.SimpleNamespace(
        engram_layer_ids=list(config.layer_ids), engram_num_embeddings=[config.rows_per_layer[i] for i in config.layer_ids],
        engram_max_ngram_size=config.max_ngram_size, engram_n_heads=config.n_heads, engram_head_dim=config.head_dim,
        engram_compressed_vocab_size=config.compressed_vocab_size or 150, engram_pad_token_id=config.pad_id,
        engram_vocab_size=config.prime_starts[0])
    return E.EngramLayout(ns)


def build_engram(E, layout, index, additional, full_graphs=False, eager=None):
    from vllm.config import set_current_vllm_config

    hf = types.SimpleNamespace(hidden_size=64, hc_mult=2, rms_norm_eps=1e-6)
    with set_current_vllm_config(vllm_config(additional, full_graphs, eager)):
        torch.set_default_dtype(torch.bfloat16)
        try:
            return E.Engram(hf, None, layout, index, False, f"model.layers.{layout.layer_ids[index]}.engram")
        finally:
            torch.set_default_dtype(torch.float32)


def vllm_table(E, layout, index, raw, base):
    """vLLM's own ParallelEngramEmbedding of this rank (its constructor, its loader, its kernel);
    a CPU has no SM count to ask, so that one query answers 4."""
    heads = tuple(p for order in layout.primes[index] for p in order)
    real = torch.cuda.get_device_properties, torch.accelerator.current_device_index
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=4)
    torch.accelerator.current_device_index = lambda: 0
    try:
        m = E.ParallelEngramEmbedding(layout.num_embeddings[index], layout.head_dim, heads, cpu_offload=False)
    finally:
        torch.cuda.get_device_properties, torch.accelerator.current_device_index = real
    rows = layout.num_embeddings[index]
    layer = torch.from_numpy(raw[base:base + rows].copy())  # the checkpoint's two tensors of the layer
    m.weight.weight_loader(m.weight, layer[:, :256].contiguous().view(torch.float8_e4m3fn))
    m.weight_scale_inv.weight_loader(m.weight_scale_inv, layer[:, 256:].contiguous().view(torch.float8_e8m0fnu))
    return m


def step_ids(layout, index, tokens, seed):
    """Layer-local ids [T, C], a strided view, with -1 and ids outside the layer."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray([p for order in layout.primes[index] for p in order])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ids = offsets + (rng.random((tokens, sizes.size)) * sizes).astype(np.int64)
    ids[0, 0], ids[-1, -1] = -1, int(sizes.sum()) + 3
    ids[1, :2] = (3, 5)  # rows with scale bytes 0 and 255
    both = torch.from_numpy(np.stack([ids, ids[::-1]], axis=1).astype(np.int32))  # [T, 2, C]
    return both[:, 0]


def bits_equal(a, b):
    if a.dtype == torch.uint8:
        return bool(torch.equal(a, b))
    nan = torch.isnan(a.float())
    return bool(torch.equal(nan, torch.isnan(b.float())) and torch.equal(a.view(torch.int16)[~nan],
                                                                        b.view(torch.int16)[~nan]))


def tier_settings(spec):
    tiers = {
        "memory": {"table": spec["table"], "tier": "memory"},
        "direct+cache": {"table": spec["table"], "tier": "direct", "cache_bytes": 40 * 264},
        "row_server": {"table": spec["table"], "tier": spec["server_tier"], "row_server": spec["socket"]},
        "layered": {"table": spec["table"], "tier": {"1": "memory", "14": "direct"}, "cache_bytes": 40 * 264},
    }
    if spec.get("pool_table"):  # where redis-server runs: the table's copy in a Redis pool
        tiers["pool"] = {"table": spec["pool_table"], "tier": "remote"}
    return tiers


# what vLLM's ParallelEngramEmbedding constructor sets and the plugin's module sets alike
SAME_AS_VLLM = ("num_embeddings", "part_num_embeddings", "dim", "block_size", "dp_shared_memory", "use_thp",
                "peer_rows", "cpu_offload")


def _plain(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


def compare_tiers(E, spec, layout, raw, config):
    """Per tier and layer: the real Engram built through the plugin, rows against vLLM's kernel."""
    import engram_offload.integrations.vllm as plugin
    from engram_offload.serving.layered import dram_bytes

    out = {}
    for tier, settings in tier_settings(spec).items():
        for index, layer_id in enumerate(layout.layer_ids):
            engram = build_engram(E, layout, index, {"engram_offload": settings})
            module = engram.embed_tokens
            oracle = vllm_table(E, layout, index, raw, config.layer_row_bases[index])
            ids = step_ids(layout, index, spec["tokens"], seed=index)
            t = ids.shape[0]
            engram.prepare_embeddings(ids)
            got = engram.staged_rows[:t].clone()
            want = torch.empty((t, oracle.part_n_hash_cols, 256), dtype=torch.bfloat16)
            oracle.lookup(ids, want)
            packed_got = torch.empty((t, oracle.part_n_hash_cols * 264), dtype=torch.uint8)
            packed_want = torch.full_like(packed_got, 0xAB)
            module.lookup(ids, packed_got)
            oracle.lookup(ids, packed_want)
            entry = {
                "class": type(module).__name__, "base": type(module).__mro__[1].__name__,
                "attrs": [module.part_n_hash_cols, module.head_start, module.vocab_start_idx, module.vocab_end_idx,
                          module.tp_size, module.dp_size, module.n_hash_cols],
                "vllm_attrs": [oracle.part_n_hash_cols, oracle.head_start, oracle.vocab_start_idx,
                               oracle.vocab_end_idx, oracle.tp_size, 1, oracle.n_hash_cols],
                "more_attrs": {a: _plain(getattr(module, a)) for a in SAME_AS_VLLM},
                "vllm_more_attrs": {a: _plain(getattr(oracle, a)) for a in SAME_AS_VLLM},
                "class_id": id(type(module)),  # one class for every layer
                "bf16_equal": bits_equal(got, want), "packed_equal": bits_equal(packed_got, packed_want),
                "nonzero_rows": int((want.abs().sum(-1) > 0).sum()),
                "params": sorted(n for n, _ in engram.named_parameters()),
            }
            keys, stats = ("layer", "backend", "table", "columns", "lookups", "rows"), module.stats()
            entry["stats"] = {k: stats[k] for k in keys}
            entry["in_plugin_stats"] = entry["stats"] in [{k: s[k] for k in keys} for s in plugin.stats()]
            store = module.engram_offload.store
            entry["store"] = id(store)  # one store for a tier's layers
            entry["device_table"] = id(getattr(module.engram_offload, "table", None))  # and one device view
            entry["store_columns"] = None if store.columns is None else list(store.columns)  # the rank's only
            entry["dram_bytes"] = dram_bytes(store)  # a resident tier: the rank's share of the rows
            entry["table_bytes"] = config.num_rows * config.row_bytes
            table = getattr(module.engram_offload, "table", None)
            entry["device_rows"] = None if table is None else table.num_rows
            entry["store_stats"] = bool(stats["store"])
            if module.tp_size == 1:
                entry["embed_equal"] = bits_equal(engram.embed(ids), want)
            out[f"{tier}/layer{layer_id}"] = entry
    return out


def names_pinned(E):
    """Every vLLM name the plugin touches, with the signature it relies on."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.config import VllmConfig, get_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    def params(fn):
        return list(inspect.signature(inspect.unwrap(fn)).parameters)

    fields = VllmConfig.__dataclass_fields__ if hasattr(VllmConfig, "__dataclass_fields__") else {}
    return {
        "Engram._create_embedding": params(E.Engram._create_embedding),
        "Engram._finish_prefetch": params(E.Engram._finish_prefetch),
        "Engram._finish_prefetch.wrapped": hasattr(E.Engram._finish_prefetch, "__wrapped__"),
        # the plugin's replacement, inside vLLM's own capture decorator
        "Engram._finish_prefetch.inner": E.Engram._finish_prefetch.__wrapped__.__qualname__,
        "Engram._init_staging": params(E.Engram._init_staging),
        "Engram.prepare_embeddings": params(E.Engram.prepare_embeddings),
        "Engram._start_prefetch": params(E.Engram._start_prefetch),
        "Engram._ready_rows": params(E.Engram._ready_rows),
        "Engram.embed": params(E.Engram.embed),
        "ParallelEngramEmbedding.lookup": params(E.ParallelEngramEmbedding.lookup),
        "ParallelEngramEmbedding.collapse_huge_pages": params(E.ParallelEngramEmbedding.collapse_huge_pages),
        "ParallelEngramEmbedding._storage": params(E.ParallelEngramEmbedding._storage),
        "ParallelEngramEmbedding._weight_loader": params(E.ParallelEngramEmbedding._weight_loader),
        "EngramLayout.__init__": params(E.EngramLayout.__init__),
        "VllmConfig.fields": sorted(set(fields) & {"additional_config", "scheduler_config", "compilation_config",
                                                   "model_config", "engram_config"}),
        "CUDAGraphMode.has_full_cudagraphs": [m.name for m in CUDAGraphMode if m.has_full_cudagraphs()],
        "get_current_vllm_config": callable(get_current_vllm_config),
        "tp_rank_and_size": callable(get_tensor_model_parallel_rank) and callable(get_tensor_model_parallel_world_size),
        "eager_break_during_capture": callable(eager_break_during_capture),
    }


def weights_mapper():
    """The checkpoint's names, through V4.1's weights mapper, land on the plugin's parameters."""
    from vllm.models.deepseek_v41.nvidia import model as nv

    names = ["layers.1.engram.embed.weight", "layers.1.engram.embed.scale"]
    return {dtype: [nv._make_deepseek_v4_weights_mapper(dtype)._map_name(n) for n in names]
            for dtype in ("fp4", "fp8")}


def hasher(E):
    """vLLM's NgramHashState (its Triton hash kernel) against engram-offload's NgramHasher on V4.1's layout."""
    from engram_offload.engram.config import EngramConfig
    from engram_offload.engram.hashing import NgramHasher

    config = EngramConfig.from_name("deepseek-v4.1-flash")
    layout = test_layout(E, config)
    vocab, compressed = 129_280, config.compressed_vocab_size
    token_map = (torch.arange(vocab, dtype=torch.int64) * 7919) % compressed
    token_map[:compressed] = torch.arange(compressed)  # every compressed id used: its size is the config's
    st = E.NgramHashState.__new__(E.NgramHashState)
    torch.nn.Module.__init__(st)
    st.layout, st.block_size, st.use_slot_cache, st._cache, st._kv_cache_ref = layout, 64, False, None, None  # 0.33.0's
    st.lookback_depth = layout.max_ngram_size - 1
    st.swa_cache_module = torch.nn.Module()
    st.swa_cache_module.kv_cache = torch.empty(4, 64, 1)
    st.token_map = token_map.to(torch.int32)
    st.multipliers = E.compute_hash_multipliers(layout.layer_ids, layout.max_ngram_size, compressed)
    st.primes = torch.tensor(layout.primes)
    st.offsets = layout.offsets
    st.pad_id = int(token_map[layout.pad_token_id])
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, vocab, 7), rng.integers(0, vocab, 5)]
    seqs[0][3] = config.image_token_id  # a dead token
    ids = torch.from_numpy(np.concatenate(seqs)).to(torch.int32)
    pos = torch.from_numpy(np.concatenate([np.arange(len(s)) for s in seqs])).to(torch.int64)
    qsl = torch.tensor([0, len(seqs[0]), len(seqs[0]) + len(seqs[1])], dtype=torch.int32)
    dead = ids == config.image_token_id
    look = torch.full((2, layout.max_ngram_size - 1), -1, dtype=torch.int32)
    # 0.33.0 also takes the V1 runner's slot cache (slot_mapping, block_table: None, unused); 0.34.0 has none
    slot_cache = [None] * (len(inspect.signature(st.forward).parameters) - 6)
    theirs = st(ids, pos, qsl, dead, look, torch.zeros_like(look, dtype=torch.bool), *slot_cache)  # [T, 2, 24]
    ours = NgramHasher(config, token_map.numpy())
    mine = torch.cat([ours.hash_all(torch.from_numpy(s)[None])[0] for s in seqs])  # [T, 2, 24]
    return {"layout_primes_equal": [list(map(list, layout.primes[i])) == [list(o) for o in config.primes[lid]]
                                    for i, lid in enumerate(config.layer_ids)],
            "shape": list(theirs.shape), "equal": bool(torch.equal(theirs.to(torch.int64), mine)),
            "dead_rows": int((theirs < 0).sum())}


def main():
    mode, spec = sys.argv[1], json.loads(open(sys.argv[2]).read())
    results["spec"] = spec
    from engram_offload.serving.store import open_table

    with open_table(spec["table"], "memory") as store:
        config, raw = store.config, store.tier.rows.numpy().copy()  # the rows, as the checkpoint holds them
    record("load", load_plugin)
    from vllm.models.deepseek_v41.common import engram as E

    init_group(spec["rank"], spec["world"], spec["port"])
    layout = test_layout(E, config)
    if mode == "checks":
        record("names", lambda: names_pinned(E))
        record("mapper", weights_mapper)
        record("hasher", lambda: hasher(E))

        def inert():
            try:
                build_engram(E, layout, 0, {})
            except Exception as exc:
                tb, built = exc.__traceback__, []
                while tb is not None:  # whose constructors ran before the error
                    owner = tb.tb_frame.f_locals.get("self")
                    if tb.tb_frame.f_code.co_name == "__init__" and owner is not None:
                        built.append(type(owner).__name__)
                    tb = tb.tb_next
                return {"constructors": built, "vllm_error": str(exc)[:200]}
            return {"constructors": [], "vllm_error": None}

        record("inert", inert)

        def graphs():
            out = {}
            for tier, settings in tier_settings(spec).items():
                try:
                    build_engram(E, layout, 0, {"engram_offload": settings}, full_graphs=True)
                    out[tier] = "built"
                except ValueError as exc:
                    out[tier] = str(exc)
            return out

        record("graphs", graphs)

        def loader():
            engram = build_engram(E, layout, 0, {"engram_offload": tier_settings(spec)["memory"]})
            module, rows = engram.embed_tokens, layout.num_embeddings[0]
            layer = torch.from_numpy(raw[:rows].copy())
            module.weight.weight_loader(module.weight, layer[:, :256].contiguous().view(torch.float8_e4m3fn))
            module.weight_scale_inv.weight_loader(module.weight_scale_inv,
                                                  layer[:, 256:].contiguous().view(torch.float8_e8m0fnu))
            other = layer.clone()
            other[:, :256] ^= 1  # another checkpoint's values (same layout)
            try:
                module.weight.weight_loader(module.weight, other[:, :256].contiguous().view(torch.float8_e4m3fn))
                refused = None
            except ValueError as exc:
                refused = str(exc)
            return {"own_rows_accepted": True, "other_rows_refused": refused,
                    "placeholder_shapes": [list(module.weight.shape), list(module.weight_scale_inv.shape)],
                    "placeholders": [[str(p.dtype), p.device.type, p.requires_grad]
                                     for p in (module.weight, module.weight_scale_inv)]}

        record("loader", loader)

        def wrong_table():
            try:
                build_engram(E, layout, 0, {"engram_offload": {"table": spec["other_table"], "tier": "memory"}})
            except ValueError as exc:
                return str(exc)
            return "built"

        record("wrong_table", wrong_table)

        def unknown_key():
            try:
                build_engram(E, layout, 0, {"engram_offload": {"table": spec["table"], "cache": 1}})
            except ValueError as exc:
                return str(exc)
            return "built"

        record("unknown_key", unknown_key)

        def plugin_paths():
            """Graph modes, staging sizes, the start-up line and the module's refusals."""
            import engram_offload.integrations.vllm as plugin

            direct = tier_settings(spec)["direct+cache"]

            def built(additional, full_graphs=False, eager=None, settings=direct):
                try:
                    return build_engram(E, layout, 0, {"engram_offload": settings, **additional}, full_graphs, eager)
                except ValueError as exc:
                    return str(exc)

            out = {"eager_under_full_graphs": type(built({}, full_graphs=True, eager=True)).__name__,
                   "not_eager_under_full_graphs": built({}, full_graphs=True, eager=False),
                   "specialized_decode": built({"decode_backend": "latency_specialized"}),
                   "other_decode": type(built({"decode_backend": "default"})).__name__}
            slot = 64 * 24 * config.row_bytes  # max_num_batched_tokens x the rank's columns x row bytes
            out["slot_bytes"] = slot
            for name, size in (("short", slot - 1), ("one", slot), ("three", 3 * slot + 5), ("many", 9 * slot)):
                engram = built({}, settings=dict(direct, staging_bytes=size))
                out[f"staging_{name}"] = engram if isinstance(engram, str) else len(engram.embed_tokens.engram_offload._ids)
            out["staging_default"] = len(built({}).embed_tokens.engram_offload._ids)
            with logged("engram_offload.integrations.vllm") as lines:
                module = build_engram(E, layout, 1, {"engram_offload": tier_settings(spec)["memory"]}).embed_tokens
                build_engram(E, layout, 0, {"engram_offload": tier_settings(spec)["row_server"]})
            out["started"] = lines
            try:
                module._storage()
                out["storage"] = None
            except RuntimeError as exc:
                out["storage"] = str(exc)
            out["collapse_huge_pages"] = module.collapse_huge_pages()
            out["stats_count"] = len(plugin.stats()) == len(plugin._modules) > 0
            # two resident stores of one process (the table in this process, and in shared memory):
            # each layer reads its own store's rows through its own device view
            views = {}
            for tier in ("memory", "shared"):
                backend = build_engram(E, layout, 0, {"engram_offload": {"table": spec["table"], "tier": tier}}
                                       ).embed_tokens.engram_offload
                views[tier] = backend.table.table.data_ptr() == backend.store.in_place_rows(layout.layer_ids[0])[0].data_ptr()
            out["device_views"] = views
            # a GPU that cannot read the shared segment in place (read-only memory it cannot register):
            # the rows are staged on the host, said at start-up, and refused under FULL graphs
            reads_in_place, plugin.device_reads_in_place = plugin.device_reads_in_place, lambda rows, device: False
            try:
                shared = {"table": spec["table"], "tier": "shared"}
                with logged("engram_offload.integrations.vllm") as lines:
                    backend = build_engram(E, layout, 1, {"engram_offload": shared}).embed_tokens.engram_offload
                out["staged"] = {"kind": backend.kind, "line": lines[-1],
                                 "full_graphs": built({}, full_graphs=True, eager=False, settings=shared)}
            finally:
                plugin.device_reads_in_place = reads_in_place
            # the patched _finish_prefetch, as a GPU layer calls it after a background lookup: vLLM's
            # own body waits on the event (a CPU has no stream: a stand-in records the wait), then the
            # host read's rows are copied in
            engram = built({})
            ids = step_ids(layout, 0, spec["tokens"], seed=7)
            rows = torch.zeros((ids.shape[0], engram.embed_tokens.part_n_hash_cols, 256), dtype=torch.bfloat16)
            engram.embed_tokens.lookup(ids, rows, background=True)
            out["rows_before_finish"] = int(rows.count_nonzero())
            waited, stream = [], torch.cuda.current_stream
            torch.cuda.current_stream = lambda *a, **k: types.SimpleNamespace(wait_event=waited.append)
            try:
                engram._finish_prefetch("the step's event")
            finally:
                torch.cuda.current_stream = stream
            rows = rows.clone()  # as _finish_prefetch left them (a later lookup finishes a pending one first)
            want = torch.empty_like(rows)
            engram.embed_tokens.lookup(ids, want)
            out["finish"] = {"waited": waited, "rows_equal": bits_equal(rows, want), "nonzero": int(rows.count_nonzero())}
            # log_every and wait_timeout_s reach each backend: a line a lookup, the read's bound
            with logged("engram_offload.integrations") as lines:  # lookup.py's
                for tier in ("memory", "direct+cache"):
                    engram = build_engram(E, layout, 1, {"engram_offload": dict(
                        tier_settings(spec)[tier], log_every=1, wait_timeout_s=0.5)})
                    ids = step_ids(layout, 1, spec["tokens"], seed=8)
                    rows = torch.empty((ids.shape[0], engram.embed_tokens.part_n_hash_cols, 256), dtype=torch.bfloat16)
                    engram.embed_tokens.lookup(ids, rows)
                    engram.embed_tokens.stats()  # an in-place tier logs here: no Python runs per graph replay
                    out[f"timeout_{tier}"] = getattr(engram.embed_tokens.engram_offload, "timeout_s", None)
            out["lookup_lines"] = [line.split(": ")[0] for line in lines]
            methods = E.Engram.__dict__["_create_embedding"], E.Engram.__dict__["_finish_prefetch"]
            plugin.patch(E)  # again, as when a second register() finds the module imported
            out["patched_once"] = methods == (E.Engram.__dict__["_create_embedding"], E.Engram.__dict__["_finish_prefetch"])
            return out

        record("plugin", plugin_paths)

        def untested():
            """An untested vLLM version (as the plugin sees it): settings refused, or run when allowed."""
            import engram_offload.integrations.vllm as plugin

            saved, plugin.TESTED_VERSIONS = plugin.TESTED_VERSIONS, ("0.0.0",)
            memory = tier_settings(spec)["memory"]
            try:
                try:
                    build_engram(E, layout, 0, {"engram_offload": memory})
                    out = {"refused": None}
                except ValueError as exc:
                    out = {"refused": str(exc)}
                with logged("engram_offload.integrations.vllm") as lines:
                    built = build_engram(E, layout, 0, {"engram_offload": dict(memory, allow_untested_engine=True)})
                out["allowed"] = type(built.embed_tokens).__name__
                out["warned"] = [line for line in lines if "not tested" in line]
            finally:
                plugin.TESTED_VERSIONS = saved
            return out

        record("untested", untested)
    record("tiers", lambda: compare_tiers(E, spec, layout, raw, config))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
