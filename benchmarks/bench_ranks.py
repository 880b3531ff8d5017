"""Many ranks on one machine: one shared row cache vs private caches, and one shared host copy.

    nice python benchmarks/bench_ranks.py --table /tmp/engram_bench/v41f_0011.table \\
        [--ranks 4] [--steps 600] [--cache-fraction 0.02] [--out benchmarks/results/ranks.json]

1. ``--ranks`` data-parallel rank processes replay one real-text trace (CPython's standard
   library, DeepSeek's tokenizer, ``--batch`` sequences decoding; rank r takes steps r,
   r + ranks, ...) over the ``direct`` tier of ``--table``, from a cold cache, each step a
   fetch held and released as the prefetcher does:
   - shared: one row server owns the table and one DRAM cache of ``--cache-fraction`` of
     the table; the ranks fetch through it;
   - private: each rank opens the table with its own cache of a quarter (1/ranks) of that.
   Reported: hit rate (rows served by a cache / distinct rows fetched), rows/s of the
   machine (distinct rows over the wall time of the slowest rank) and of each rank, plus
   the hit rates the cache bookkeeping alone gives over the same steps (no I/O), as a check.
2. Summed PSS of 1, 2 and 4 processes that open one table (``--pss-scale`` of V4.1-Flash,
   written to a temporary file) on the ``shared`` tier, and on the ``memory`` tier for
   comparison: the growth of each process's ``smaps_rollup`` PSS from before the open,
   summed, and (shared) the PSS of the segment's mapping alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engram_offload import EngramConfig, open_table  # noqa: E402
from engram_offload.atomic import write_json_atomic  # noqa: E402
from engram_offload.engram.tokenizer import cached_token_map  # noqa: E402
from engram_offload.machine import machine_facts  # noqa: E402
from engram_offload.planner.trace import stdlib_token_sequences  # noqa: E402
from engram_offload.serving.dedup import dedup  # noqa: E402
from engram_offload.serving.rowserver import RowClient, start_row_server  # noqa: E402
from engram_offload.table import make_random_table  # noqa: E402

from bench_cache import full_batch_trace, replay_hit_rate  # noqa: E402  (the same trace and replay)
from pss import summed_pss  # noqa: E402


# ---------------------------------------------------------------------- 1. one cache vs private caches
def _replay(rank: int, ranks: int, source: dict, steps: list[np.ndarray], barrier, results) -> None:
    """One rank: its steps, each fetched held and released; (rank, rows, seconds, stats)."""
    if "socket" in source:
        store = RowClient(source["socket"])
    else:
        store = open_table(source["table"], "direct", cache_bytes=source["cache_bytes"])
    with store:
        barrier.wait()
        t0, rows = time.perf_counter(), 0
        for ids in steps[rank::ranks]:
            d = dedup(ids)
            store.fetch(d.unique, hold=True, requested=d.requested).release()
            rows += d.unique.size
        seconds = time.perf_counter() - t0
        results.put((rank, rows, seconds, None if "socket" in source else store.stats()["store"]))


def run_ranks(ranks: int, source: dict, steps: list[np.ndarray]) -> dict:
    """Start the rank processes, wait for them; machine and per-rank figures."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(ranks), ctx.Queue()
    processes = [ctx.Process(target=_replay, args=(r, ranks, source, steps, barrier, results)) for r in range(ranks)]
    for process in processes:
        process.start()
    answers = sorted(results.get(timeout=3600) for _ in processes)
    for process in processes:
        process.join()
    rows = sum(a[1] for a in answers)
    wall = max(a[2] for a in answers)
    out = {"rows": rows, "wall_s": wall, "rows_per_s": rows / wall,
           "per_rank": [{"rank": r, "rows": n, "seconds": s, "rows_per_s": n / s} for r, n, s, _ in answers]}
    if answers[0][3] is not None:  # private caches: hits summed over the ranks
        served = sum(a[3]["hit_rate"] * a[3]["rows_unique"] for a in answers)
        out["hit_rate"] = served / sum(a[3]["rows_unique"] for a in answers)
        for entry, answer in zip(out["per_rank"], answers):
            entry["hit_rate"] = answer[3]["hit_rate"]
    return out


