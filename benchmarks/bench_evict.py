"""A full DRAM row cache choosing its victims: the caches' C helper against the policy's NumPy
path, on the same cache state at every eviction of a real-text trace.

    python benchmarks/bench_evict.py --table T [--policies lru,lfu] [--out engram-bench/evict.json]

The trace: CPython's standard library, tokenized with DeepSeek's tokenizer, cut into requests
of at most 2,048 tokens and decoded ``--sequences`` at a time (256 by default: the fetch
benchmark's steps, 12,288 row ids each), hashed with the table's layout, until the batch can no
longer be kept full (``bench_cache.py``'s trace). Each step's distinct rows go through a
``RowCache`` of ``--cache-fraction`` of the table (1-byte rows: the bookkeeping alone, as ``bench_cache.py``
replays it), missed rows reserved and published as a fill would. Each time the full cache
must make room (``evict_batch`` rows: 1/64 of its slots), both ways of choosing the victims
run on the same state, in turns (which goes first alternates), and must pick the same slots
in the same order; then the cache drops them. Reported per policy: medians over the
evictions of the milliseconds a choice took, and of microseconds a victim, each way, and
their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from engram_offload import open_table
from engram_offload.atomic import write_json_atomic
from engram_offload.cache import RowCache
from engram_offload.engram.tokenizer import cached_token_map
from engram_offload.machine import machine_facts
from engram_offload.planner.trace import stdlib_token_sequences

from bench_cache import cut_requests, full_batch_trace, replay_hit_rate  # bench_cache.py's trace and replay


class TimedEvictions(RowCache):
    """A RowCache that, at each eviction, times the C helper's choice and NumPy's on the same state."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self._native is None:
            raise SystemExit("bench_evict: the caches' C helper is not built (pip install -e . builds it)")
        self.timings: list[tuple[int, float, float]] = []  # (victims, C seconds, NumPy seconds)

    def _victims(self, count: int, native: bool | None = None) -> np.ndarray:
        order = [True, False] if len(self.timings) % 2 == 0 else [False, True]
        took, chosen = {}, {}
        for way in order:
            t0 = time.perf_counter()
            chosen[way] = super()._victims(count, native=way)
            took[way] = time.perf_counter() - t0
        if not np.array_equal(chosen[True], chosen[False]):
            raise SystemExit("bench_evict: the C helper and NumPy chose different victims "
                             f"at eviction {len(self.timings)}")
        self.timings.append((chosen[True].size, took[True], took[False]))
        return chosen[True]


def replay(steps: list[np.ndarray], capacity: int, policy: str, num_rows: int) -> dict:
    cache = TimedEvictions(capacity, 1, policy, num_rows=num_rows)
    hit_rate = replay_hit_rate(steps, capacity, policy, False, num_rows, cache=cache)["hit_rate"]
    if not cache.timings:
        raise SystemExit(f"bench_evict: the trace never filled the {capacity:,}-row cache: raise --tokens")
    victims = [n for n, _, _ in cache.timings]
    c_ms = [1e3 * c for _, c, _ in cache.timings]
    np_ms = [1e3 * p for _, _, p in cache.timings]
    return {"policy": policy, "capacity_rows": capacity, "hit_rate": hit_rate, "evictions": len(cache.timings),
            "victims_median": statistics.median(victims),
            "native_ms_median": statistics.median(c_ms), "numpy_ms_median": statistics.median(np_ms),
            "native_us_per_victim": 1e3 * statistics.median(c / n for n, c in zip(victims, c_ms)),
            "numpy_us_per_victim": 1e3 * statistics.median(p / n for n, p in zip(victims, np_ms)),
            "native_vs_numpy": statistics.median(c / p for c, p in zip(c_ms, np_ms))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", required=True, help="a table file (its layout and row count; no row is read)")
    ap.add_argument("--tokens", type=int, default=600_000, help="trace length in tokens (default 600,000)")
    ap.add_argument("--sequences", type=int, default=256, help="sequences decoded together (default 256)")
    ap.add_argument("--cache-fraction", type=float, default=0.10,
                    help="the cache's share of the table's rows (default 0.10)")
    ap.add_argument("--policies", default="lru,lfu", help="eviction policies, comma-separated (default lru,lfu)")
    ap.add_argument("--out", default="engram-bench/evict.json",
                    help="the results JSON (default engram-bench/evict.json; "
                         "benchmarks/results/evict.json is the committed record)")
    args = ap.parse_args(argv)
    with open_table(args.table, "mmap") as probe:
        config = probe.config
    capacity = int(args.cache_fraction * config.num_rows)
    print(f"tracing {args.tokens:,} tokens of the standard library, {args.sequences} sequences a step ...", flush=True)
    t0 = time.perf_counter()
    requests = cut_requests(stdlib_token_sequences(args.tokens), 2048)
    steps = [s.reshape(-1) for s in full_batch_trace(config, cached_token_map(), requests, args.sequences)]
    print(f"  {len(steps):,} steps in {time.perf_counter() - t0:.1f} s; a cache of {capacity:,} rows", flush=True)
    result: dict = {"benchmark": "evict", "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
                    "machine": machine_facts(args.table), "args": vars(args), "steps": len(steps), "policies": []}
    for policy in args.policies.split(","):
        r = replay(steps, capacity, policy.strip(), config.num_rows)
        result["policies"].append(r)
        print(f"  {r['policy']}: {r['evictions']} evictions of {r['victims_median']:,.0f} rows "
              f"(hit rate {r['hit_rate']:.1%}): "
              f"C {r['native_ms_median']:.2f} ms ({r['native_us_per_victim']:.3f} us a victim), "
              f"NumPy {r['numpy_ms_median']:.2f} ms ({r['numpy_us_per_victim']:.3f} us): "
              f"{r['native_vs_numpy']:.2f}x", flush=True)
    out = Path(args.out)
    write_json_atomic(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
