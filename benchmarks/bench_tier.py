"""Tier comparison: direct vs fio, memory vs raw index_select, direct vs mmap (cold).

    python benchmarks/bench_tier.py --table /tmp/engram-bench/t2g.tbl --out benchmarks/results/tier.json

(a) direct tier, cold random rows (one caller at queue depth Q, and two callers at Q/2
    each), vs ``fio --ioengine=io_uring --direct=1 --rw=randread
    --bs=4k --iodepth=Q`` on the same file in the same run (skipped when fio is absent);
    targets: >= 85% of fio's IOPS, <= 3 us CPU per read.
(b) memory tier gather of random ids vs ``torch.index_select`` into a preallocated buffer on
    the same ids; target >= 0.8x.
(c) direct and mmap side by side, cold, at the same queue depth (mmap: that many threads
    faulting at once).
(d) one synchronous caller at ``bench-tier``'s defaults (batches of 1,024 random rows, queue
    depth Q, cold): the direct tier's read (one native call that checks and copies each page as
    its read completes, with the queue kept full) between two fio runs; targets: >= 0.9x fio's
    reads/s, CPU a read <= 1.2x fio's. ``--one-caller`` runs (d)
    alone.
Each is repeated ``--repeats`` times; medians are reported. Makes the table with
``make-table`` first when it does not exist.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engram_offload import cli
from engram_offload.atomic import write_json_atomic
from engram_offload.bench.tier_bench import run_tier_bench
from engram_offload.table import read_header
from engram_offload.tiers import open_tier

from fio import machine_facts, run_fio


def memory_vs_index_select(table: Path, seconds: float, batch: int) -> dict:
    tier = open_tier("memory", read_header(table))
    rows = tier.rows  # [num_rows, row_bytes]
    rng = np.random.default_rng(0)
    id_sets = [rng.integers(0, tier.num_rows, batch) for _ in range(64)]
    id_tensors = [torch.from_numpy(ids) for ids in id_sets]
    out = torch.empty((batch, tier.row_bytes), dtype=torch.uint8)

    raw_s = ours_s = 0.0
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:  # interleaved: both see the same machine load
        for i in range(len(id_sets)):
            t0 = time.perf_counter()
            torch.index_select(rows, 0, id_tensors[i], out=out)
            t1 = time.perf_counter()
            tier.read_rows(id_sets[i], out)
            raw_s, ours_s = raw_s + t1 - t0, ours_s + time.perf_counter() - t1
        n += len(id_sets) * batch
    raw, ours = n / raw_s, n / ours_s
    tier.close()
    return {"memory_rows_per_s": ours, "index_select_rows_per_s": raw, "ratio": ours / raw,
            "huge_pages": tier.huge_pages}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", default="/tmp/engram-bench/t2g.tbl")
    p.add_argument("--scale", default="0.011", help="make-table --scale when the table is missing")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--mmap-seconds", type=float, default=4.0,
                   help="shorter: a cold mmap run warms the page cache as it goes")
    p.add_argument("--queue-depth", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--out", default="engram-bench/tier.json",
                   help="the results JSON (default engram-bench/tier.json; benchmarks/results/tier.json is the committed record: write there only to update it)")
    p.add_argument("--one-caller", action="store_true", help="run only (d): one caller vs fio")
    p.add_argument("--caller-batch", type=int, default=ONE_CALLER_BATCH,
                   help=f"(d): rows a call (default {ONE_CALLER_BATCH:,}, bench-tier's; a larger call shows the rate "
                        "without a call's start and end)")
    args = p.parse_args(argv)
    table = Path(args.table)
    load_start = os.getloadavg()
    if not table.exists():
        table.parent.mkdir(parents=True, exist_ok=True)
        cli.main(["make-table", "--scale", args.scale, "--out", str(table), "--seed", "0"])
    q, s = args.queue_depth, args.seconds
    if args.one_caller:
        return one_caller(table, args, argv, load_start)
    runs: dict[str, list] = {"direct_uring": [], "direct_uring_2callers": [], "direct_threads": [], "fio": [], "memory": [],
                             "direct_qd": [], "mmap_qd": []}
    for rep in range(args.repeats):
        print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr)
        runs["direct_uring"].append(run_tier_bench(table, "direct", seconds=s, batch=args.batch,
                                                   queue_depth=q, cold=True, engine="uring"))
        runs["direct_uring_2callers"].append(run_tier_bench(  # same total queue depth, I/O overlaps copying
            table, "direct", seconds=s, batch=args.batch, queue_depth=q // 2, cold=True,
            engine="uring", callers=2))
        runs["direct_threads"].append(run_tier_bench(table, "direct", seconds=s, batch=args.batch,
                                                     queue_depth=q, cold=True, engine="threads"))
        fio = run_fio(table, iodepth=q, seconds=s)
        if fio:
            runs["fio"].append(fio)
        runs["memory"].append(memory_vs_index_select(table, min(s, 3.0), args.batch))
        runs["direct_qd"].append(run_tier_bench(table, "direct", seconds=args.mmap_seconds,
                                                batch=args.batch, queue_depth=q, cold=True))
        runs["mmap_qd"].append(run_tier_bench(table, "mmap", seconds=args.mmap_seconds, batch=32,
                                              queue_depth=q, cold=True))
    med = {
        "a_direct_uring_reads_per_s": median_of(runs["direct_uring"], "reads_per_s"),
        "a_direct_uring_cpu_us_per_read": median_of(runs["direct_uring"], "cpu_us_per_read"),
        "a_direct_uring_2callers_reads_per_s": median_of(runs["direct_uring_2callers"], "reads_per_s"),
        "a_direct_uring_2callers_cpu_us_per_read": median_of(runs["direct_uring_2callers"], "cpu_us_per_read"),
        "a_direct_threads_reads_per_s": median_of(runs["direct_threads"], "reads_per_s"),
        "a_direct_threads_cpu_us_per_read": median_of(runs["direct_threads"], "cpu_us_per_read"),
        "b_memory_rows_per_s": median_of(runs["memory"], "memory_rows_per_s"),
        "b_index_select_rows_per_s": median_of(runs["memory"], "index_select_rows_per_s"),
        "b_ratio": median_of(runs["memory"], "ratio"),
        "c_direct_reads_per_s": median_of(runs["direct_qd"], "reads_per_s"),
        "c_direct_rows_per_s": median_of(runs["direct_qd"], "rows_per_s"),
        "c_mmap_rows_per_s": median_of(runs["mmap_qd"], "rows_per_s"),
        "c_direct_cpu_us_per_row": median_of(runs["direct_qd"], "cpu_us_per_row"),
        "c_mmap_cpu_us_per_row": median_of(runs["mmap_qd"], "cpu_us_per_row"),
    }
    if runs["fio"]:
        med["a_fio_iops"] = median_of(runs["fio"], "iops")
        med["a_fio_cpu_us_per_read"] = median_of(runs["fio"], "cpu_us_per_read")
        med["a_direct_uring_vs_fio"] = med["a_direct_uring_reads_per_s"] / med["a_fio_iops"]
        med["a_direct_uring_2callers_vs_fio"] = med["a_direct_uring_2callers_reads_per_s"] / med["a_fio_iops"]
    return write_result(
        "bench_tier", table, args, argv, load_start, med, runs,
        params={"repeats": args.repeats, "seconds": s, "mmap_seconds": args.mmap_seconds, "queue_depth": q,
                "batch": args.batch},
        targets={"a_direct_vs_fio_min": 0.85, "a_cpu_us_per_read_max": 3.0, "b_ratio_min": 0.8})


def write_result(benchmark: str, table: Path, args: argparse.Namespace, argv: list[str] | None,
                 load_start: tuple, med: dict, runs: dict, *, params: dict, targets: dict) -> int:
    """Write the run's JSON to ``--out`` (the command, table, machine, medians and runs) and
    print the medians."""
    result = {
        "benchmark": benchmark,
        "command": "python benchmarks/bench_tier.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "table": str(table), "table_bytes": table.stat().st_size,
        "params": params,
        "targets": targets,
        "machine": {**machine_facts(table), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "median": med,
        "runs": runs,
    }
    write_json_atomic(args.out, result)
    print(json.dumps(med, indent=2))
    return 0


ONE_CALLER_BATCH = 1024  # bench-tier's default batch


def one_caller(table: Path, args: argparse.Namespace, argv: list[str] | None, load_start: tuple) -> int:
    """(d): the reads of one synchronous caller beside fio, each cold.

    The drive's rate drifts by tens of percent within minutes, so fio runs before the first
    repeat and after every one: each of our runs is compared with the mean of the fio runs
    on either side of its repeat (``*_vs_fio`` are the medians of those per-repeat ratios).
    Medians of ``--repeats``."""
    q, s = args.queue_depth, args.seconds
    reads = ("one_call",)
    runs: dict[str, list] = {"one_call": [], "fio": []}
    fio = run_fio(table, iodepth=q, seconds=s)
    if fio:
        runs["fio"].append(fio)
    for rep in range(args.repeats):
        print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr)
        runs["one_call"].append(run_tier_bench(table, "direct", seconds=s, batch=args.caller_batch, queue_depth=q,
                                               cold=True, engine="uring"))
        fio = run_fio(table, iodepth=q, seconds=s)
        if fio:
            runs["fio"].append(fio)
    split = ("cpu_us_per_read", "user_cpu_us_per_read", "kernel_cpu_us_per_read")  # a read's CPU: all, process, kernel
    med: dict = {f"{name}_{key}": median_of(runs[name], key) for name in reads for key in ("reads_per_s", *split)}
    if runs["fio"]:
        med.update(fio_iops=median_of(runs["fio"], "iops"), **{f"fio_{k}": median_of(runs["fio"], k) for k in split})
        for name in reads:
            ratios = bracketed_ratios(runs[name], runs["fio"])
            med[f"{name}_vs_fio"] = statistics.median(r["reads"] for r in ratios)
            med[f"{name}_cpu_vs_fio"] = statistics.median(r["cpu"] for r in ratios)
            med[f"{name}_vs_fio_each"] = [round(r["reads"], 3) for r in ratios]
            med[f"{name}_cpu_vs_fio_each"] = [round(r["cpu"], 3) for r in ratios]
    return write_result(
        "bench_tier --one-caller", table, args, argv, load_start, med, runs,
        params={"repeats": args.repeats, "seconds": s, "queue_depth": q, "batch": args.caller_batch,
                "fio": "before the first repeat and after each"},
        targets={"one_call_vs_fio_min": 0.9, "one_call_cpu_vs_fio_max": 1.2})


def bracketed_ratios(ours: list[dict], fio: list[dict], rate: str = "reads_per_s",
                     cpu: str = "cpu_us_per_read") -> list[dict]:
    """Each run of ``ours`` (repeat k) against the mean of fio's runs k and k + 1 (the one
    before it and the one after; the last alone when there is no later one): ``{"reads": its
    ``rate`` over fio's reads/s, "cpu": its ``cpu`` over fio's CPU a read}``."""
    out = []
    for k, run in enumerate(ours):
        around = fio[k:k + 2]
        fio_iops = statistics.fmean(f["iops"] for f in around)
        fio_cpu = statistics.fmean(f["cpu_us_per_read"] for f in around)
        out.append({"reads": run[rate] / fio_iops, "cpu": run[cpu] / fio_cpu})
    return out


if __name__ == "__main__":
    sys.exit(main())
