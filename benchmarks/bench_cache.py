"""Row caches, dedup and the prefetcher on a real-text trace over a table file.

    python benchmarks/bench_cache.py --table /tmp/t.table [--tokens 300000] [--out benchmarks/results/cache.json]

The trace: CPython's standard library, tokenized with DeepSeek's tokenizer, cut into
requests of at most ``--max-seq-tokens`` tokens, decoded ``--batch`` requests at a time and
hashed with the table's layout (make the table with ``engram-offload make-table --preset
deepseek-v4.1-flash --scale 0.011``, 2.15 GiB). The trace ends when the batch can no longer
be kept full, so every step is a serving step of ``--batch`` sequences (whole files made a
trace whose last thousands of steps decoded one long file alone).

Reported:
1. hit rate per policy with a DRAM cache of ``--cache-fraction`` of the table (cache
   bookkeeping replayed over the whole trace; the LRU figure is cross-checked against the
   planner's miss-ratio curve of the same deduplicated trace);
2. rows/s over the trace's last steps, the same steps for each: direct tier + DRAM cache,
   direct uncached, memory tier (the cache is warmed over the earlier steps with bytes read
   from the memory tier, which holds the same bytes, so warming does not take minutes of
   random disk reads); ``--repeats`` rounds, interleaved, medians;
3. the cost of dedup plus a 100%-hit lookup in the DRAM cache, relative to a raw gather
   from the memory tier, for a decode step of ``--batch`` sequences, a 64-token prefill
   chunk of one sequence, and a single-token step of one sequence (``cache_hit_path``:
   whether the cache's C hit path ran; ``ENGRAM_OFFLOAD_NO_NATIVE=1`` measures NumPy's);
4. stall per step with a small real transformer (Engram at the table's layer ids): the
   prefetch starts at forward entry, vs gathering synchronously at each Engram layer; for
   each ``--torch-threads`` setting (the prefetch worker shares the cores with the model).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from engram_offload import open_table
from engram_offload.atomic import write_json_atomic
from engram_offload.bench.backbone import EngramBackbone
from engram_offload.cache import RowCache, build_levels
from engram_offload.cache.report import format_stats_table
from engram_offload.engram.hashing import NgramHasher
from engram_offload.engram.tokenizer import cached_token_map
from engram_offload.machine import machine_facts
from engram_offload.planner.trace import serving_steps, stdlib_token_sequences
from engram_offload.serving.dedup import dedup
from engram_offload.serving.prefetch import Prefetcher
from engram_offload.serving.store import TableStore

from wiring import forward_with_prefetch, forward_with_store  # beside this script

POLICIES = [("lru", False), ("lru", True), ("lfu", False), ("lfu", True)]


def cut_requests(files: list[np.ndarray], cut: int) -> list[np.ndarray]:
    """Files' tokens cut into requests of at most ``cut`` tokens (0: whole files), those under 16 dropped."""
    seqs = [f[i: i + cut] for f in files for i in range(0, f.size, cut)] if cut else files
    return [s for s in seqs if s.size >= 16]


def full_batch_trace(config, token_map, seqs: list[np.ndarray], batch: int) -> list[np.ndarray]:
    """Decode steps while ``batch`` sequences run side by side (stops when one cannot be replaced)."""
    full = batch * config.rows_per_token
    steps = []
    for s in serving_steps(config, token_map, seqs, batch=batch, chunk=1):
        if s.size < full:
            break
        steps.append(s)
    return steps