def run_shared(args, cache_bytes: int, steps: list[np.ndarray]) -> dict:
    """The ranks through one row server with one cache of ``cache_bytes``."""
    with tempfile.TemporaryDirectory(prefix="ranks-", dir="/tmp") as directory:
        sock = Path(directory) / "rows.sock"
        server = start_row_server(args.table, sock, cache_bytes=cache_bytes)
        try:
            shared = run_ranks(args.ranks, {"socket": str(sock)}, steps)
            with RowClient(sock) as client:
                stats = client.stats()
        finally:
            server.terminate()
            server.wait()
    return {**shared, "hit_rate": stats["store"]["hit_rate"], "server": stats["server"]}


def cache_comparison(args, config, steps: list[np.ndarray]) -> dict:
    capacity_rows = int(args.cache_fraction * config.num_rows)
    cache_bytes = capacity_rows * config.row_bytes
    out = {"cache_rows": capacity_rows, "cache_bytes": cache_bytes, "ranks": args.ranks,
           "private_cache_bytes": cache_bytes // args.ranks}
    n = config.num_rows
    out["replay_hit_rate_one_cache"] = replay_hit_rate(steps, capacity_rows, "lru", False, n)["hit_rate"]
    private = [replay_hit_rate(steps[r::args.ranks], capacity_rows // args.ranks, "lru", False, n)
               for r in range(args.ranks)]
    out["replay_hit_rate_private_caches"] = (sum(p["hit_rate"] * p["unique_rows"] for p in private)
                                             / sum(p["unique_rows"] for p in private))
    out["rounds"] = []
    for round_ in range(args.repeats):  # interleaved, each from cold caches: load on the machine hits both
        shared = run_shared(args, cache_bytes, steps)
        private = run_ranks(args.ranks, {"table": args.table, "cache_bytes": cache_bytes // args.ranks}, steps)
        out["rounds"].append({"shared": shared, "private": private})
        for name, run in (("shared cache", shared), ("private caches", private)):
            print(f"round {round_}: {name}: hit rate {run['hit_rate']:.2%}, {run['rows_per_s']:,.0f} rows/s", flush=True)
    for name in ("shared", "private"):
        out[name] = {"hit_rate": statistics.median(r[name]["hit_rate"] for r in out["rounds"]),
                     "rows_per_s": statistics.median(r[name]["rows_per_s"] for r in out["rounds"])}
    return out


# ---------------------------------------------------------------------- 2. summed PSS
def pss_comparison(args) -> dict:
    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(args.pss_scale)
    with tempfile.TemporaryDirectory(prefix="ranks-pss-", dir="/tmp") as directory, \
            tempfile.TemporaryDirectory(prefix="ranks-", dir="/dev/shm") as shm_dir:
        table = make_random_table(Path(directory) / "pss.table", config, seed=1)
        table_bytes = config.num_rows * config.row_bytes
        out = {"table_rows_bytes": table_bytes, "scale": args.pss_scale, "rows": []}
        for tier in ("shared", "memory"):
            for row in summed_pss(table, tier, shm_dir):
                row["copies"] = row["summed_pss_growth_bytes"] / table_bytes
                out["rows"].append(row)
                print(f"{tier:6s} x{row['processes']}: summed PSS growth {row['copies']:.2f} copies "
                      f"of {table_bytes / 2**20:.0f} MiB", flush=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", required=True)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=60000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-seq-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--cache-fraction", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pss-scale", type=float, default=0.00065)
    ap.add_argument("--only", choices=("cache", "pss"), help="run one part, keeping the other's results in --out")
    ap.add_argument("--out", default="engram-bench/ranks.json",
                    help="the results JSON (default engram-bench/ranks.json; benchmarks/results/ranks.json is the committed record: write there only to update it)")
    args = ap.parse_args()
    out = Path(args.out)
    result: dict = json.loads(out.read_text()) if args.only and out.exists() else {}
    result.update({"machine": machine_facts(args.table), "args": vars(args)})
    if args.only != "pss":
        with open_table(args.table, "mmap") as probe:
            config = probe.config
        cut = args.max_seq_tokens
        seqs = [f[i: i + cut] for f in stdlib_token_sequences(args.tokens) for i in range(0, f.size, cut)]
        steps = full_batch_trace(config, cached_token_map(), [s for s in seqs if s.size >= 16], args.batch)
        steps = steps[: args.steps]
        result["trace"] = {"steps": len(steps), "ids_per_step": int(steps[0].size),
                           "distinct_rows": int(np.unique(np.concatenate([s.reshape(-1) for s in steps])).size)}
        print(f"trace: {result['trace']}", flush=True)
        result["cache"] = cache_comparison(args, config, steps)
    if args.only != "cache":
        result["pss"] = pss_comparison(args)
    write_json_atomic(out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
