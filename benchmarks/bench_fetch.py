"""The fetch loop beside fio: a Prefetcher over a cold direct table with a 10% DRAM cache,
and fio's 4 KiB random reads at queue depth 128 on the same file, in one run.

    nice python benchmarks/bench_fetch.py --table T --seconds 5 --repeats 3

Each repeat runs ``fio --ioengine=io_uring --direct=1 --rw=randread --bs=4k --iodepth=128``
(the file's pages evicted first; once more after the last repeat, so that each repeat sits
between two fio runs), then ``run_tier_bench(T, "direct", prefetcher=True,
cold=True, cache_bytes=10% of the table)``: real-text decode steps (the same corpus,
tokenized once) through the Prefetcher from one caller with its run-ahead, a cold phase then
a warm phase that measures the CPU of a hit row (see ``engram_offload.bench.prefetch_bench``).
Medians of the repeats; the ratios against the targets:

- missed rows/s >= 0.8x fio's reads/s;
- CPU per missed row <= 1.2x fio's CPU per read (fio's usr+sys over its reads);
- CPU per hit row <= 0.3 us.

Each CPU figure comes twice: the whole process's (hashing, dedup and the step's handling in
the caller included) and the fetch loop's alone (the Prefetcher's workers: cache lookups,
reads, fills and decode: ``fetch_cpu_us_per_*``).

A missed row's CPU is also split into the kernel's part (system time: the reads) and the
process's (checks, decode, caches, Python), beside fio's own split.

The process's environment (``OMP_WAIT_POLICY`` included: torch's OpenMP pool spin-waits
after parallel ops by default) is recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bench_tier import bracketed_ratios

from engram_offload.atomic import write_json_atomic
from engram_offload.bench.prefetch_bench import load_text
from engram_offload.bench.tier_bench import run_tier_bench
from engram_offload.commands.bench import PREFETCH_SEQUENCES
from engram_offload.table import read_header
from engram_offload.tiers.policy import DEFAULT_QUEUE_DEPTH
from engram_offload.units import parse_size

from fio import machine_facts, run_fio

TARGETS = {"misses_vs_fio_min": 0.8, "cpu_per_miss_vs_fio_max": 1.2, "cpu_us_per_hit_max": 0.3}
FIGURES = ("rows_per_s", "misses_per_s", "hit_rate", "reads_per_s", "tokens_per_s", "cpu_us_per_miss",
           "cpu_us_per_hit", "fetch_cpu_us_per_miss", "fetch_cpu_us_per_hit", "cpu_us_per_row",
           "hash_dedup_cpu_us_per_token", "step_ms_p50", "step_ms_p99", "kernel_cpu_us_per_miss",
           "user_cpu_us_per_miss")


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", required=True, help="a table file (format v2); it is only read")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds of each fio run and cold phase (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each; medians are reported (default 3)")
    p.add_argument("--cache-bytes", default="10%", help="the DRAM row cache (default 10%% of the table)")
    p.add_argument("--queue-depth", type=int, default=DEFAULT_QUEUE_DEPTH,
                   help=f"the direct tier's reads in flight per ring (default {DEFAULT_QUEUE_DEPTH})")
    p.add_argument("--fio-queue-depth", type=int, default=128, help="fio's --iodepth (default 128)")
    p.add_argument("--sequences", type=int, default=PREFETCH_SEQUENCES,
                   help=f"sequences per decode step (default {PREFETCH_SEQUENCES}, bench-tier's)")
    p.add_argument("--run-ahead", type=int, default=2, help="steps in flight (default 2)")
    p.add_argument("--corpus", default="stdlib", help="the text (default stdlib)")
    p.add_argument("--corpus-tokens", type=int, default=300_000, help="tokens of the corpus (default 300,000)")
    p.add_argument("--out", default="engram-bench/fetch.json",
                   help="the results JSON (default engram-bench/fetch.json; benchmarks/results/fetch.json is the committed record: write there only to update it)")
    args = p.parse_args(argv)
    table = Path(args.table)
    layout = read_header(table).layout
    cache_bytes = parse_size(args.cache_bytes, whole=layout.num_rows * layout.row_bytes)
    if not cache_bytes:
        p.error("--cache-bytes must be > 0: the CPU of a hit row is measured on cached rows")
    load_start = os.getloadavg()
    corpus, _ = load_text(args.corpus, args.corpus_tokens, 0)
    runs: dict[str, list] = {"fio": [], "prefetcher": []}
    for rep in range(args.repeats + 1):  # fio before every repeat and after the last
        fio = run_fio(table, iodepth=args.fio_queue_depth, seconds=args.seconds)
        if fio is None:
            print("fio not found (apt-get install fio): the ratios need it", file=sys.stderr)
            return 1
        runs["fio"].append(fio)
        if rep == args.repeats:
            break
        print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr)
        runs["prefetcher"].append(run_tier_bench(
            table, "direct", seconds=args.seconds, queue_depth=args.queue_depth, cold=True,
            cache_bytes=cache_bytes, prefetcher=True, sequences=args.sequences, run_ahead=args.run_ahead,
            corpus=corpus))
    med, ratios = summarize(runs["prefetcher"], runs["fio"])
    result = {
        "benchmark": "bench_fetch",
        "command": "python benchmarks/bench_fetch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "table": str(table), "table_bytes": table.stat().st_size,
        "params": {"repeats": args.repeats, "seconds": args.seconds, "cache_bytes": cache_bytes,
                   "queue_depth": args.queue_depth, "fio_queue_depth": args.fio_queue_depth,
                   "sequences": args.sequences, "run_ahead": args.run_ahead,
                   "corpus": {"name": corpus.name, "tokens": corpus.tokens, "source": corpus.source}},
        "targets": TARGETS,
        "machine": {**machine_facts(table), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "fp8_decode": runs["prefetcher"][0]["fp8_decode"]},
        "method": runs["prefetcher"][0]["method"],
        "median": med,
        "ratios": ratios,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, result)
    print(json.dumps({"median": med, "ratios": ratios}, indent=2))
    return 0


def _ratio(ours: float, fio: float) -> float | None:
    """ours / fio; None where fio's figure is 0 (a short fio run may count no user time)."""
    return ours / fio if fio else None