def replay_hit_rate(steps: list[np.ndarray], capacity_rows: int, policy: str, admission: bool,
                    num_rows: int, cache: RowCache | None = None) -> dict:
    """Cache bookkeeping only (1-byte rows): hits / unique rows per step, over the trace
    (through ``cache`` where given: one made so)."""
    if cache is None:
        cache = RowCache(capacity_rows, 1, policy, admission=admission, num_rows=num_rows)
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
    ap.add_argument("--max-seq-tokens", type=int, default=2048, help="tokens per request (files are cut)")
    ap.add_argument("--measure-steps", type=int, default=200, help="steps timed on the direct tier")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the rows/s figures (medians)")
    ap.add_argument("--stall-steps", type=int, default=40)
    ap.add_argument("--torch-threads", default="1,2", help="torch intra-op threads for the stall figure")
    ap.add_argument("--hidden", type=int, default=512, help="backbone width for the stall figure")
    ap.add_argument("--out", default="engram-bench/cache.json",
                    help="the results JSON (default engram-bench/cache.json; benchmarks/results/cache.json is the committed record: write there only to update it)")
    args = ap.parse_args()
    default_threads = torch.get_num_threads()
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
    files = stdlib_token_sequences(args.tokens)
    seqs = cut_requests(files, args.max_seq_tokens)
    steps = full_batch_trace(config, token_map, seqs, args.batch)
    flat = [s.reshape(-1) for s in steps]
    requested = sum(s.size for s in flat)
    unique_per_step = sum(dedup(s).unique.size for s in flat)
    result["trace"] = {"tokens": int(sum(s.size for s in seqs)), "files": len(files), "requests": len(seqs),
                       "steps": len(steps), "ids_per_step": int(flat[0].size),
                       "tokens_in_trace": len(steps) * args.batch,
                       "rows_requested": requested, "rows_unique_per_step": unique_per_step,
                       "dedup_ratio": unique_per_step / requested,
                       "distinct_rows": int(np.unique(np.concatenate(flat)).size),
                       "build_s": time.perf_counter() - t0}
    print(f"trace: {result['trace']}")

    # ---- 1. hit rate per policy
    rates = []
    for policy, admission in POLICIES:
        r = replay_hit_rate(flat, capacity_rows, policy, admission, config.num_rows)
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

    # ---- 2. rows/s: direct + cache vs direct vs memory, on the same full-batch steps
    # one intra-op thread: two spin-waiting OpenMP threads on a 2-core machine made single
    # gathers erratic (multiples of the 4 ms scheduler tick); decoding is single-threaded anyway
    torch.set_num_threads(1)
    result["gather_torch_threads"] = 1
    # rounds measure consecutive windows of the trace's last steps, in trace order (replaying
    # one window again would find every row cached: 200 steps fit in the cache)
    windows = [flat[len(flat) - (args.repeats - r) * args.measure_steps: len(flat) - (args.repeats - r - 1)
                    * args.measure_steps] for r in range(args.repeats)]
    measured = windows[-1]
    warm = flat[: len(flat) - args.repeats * args.measure_steps]
    mem = open_table(args.table, "memory")
    direct = open_table(args.table, "direct")
    levels = build_levels(config.row_bytes, cache_bytes, best["policy"], admission=best["admission"],
                          num_rows=config.num_rows)
    warming = TableStore(mem.tier, config, levels)  # the same caches, filled from memory: faster
    t0 = time.perf_counter()
    for ids in warm:
        warming.fetch(dedup(ids).unique, hold=False)
    print(f"cache warmed over {len(warm):,} steps in {time.perf_counter() - t0:.1f} s")
    cached = TableStore(direct.tier, config, levels)  # the warmed caches in front of the direct tier
    rounds: dict[str, list[float]] = {"direct_cached": [], "direct_uncached": [], "memory": []}
    hit_rates = []
    for r, window in enumerate(windows):
        rows = sum(s.size for s in window)
        cached.reset_stats()
        t0 = time.perf_counter()
        for ids in window:
            cached.gather(ids, torch.bfloat16)
        rounds["direct_cached"].append(rows / (time.perf_counter() - t0))
        hit_rates.append(cached.stats()["store"]["hit_rate"])
        if r == 0:
            first_stats = cached.stats()
        for name, store in (("direct_uncached", direct), ("memory", mem)):
            t0 = time.perf_counter()
            for ids in window:
                store.gather(ids, torch.bfloat16)
            rounds[name].append(rows / (time.perf_counter() - t0))
        print(f"  round {r}: " + ", ".join(f"{k} {v[-1]:,.0f} rows/s" for k, v in rounds.items())
              + f", hit rate {hit_rates[-1]:.4f}")
    result["throughput"] = {
        "steps_per_round": args.measure_steps, "ids_per_step": int(measured[0].size),
        "rows_requested_per_round": rows,
        "repeats": args.repeats,
        **{f"{k}_rows_per_s": statistics.median(v) for k, v in rounds.items()},
        "rounds_rows_per_s": rounds,
        "cached_hit_rate_first_round": hit_rates[0], "cached_hit_rates": hit_rates,
        "stats_first_round": first_stats,
    }
    print(format_stats_table(first_stats, title="direct + DRAM cache, measured steps (first round)"))
    print("rows/s (medians): " + ", ".join(f"{k} {statistics.median(v):,.0f}" for k, v in rounds.items()))

    # ---- 3. overhead of dedup + 100%-hit lookup (in the warmed 10% DRAM cache) vs a raw gather
    hasher = NgramHasher(config, token_map)
    long_seq = next(q for q in seqs if q.size >= 64)
    prefill = hasher.table_ids(hasher.hash_all(torch.from_numpy(long_seq[None, :64]))).numpy()  # [1, 64, L, C]
    over = {}
    for name, ids in (("decode_step", measured[len(measured) // 2]),
                      ("prefill_chunk", prefill),
                      ("single_token", measured[len(measured) // 2][: config.rows_per_token])):
        cached.gather(ids)  # the step's rows now sit in the cache: every later lookup hits
        d = dedup(ids)
        u = d.unique
        t_dedup = timed(lambda: dedup(ids), 50)
        t_lookup = timed(lambda: cached.fetch(u, hold=False), 50)
        t_lookup_held = timed(lambda: cached.fetch(u, hold=True).release(), 50)  # as the prefetcher fetches
        t_raw = timed(lambda: mem.gather(ids, torch.bfloat16), 50)
        t_cached_gather = timed(lambda: cached.gather(ids, torch.bfloat16), 50)
        t_decode = timed(lambda: cached.decode(mem.read_raw(u), torch.bfloat16), 50)
        over[name] = {"ids": int(ids.size), "unique": int(u.size), "dedup_ms": t_dedup * 1e3,
                      "hit_lookup_ms": t_lookup * 1e3, "hit_lookup_us_per_row": t_lookup / u.size * 1e6,
                      "hit_lookup_held_ms": t_lookup_held * 1e3,
                      "raw_gather_ms": t_raw * 1e3, "decode_unique_ms": t_decode * 1e3,
                      "cached_gather_ms": t_cached_gather * 1e3,
                      "overhead_vs_raw": (t_dedup + t_lookup) / t_raw,
                      "cached_gather_vs_raw": t_cached_gather / t_raw}
        print(f"{name}: {over[name]}")
    result["overhead"] = over
    result["cache_hit_path"] = "native" if cached.levels[0].native else "numpy"

    # ---- 4. stall per step with a small transformer
    bconfig = config.replace(hidden_size=args.hidden, name=None)
    torch.manual_seed(0)
    model = EngramBackbone(bconfig, num_layers=max(config.layer_ids) + 2, vocab_size=token_map.size, heads=8).eval()
    stall: dict = {}
    tokens = [q for q in seqs if q.size >= args.stall_steps][: args.batch]
    batch_tokens = np.stack([q[: args.stall_steps] for q in tokens])  # [B, steps]
    for threads in [int(x) for x in args.torch_threads.split(",")]:
        torch.set_num_threads(threads)
        per = {}
        for name, store in (("direct+cache", cached), ("memory", mem)):
            store_stall, compute, first_ready = [], [], []
            with Prefetcher(store, hasher, dtype=torch.float32) as pf, torch.no_grad():
                for t in range(args.stall_steps):
                    t0 = time.perf_counter()
                    res = forward_with_prefetch(model, pf, list(range(len(tokens))), list(batch_tokens[:, t]))
                    compute.append(time.perf_counter() - t0)
                    store_stall.append(res.stall_seconds)
                    first_ready.append(res.step.first_part_seconds)
            per[name] = {"stall_ms_p50": statistics.median(store_stall) * 1e3,
                         "stall_ms_mean": statistics.fmean(store_stall) * 1e3,
                         "step_ms_p50": statistics.median(compute) * 1e3,
                         "first_layer_ready_ms_p50": statistics.median(first_ready) * 1e3}
            print(f"stall threads={threads} {name}: {per[name]}")
        with torch.no_grad():
            ids = torch.from_numpy(batch_tokens[:, :1])
            per["synchronous_gather_step_ms"] = timed(
                lambda: forward_with_store(model, cached, hasher, ids, torch.float32), 5) * 1e3
            per["model_only_step_ms"] = timed(
                lambda: model(ids, lambda layer: torch.zeros(ids.shape[0], 1, config.cols_per_layer,
                                                             config.head_dim)), 5) * 1e3
        stall[f"torch_threads_{threads}"] = per
    torch.set_num_threads(default_threads)
    stall["layers_before_first_engram"] = min(config.layer_ids)
    stall["backbone"] = {"layers": max(config.layer_ids) + 2, "hidden": args.hidden, "batch": len(tokens)}
    print(f"stall: {stall}")
    result["stall"] = stall
    cached.close()
    mem.close()
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
