"""Loading a table into DRAM beside fio's sequential read of the same file, and what
checking every page costs a random-read tier.

Side by side in one run, repeated (default 3x), medians reported:

* fio, 1 MiB sequential O_DIRECT reads of the whole table file, at queue depth 1 (psync)
  and 8 (io_uring): the disk's sequential rate;
* the ``memory`` tier opening the table (format version 3): load bytes/s with every page
  checked (the default, 4 KiB pages), without checks (``verify_reads=False``), and into
  transparent huge pages (``huge_pages=True``); the ``pinned`` tier too where CUDA is present
  (without it, it is the memory tier); each load's ratio to that repeat's fio rate (the
  better of the two depths), medians reported;
* the CPU cost of faulting in fresh memory (``MADV_POPULATE_WRITE`` on 512 MiB), huge and
  4 KiB pages: on a virtual machine whose host takes back free guest memory (free page
  reporting), a fresh huge page costs far more than the kernel's zeroing;
* the cost of page checks on random reads: ``direct`` (cold, the tier's defaults) with
  ``verify_pages`` on and off, CPU microseconds per 4 KiB page read (the difference is
  within the noise of a shared machine); the check of a batch of 1024 random pages already
  in memory (``check_pages``: checksums, lookup, compare), per page; and the checksum loop
  alone (``page_sums``) over 64 MiB.

Each load and fault-in measurement starts ``--settle-seconds`` after the one before, so
memory the previous one freed has been taken back by a virtual machine's host, as for a
server starting.
The machine may be shared: the JSON records its load average before and after.

    nice python benchmarks/bench_load.py --table T.table --out benchmarks/results/load.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engram_offload.atomic import write_json_atomic
from engram_offload.bench.cold import evict_file_pages
from engram_offload.bench.tier_bench import run_tier_bench
from engram_offload.table import read_header
from engram_offload.table.pagesum import native_available, page_sums
from engram_offload.tiers import open_tier
from engram_offload.tiers.pagecheck import check_pages, plan_pages

from fio import machine_facts, run_fio

# name -> (tier, its options)
LOADS: dict[str, tuple[str, dict[str, Any]]] = {
    "memory": ("memory", {}),
    "memory_unverified": ("memory", {"verify_reads": False}),
    "memory_huge": ("memory", {"huge_pages": True}),
}
MADV_POPULATE_WRITE = 23


def load(path: Path, tier: str, options: dict[str, Any]) -> dict[str, float]:
    evict_file_pages(path)
    cpu = time.process_time()
    with open_tier(tier, read_header(path), progress=False, **options) as t:
        stats = t.stats()
    cpu = time.process_time() - cpu
    return {"bytes_per_s": stats["load_bytes"] / stats["load_seconds"], "seconds": stats["load_seconds"],
            "cpu_seconds": cpu, "huge_pages": stats["huge_pages"], "loadavg_1min": os.getloadavg()[0]}


def first_touch_cost(huge: bool, nbytes: int = 512 << 20) -> float:
    """CPU seconds per GB to fault in ``nbytes`` of fresh private memory (one
    ``MADV_POPULATE_WRITE``), huge pages asked for or not; NaN where the kernel lacks it."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if huge:
            mm.madvise(mmap.MADV_HUGEPAGE)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        address = ctypes.c_char.from_buffer(mm)
        cpu = time.process_time()
        failed = libc.madvise(ctypes.addressof(address), nbytes, MADV_POPULATE_WRITE) != 0
        cpu = time.process_time() - cpu
        del address
        return float("nan") if failed else cpu / (nbytes / 1e9)
    finally:
        mm.close()


def page_check_cost(path: Path, seconds: float, on_first: bool) -> dict[str, float]:
    """Cold ``direct`` random reads with page checks on and off: CPU us per page read."""
    runs = {}
    for on in (on_first, not on_first):
        r = run_tier_bench(path, "direct", seconds=seconds, cold=True, verify_pages=on)
        runs["on" if on else "off"] = {"cpu_us_per_read": r["cpu_us_per_read"], "reads_per_s": r["reads_per_s"]}
    runs["check_us_per_page"] = runs["on"]["cpu_us_per_read"] - runs["off"]["cpu_us_per_read"]
    return runs


def batch_check_cost(path: Path, pages_per_batch: int = 1024) -> float:
    """CPU us per page of ``check_pages`` (checksums, lookup, compare) on batches of random
    pages already in memory: the check alone, without the noise of the I/O around it."""
    header = read_header(path)
    layout = header.layout
    rng = np.random.default_rng(0)
    pages = np.unique(rng.integers(0, layout.num_pages, pages_per_batch))
    buf = np.empty(len(pages) * layout.page_bytes, np.uint8)
    with open(path, "rb") as f:
        for i, p in enumerate(pages.tolist()):
            f.seek(layout.data_offset + p * layout.page_bytes)
            f.readinto(memoryview(buf)[i * layout.page_bytes:(i + 1) * layout.page_bytes])
    plan = plan_pages(layout.data_offset + pages * layout.page_bytes, layout)
    best = float("inf")
    for _ in range(20):
        cpu = time.process_time()
        for _ in range(10):
            check_pages(header, plan, buf, lambda bad: None)
        best = min(best, (time.process_time() - cpu) / 10)
    return best / len(pages) * 1e6