def summarize(prefetcher: list[dict], fio: list[dict]) -> tuple[dict, dict]:
    """Medians of the fetch loop's runs and fio's, and the ratios against the targets."""
    med = {f"fio_{k}": median_of(fio, k)
           for k in ("iops", "cpu_us_per_read", "user_cpu_us_per_read", "kernel_cpu_us_per_read")}
    med.update({k: median_of(prefetcher, k) for k in FIGURES})
    med["warm_hit_rate"] = statistics.median(r["warm"]["hit_rate"] for r in prefetcher)
    bracketed = bracketed_ratios(prefetcher, fio, "misses_per_s", "cpu_us_per_miss")
    fetch_bracketed = bracketed_ratios(prefetcher, fio, "misses_per_s", "fetch_cpu_us_per_miss")
    ratios = {
        "misses_per_s_vs_fio_iops": med["misses_per_s"] / med["fio_iops"],
        "cpu_us_per_miss_vs_fio_cpu_us_per_read": med["cpu_us_per_miss"] / med["fio_cpu_us_per_read"],
        "cpu_us_per_hit": med["cpu_us_per_hit"],
        # the fetch loop alone (the Prefetcher's workers: lookups, reads, fills, decode), without the
        # caller's hashing, dedup and step handling
        "fetch_cpu_us_per_miss_vs_fio_cpu_us_per_read": med["fetch_cpu_us_per_miss"] / med["fio_cpu_us_per_read"],
        "fetch_cpu_us_per_hit": med["fetch_cpu_us_per_hit"],
        # where a missed row's CPU goes beside fio's: in the kernel (the reads) and in the process
        "kernel_cpu_us_per_miss_vs_fio_kernel_cpu_us_per_read":
            _ratio(med["kernel_cpu_us_per_miss"], med["fio_kernel_cpu_us_per_read"]),
        "user_cpu_us_per_miss_vs_fio_user_cpu_us_per_read":
            _ratio(med["user_cpu_us_per_miss"], med["fio_user_cpu_us_per_read"]),
        # each repeat against the mean of the fio runs just before and just after it: steadier
        # when the drive's rate or the machine's load drifts
        "misses_per_s_vs_fio_iops_paired_median": statistics.median(r["reads"] for r in bracketed),
        "cpu_us_per_miss_vs_fio_paired_median": statistics.median(r["cpu"] for r in bracketed),
        "fetch_cpu_us_per_miss_vs_fio_paired_median": statistics.median(r["cpu"] for r in fetch_bracketed),
    }
    return med, ratios


if __name__ == "__main__":
    sys.exit(main())
