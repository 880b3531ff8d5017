"""Row caches, dedup and the prefetcher on a real-text trace over a table file.

    python benchmarks/bench_cache.py --table /tmp/t.table [--tokens 300000] [--out benchmarks/results/cache.json]

The trace: CPython's standard library, tokenized with DeepSeek's tokenizer, decoded
``--batch`` sequences at a time and hashed with the table's layout (make the table with
``engram-offload make-table --preset deepseek-v4.1-flash --scale 0.011``, 2.15 GiB).

Reported:
1. hit rate per policy with a DRAM cache of ``--cache-fraction`` of the table (cache
   bookkeeping replayed over the whole trace; the LRU figure is cross-checked against the
   planner's miss-ratio curve of the same deduplicated trace);
2. rows/s over the trace's last steps: direct tier + DRAM cache vs the memory tier
   (the cache is warmed over the earlier steps with bytes read from the memory tier, which
   holds the same bytes, so warming does not take minutes of random disk reads);
3. the cost of dedup plus a 100%-hit cache lookup per step, relative to a raw gather from
   the memory tier;
4. stall per step with a small real transformer (Engram at the table's layer ids): the
   prefetch starts at forward entry, vs gathering synchronously at each Engram layer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from engram_offload import open_table
from engram_offload.backbone import EngramBackbone
from engram_offload.cache import CachedStore, RowCache, build_levels
from engram_offload.cache.report import format_stats_table
from engram_offload.dedup import dedup
from engram_offload.hashing import NgramHasher
from engram_offload.machine import machine_facts
from engram_offload.prefetch import Prefetcher
from engram_offload.tokenizer import cached_token_map
from engram_offload.trace import serving_steps, stdlib_token_sequences
from engram_offload.wiring import forward_with_prefetch, forward_with_store

POLICIES = [("lru", False), ("lru", True), ("lfu", False), ("lfu", True)]


def replay_hit_rate(steps: list[np.ndarray], capacity_rows: int, policy: str, admission: bool) -> dict:
    """Cache bookkeeping only (1-byte rows): hits / unique rows per step, over the trace."""
    cache = RowCache(capacity_rows, 1, policy, admission=admission)
    hits = unique = 0
    t0 = time.perf_counter()
    for ids in steps:
        u = dedup(ids).unique
        slots = cache.acquire(u)
        hit = slots >= 0
        hits += int(hit.sum())
        unique += u.size
        cache.release(slots[hit])
        new = cache.reserve(u[~hit])
        cache.publish(new[new >= 0])
    return {"policy": policy, "admission": admission, "hit_rate": hits / unique, "unique_rows": unique,
            "evictions": cache.evictions, "rejected": cache.rejected, "replay_s": time.perf_counter() - t0}


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", required=True)
    ap.add_argument("--tokens", type=int, default=300_000, help="trace length in tokens")
    ap.add_argument("--batch", type=int, default=32, help="sequences decoded together")
    ap.add_argument("--cache-fraction", type=float, default=0.10)
    ap.add_argument("--measure-steps", type=int, default=200, help="steps timed on the direct tier")
    ap.add_argument("--stall-steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=512, help="backbone width for the stall figure")
    ap.add_argument("--out", default="benchmarks/results/cache.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result: dict = {"machine": machine_facts(args.table), "args": vars(args)}

    with open_table(args.table, "mmap") as probe:
        config = probe.config
        table_bytes = probe.num_rows * probe.row_bytes
    capacity_rows = int(args.cache_fraction * config.num_rows)
    cache_bytes = capacity_rows * config.row_bytes
    print(f"table {args.table}: {config.num_rows:,} rows x {config.row_bytes} B = {table_bytes / 2**30:.2f} GiB; "
          f"DRAM cache {cache_bytes / 2**20:,.0f} MiB ({capacity_rows:,} rows)")

    # ---- the trace
    t0 = time.perf_counter()
    token_map = cached_token_map()
    seqs = stdlib_token_sequences(args.tokens)
    steps = list(serving_steps(config, token_map, seqs, batch=args.batch, chunk=1))
    flat = [s.reshape(-1) for s in steps]
    requested = sum(s.size for s in flat)
    unique_per_step = sum(dedup(s).unique.size for s in flat)
    result["trace"] = {"tokens": int(sum(s.size for s in seqs)), "files": len(seqs), "steps": len(steps),
                       "rows_requested": requested, "rows_unique_per_step": unique_per_step,
                       "dedup_ratio": unique_per_step / requested,
                       "distinct_rows": int(np.unique(np.concatenate(flat)).size),
                       "build_s": time.perf_counter() - t0}
    print(f"trace: {result['trace']}")

    # ---- 1. hit rate per policy
    rates = []
    for policy, admission in POLICIES:
        r = replay_hit_rate(flat, capacity_rows, policy, admission)
        rates.append(r)
        print(f"  {policy:4s} admission={admission!s:5s} hit rate {r['hit_rate']:.4f} ({r['replay_s']:.1f} s)")
    try:
        from engram_offload.planner.mrc import mrc_from_trace

        mrc = mrc_from_trace(np.concatenate([dedup(s).unique for s in flat]))
        result["lru_mrc_hit_rate"] = float(mrc.hit_ratio(capacity_rows))
        print(f"  planner MRC (LRU, same trace): {result['lru_mrc_hit_rate']:.4f}")
    except Exception as exc:  # the cross-check is optional
        result["lru_mrc_error"] = repr(exc)
    result["hit_rates"] = rates
    best = max(rates, key=lambda r: r["hit_rate"])
    result["chosen_policy"] = {"policy": best["policy"], "admission": best["admission"]}

    # ---- 2. rows/s: direct + cache vs memory
    measured = flat[-args.measure_steps:]
    warm = flat[: len(flat) - len(measured)]
    mem = open_table(args.table, "memory")
    direct = open_table(args.table, "direct")
    levels = build_levels(config.row_bytes, cache_bytes, best["policy"], admission=best["admission"])
    cached = CachedStore(mem.tier, config, levels, inner=direct)
    for ids in warm:
        cached.fetch(dedup(ids).unique, hold=False)
    cached.source = direct.tier
    cached.reset_stats()
    t0 = time.perf_counter()
    for ids in measured:
        cached.gather(ids, torch.bfloat16)
    t_cached = time.perf_counter() - t0
    rows = sum(s.size for s in measured)
    t0 = time.perf_counter()
    for ids in measured:
        mem.gather(ids, torch.bfloat16)
    t_mem = time.perf_counter() - t0
    t0 = time.perf_counter()
    for ids in measured[:20]:
        direct.gather(ids, torch.bfloat16)
    t_direct = (time.perf_counter() - t0) / 20 * len(measured)
    result["throughput"] = {
        "steps": len(measured), "rows_requested": rows,
        "direct_cached_rows_per_s": rows / t_cached, "memory_rows_per_s": rows / t_mem,
        "direct_uncached_rows_per_s": rows / t_direct,
        "cached_hit_rate": cached.stats()["store"]["hit_rate"],
        "stats": cached.stats(),
    }
    print(format_stats_table(cached.stats(), title="direct + DRAM cache, measured steps"))
    print(f"rows/s: direct+cache {rows / t_cached:,.0f}, memory {rows / t_mem:,.0f}, "
          f"direct uncached {rows / t_direct:,.0f}")

    # ---- 3. overhead of dedup + 100%-hit lookup vs a raw gather
    over = {}
    for name, ids in (("decode_step", flat[len(flat) // 2]),
                      ("prefill_chunk", np.concatenate(flat[len(flat) // 2: len(flat) // 2 + 64]))):
        big = CachedStore(mem.tier, config, [RowCache((dedup(ids).unique.size + 64) * config.row_bytes,
                                                      config.row_bytes, best["policy"])])
        big.gather(ids)  # fill: every later lookup hits
        t_dedup = timed(lambda: dedup(ids), 20)
        u = dedup(ids).unique
        t_lookup = timed(lambda: big.fetch(u, hold=False), 20)
        t_raw = timed(lambda: mem.gather(ids, torch.bfloat16), 20)
        t_cached_gather = timed(lambda: big.gather(ids, torch.bfloat16), 20)
        over[name] = {"ids": int(ids.size), "unique": int(u.size), "dedup_ms": t_dedup * 1e3,
                      "hit_lookup_ms": t_lookup * 1e3, "raw_gather_ms": t_raw * 1e3,
                      "cached_gather_ms": t_cached_gather * 1e3,
                      "overhead_vs_raw": (t_dedup + t_lookup) / t_raw}
        print(f"{name}: {over[name]}")
    result["overhead"] = over

    # ---- 4. stall per step with a small transformer
    bconfig = config.replace(hidden_size=args.hidden, name=None)
    torch.manual_seed(0)
    model = EngramBackbone(bconfig, num_layers=max(config.layer_ids) + 2, vocab_size=token_map.size, heads=8).eval()
    hasher = NgramHasher(config, token_map)
    stall = {}
    tokens = [s for s in seqs if s.size >= args.stall_steps][: args.batch]
    batch_tokens = np.stack([s[: args.stall_steps] for s in tokens])  # [B, steps]
    for name, store in (("direct+cache", cached), ("memory", mem)):
        store_stall, compute = [], []
        with Prefetcher(store, hasher, dtype=torch.float32) as pf, torch.no_grad():
            for t in range(args.stall_steps):
                t0 = time.perf_counter()
                res = forward_with_prefetch(model, pf, list(range(len(tokens))), list(batch_tokens[:, t]))
                compute.append(time.perf_counter() - t0)
                store_stall.append(res.stall_seconds)
        stall[name] = {"stall_ms_p50": statistics.median(store_stall) * 1e3,
                       "stall_ms_mean": statistics.fmean(store_stall) * 1e3,
                       "step_ms_p50": statistics.median(compute) * 1e3}
        print(f"stall {name}: {stall[name]}")
    # baseline: no prefetch, gather at each Engram layer (whole prefix rehashed: time only the gather part)
    with torch.no_grad():
        ids = torch.from_numpy(batch_tokens[:, :1])
        t_sync = timed(lambda: forward_with_store(model, cached, hasher, ids, torch.float32), 5)
        t_model = timed(lambda: model(ids, lambda layer: torch.zeros(ids.shape[0], 1, config.cols_per_layer,
                                                                    config.head_dim)), 5)
    stall["synchronous_gather_step_ms"] = t_sync * 1e3
    stall["model_only_step_ms"] = t_model * 1e3
    stall["layers_before_first_engram"] = min(config.layer_ids)
    stall["backbone"] = {"layers": max(config.layer_ids) + 2, "hidden": args.hidden, "batch": len(tokens)}
    print(f"stall baseline: {stall}")
    result["stall"] = stall
    cached.close()
    mem.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