def checksum_loop_cost() -> float:
    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    best = float("inf")
    for _ in range(5):
        cpu = time.process_time()
        page_sums(data, 4096)
        best = min(best, time.process_time() - cpu)
    return best / (len(data) // 4096) * 1e6


def median_of(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key, v in runs[0].items() if not isinstance(v, str)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", required=True, type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-seconds", type=float, default=5.0, help="seconds of each direct run (0: none)")
    ap.add_argument("--loads", default=",".join(LOADS), help=f"which loads, comma-separated (of {', '.join(LOADS)})")
    ap.add_argument("--settle-seconds", type=float, default=5.0,
                    help="pause before each load and fault-in measurement, so memory the previous one freed "
                         "is reclaimed by a virtual machine's host again (the state a server starts in)")
    ap.add_argument("--out", type=Path, default=Path("engram-bench/load.json"),
                    help="the results JSON (default engram-bench/load.json; benchmarks/results/load.json is the committed record: write there only to update it)")
    args = ap.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio not found: apt-get install fio", file=sys.stderr)
        return 2
    facts = machine_facts(args.table)
    path = args.table
    loads = {name: LOADS[name] for name in args.loads.split(",")}
    loads.update({"pinned": ("pinned", {})} if torch.cuda.is_available() else {})
    raw: dict[str, list[dict[str, float]]] = {"fio_qd1": [], "fio_qd8": [], **{name: [] for name in loads}}
    ratios: dict[str, list[float]] = {name: [] for name in loads}
    touch: dict[str, list[float]] = {"huge": [], "4k": []}
    checks = []
    for rep in range(args.repeats):
        for depth in (1, 8):
            r = run_fio(path, rw="read", bs="1M", iodepth=depth, engine="psync" if depth == 1 else "io_uring")
            raw[f"fio_qd{depth}"].append(r)
            print(f"[{rep}] fio seq 1 MiB qd{depth}: {r['bytes_per_s'] / 1e9:.2f} GB/s", flush=True)
        fio_here = max(raw["fio_qd1"][-1]["bytes_per_s"], raw["fio_qd8"][-1]["bytes_per_s"])
        for name, (tier, options) in loads.items():
            time.sleep(args.settle_seconds)
            r = load(path, tier, options)
            raw[name].append(r)
            ratios[name].append(r["bytes_per_s"] / fio_here)
            print(f"[{rep}] {name} load: {r['bytes_per_s'] / 1e9:.2f} GB/s ({ratios[name][-1]:.2f}x fio), "
                  f"{r['cpu_seconds']:.2f} s CPU, load average {r['loadavg_1min']:.1f}", flush=True)
        for kind in touch:
            time.sleep(args.settle_seconds)
            touch[kind].append(first_touch_cost(kind == "huge"))
        print(f"[{rep}] faulting in fresh memory: {touch['huge'][-1]:.2f} s CPU/GB huge pages, "
              f"{touch['4k'][-1]:.2f} 4 KiB pages", flush=True)
        if args.check_seconds <= 0:
            continue
        c = page_check_cost(path, args.check_seconds, on_first=rep % 2 == 0)
        checks.append(c)
        print(f"[{rep}] direct cold: {c['on']['cpu_us_per_read']:.2f} us CPU/page checked, "
              f"{c['off']['cpu_us_per_read']:.2f} unchecked", flush=True)
    medians = {name: median_of(runs) for name, runs in raw.items()}
    fio_best = max(medians["fio_qd1"]["bytes_per_s"], medians["fio_qd8"]["bytes_per_s"])
    result: dict[str, Any] = {
        "machine": facts,
        "loadavg_after": os.getloadavg(),
        "shared_machine": True,
        "table": args.table.name,
        "data_bytes": read_header(path).layout.data_bytes,
        "repeats": args.repeats,
        "native_page_sums": native_available(),
        "medians": medians,
        "load_vs_fio": {name: medians[name]["bytes_per_s"] / fio_best for name in medians if not name.startswith("fio")},
        "load_vs_fio_same_repeat": {name: statistics.median(r) for name, r in ratios.items()},
        "first_touch_cpu_s_per_gb": {kind: statistics.median(v) for kind, v in touch.items()},
        "page_checks": {
            "checksum_loop_us_per_page": checksum_loop_cost(),
            "batch_check_us_per_page": batch_check_cost(path),
            **({
                "direct_cold_check_us_per_page": statistics.median(c["check_us_per_page"] for c in checks),
                "direct_cold_cpu_us_per_page_on": statistics.median(c["on"]["cpu_us_per_read"] for c in checks),
                "direct_cold_cpu_us_per_page_off": statistics.median(c["off"]["cpu_us_per_read"] for c in checks),
            } if checks else {}),
        },
        "raw": {"runs": raw, "page_checks": checks, "load_vs_fio_same_repeat": ratios, "first_touch": touch},
    }
    write_json_atomic(args.out, result)
    print(json.dumps({key: result[key] for key in ("load_vs_fio", "load_vs_fio_same_repeat",
                                                   "first_touch_cpu_s_per_gb", "page_checks")}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
