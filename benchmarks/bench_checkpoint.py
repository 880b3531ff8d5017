"""Serving a checkpoint's Engram rows from its own shards (``index``) against converting them
(``convert`` + ``verify``): start-up and random reads, beside fio on the same file system.

In one run, on a generated checkpoint in the released DeepSeek-V4.1 layout (``--scale`` of
V4.1-Flash, default 0.013: 2.5 GiB of rows in two shards) and the table converted from it:

* fio: 1 MiB sequential O_DIRECT reads of a shard at queue depths 1 (psync) and 8 (io_uring),
  the disk's rate and the limit of every pass over the rows;
* start-up, each step a fresh process timed from its start, the files' pages evicted first:
  ``engram-offload index`` (its rate against fio's; the target is 0.8x), ``convert`` and
  ``verify`` of the table, then opening each tier and serving a first row (memory, pinned where
  CUDA is, shared as the loader and as a later attacher, direct with its scales shared as their
  loader and as an attacher, direct reading scales per row), of the checkpoint and of the table;
* random reads, one caller gathering 1024 random rows a batch: the direct tier on the checkpoint
  (scales read per row, scales resident) and on the converted table, between fio 4 KiB random
  reads of a shard (the tier's queue depth): rows/s, reads/s, CPU a row;
* the extrapolation to DeepSeek-V4.1-Flash's 188.8 GiB at the measured rates.

The machine may be shared: the JSON records its load average. Nothing is left behind unless
``--keep`` (the checkpoint, the table and the sidecar under ``--work``).

    nice python benchmarks/bench_checkpoint.py --work /scratch/ckbench --out benchmarks/results/checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engram_offload.atomic import write_json_atomic
from engram_offload.bench.cold import evict_file_pages
from engram_offload.bench.tier_bench import run_tier_bench
from engram_offload.engram.config import EngramConfig
from engram_offload.table.generate import make_random_checkpoint
from engram_offload.tiers.policy import DEFAULT_QUEUE_DEPTH

from fio import machine_facts, run_fio

CLI = [sys.executable, "-m", "engram_offload.cli"]
# A fresh process: open the table on a tier, serve one row, say how long each step took.
OPEN = """
import json, sys, time, warnings
t0 = time.perf_counter()
import numpy as np
from engram_offload import open_table
warnings.simplefilter("ignore")
t1 = time.perf_counter()
store = open_table(sys.argv[1], sys.argv[2], **json.loads(sys.argv[3]))
t2 = time.perf_counter()
store.read_raw(np.array([int(sys.argv[4])]))
t3 = time.perf_counter()
tier = store.stats()["tier"]
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1, "first_row_s": t3 - t2, "loaded_here": tier.get("loaded_here"),
                  "attach_check": tier.get("attach_check"), "scales": tier.get("scales")}))
store.close()
"""


def timed(cmd: list[str]) -> tuple[float, str, float]:
    """Run ``cmd`` to its end; wall seconds from its start, its stdout, and its CPU seconds (user and system)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return wall, done.stdout, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def evict(paths: list[Path]) -> None:
    for path in paths:
        evict_file_pages(path)


def first_row(path: Path, tier: str, options: dict[str, Any], files: list[Path]) -> dict[str, Any]:
    """A fresh process opening ``path`` on ``tier`` and serving a row, the files' pages evicted first."""
    evict(files)
    wall, out, cpu = timed([sys.executable, "-c", OPEN, str(path), tier, json.dumps(options), "12345"])
    return {"wall_s": wall, "cpu_s": cpu, **json.loads(out)}


def opens(path: Path, files: list[Path], shm: Path) -> dict[str, dict[str, Any]]:
    """Each tier's start, from a fresh process to its first row; segments in ``shm`` (emptied first)."""
    shutil.rmtree(shm, ignore_errors=True)
    shm.mkdir()
    runs = {"memory": first_row(path, "memory", {}, files)}
    if torch.cuda.is_available():
        runs["pinned"] = first_row(path, "pinned", {}, files)
    runs["shared_loader"] = first_row(path, "shared", {"shm_dir": str(shm)}, files)
    runs["shared_attacher"] = first_row(path, "shared", {"shm_dir": str(shm)}, files)
    runs["direct_scales_loader"] = first_row(path, "direct", {"shm_dir": str(shm)}, files)
    runs["direct_scales_attacher"] = first_row(path, "direct", {"shm_dir": str(shm)}, files)
    runs["direct_scales_read"] = first_row(path, "direct", {"scales": "read"}, files)
    shutil.rmtree(shm, ignore_errors=True)
    return runs


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def random_reads(ckpt: Path, table: Path, shard: Path, seconds: float, repeats: int) -> dict[str, Any]:
    """Direct-tier random reads of the checkpoint and the table between fio 4 KiB random reads of a shard."""
    runs: dict[str, list[dict[str, Any]]] = {"fio": [], "checkpoint_scales_read": [], "checkpoint_scales_resident": [],
                                             "table": []}
    fields = ("rows_per_s", "reads_per_s", "cpu_us_per_row", "cpu_us_per_read", "batch_ms_p50", "batch_ms_p99")
    for rep in range(repeats):
        if rep == 0:
            runs["fio"].append(run_fio(shard, rw="randread", bs="4k", iodepth=DEFAULT_QUEUE_DEPTH, seconds=seconds))
        for name, path, options in (("checkpoint_scales_read", ckpt, {"scales": "read"}),
                                    ("checkpoint_scales_resident", ckpt, {"scales": "memory"}),
                                    ("table", table, {})):
            r = run_tier_bench(path, "direct", seconds=seconds, **options)
            runs[name].append({k: r[k] for k in fields} | {"reads_per_row": r["reads"] / max(r["rows"], 1)})
            print(f"[{rep}] direct {name}: {r['rows_per_s']:,.0f} rows/s, {r['reads_per_s']:,.0f} reads/s, "
                  f"{r['cpu_us_per_row']:.2f} us CPU/row", flush=True)
        runs["fio"].append(run_fio(shard, rw="randread", bs="4k", iodepth=DEFAULT_QUEUE_DEPTH, seconds=seconds))
        print(f"[{rep}] fio 4 KiB random: {runs['fio'][-1]['iops']:,.0f} reads/s", flush=True)
    medians = {name: median_of(r) for name, r in runs.items()}
    fio_iops = medians["fio"]["iops"]
    return {"medians": medians, "runs": runs, "queue_depth": DEFAULT_QUEUE_DEPTH,
            "vs_fio_reads": {n: m["reads_per_s"] / fio_iops for n, m in medians.items() if n != "fio"},
            "resident_vs_read": {"rows_per_s": medians["checkpoint_scales_resident"]["rows_per_s"]
                                 / medians["checkpoint_scales_read"]["rows_per_s"],
                                 "cpu_us_per_row": medians["checkpoint_scales_resident"]["cpu_us_per_row"]
                                 / medians["checkpoint_scales_read"]["cpu_us_per_row"]}}


# opens that read every row, or (a checkpoint's direct tier) every scale
LOADS = ("memory", "pinned", "shared_loader", "direct_scales_loader")


def extrapolate(start: dict[str, Any], data_bytes: int, fio_rate: float) -> dict[str, Any]:
    """Seconds at DeepSeek-V4.1-Flash's size: a command's pass over the rows at its measured rate
    plus the fixed cost of starting the command (``engram-offload --version``); an open that reads
    every row (or scale), its open at the measured rate plus the rest of its process as measured;
    an attach, or an open that reads nothing, as measured."""
    full = EngramConfig.from_name("deepseek-v4.1-flash")
    rows_bytes = full.num_rows * full.row_bytes
    scale = rows_bytes / data_bytes
    fixed = start["fixed_s"]
    index = start["index"]["wall_s"] + start["index"]["pass_s"] * (scale - 1)
    convert, verify = (fixed + (start[k]["wall_s"] - fixed) * scale for k in ("convert", "verify"))
    opens = {name: {k: v["wall_s"] + (v["open_s"] * (scale - 1) if k in LOADS[: 3 if name == "table" else 4] else 0.0)
                    for k, v in start["opens"][name].items()} for name in ("checkpoint", "table")}
    return {"rows_bytes": rows_bytes, "scale": scale, "fio_seconds": rows_bytes / fio_rate,
            "index_s": index, "convert_s": convert, "verify_s": verify, "convert_and_verify_s": convert + verify,
            "index_then_direct_first_row_s": index + opens["checkpoint"]["direct_scales_loader"],
            "convert_verify_then_direct_first_row_s": convert + verify + opens["table"]["direct_scales_read"],
            "checkpoint_opens_s": opens["checkpoint"], "table_opens_s": opens["table"],
            "sidecar_bytes": start["sidecar_bytes"] * scale}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="a folder on the file system to measure (made, and "
                    "emptied after unless --keep)")
    ap.add_argument("--scale", type=float, default=0.013, help="share of V4.1-Flash's rows (default 0.013: 2.5 GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of each random-read run")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint, sidecar and table")
    ap.add_argument("--out", type=Path, default=Path("engram-bench/checkpoint.json"),
                    help="the results JSON (default engram-bench/checkpoint.json; benchmarks/results/checkpoint.json "
                         "is the committed record: write there only to update it)")
    args = ap.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio not found: apt-get install fio", file=sys.stderr)
        return 2
    ckpt, table = args.work / "ckpt", args.work / "v41.table"
    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(args.scale)
    if not (ckpt / "config.json").exists():
        print(f"writing the checkpoint {ckpt} ({config.num_rows * config.row_bytes / 2**30:.2f} GiB of rows)", flush=True)
        make_random_checkpoint(ckpt, config, seed=0)
    shards = sorted(ckpt.glob("*.safetensors"))
    shard = max(shards, key=lambda p: p.stat().st_size)
    data_bytes = config.num_rows * config.row_bytes
    facts = machine_facts(shard)
    shm = Path(tempfile.mkdtemp(prefix="engram-bench-", dir="/dev/shm")) / "segments"
    raw: dict[str, list[Any]] = {"fio_qd1": [], "fio_qd8": [], "fixed": [], "index": [], "convert": [], "verify": [],
                                 "opens_checkpoint": [], "opens_table": []}
    try:
        for rep in range(args.repeats):
            for depth in (1, 8):
                r = run_fio(shard, rw="read", bs="1M", iodepth=depth, engine="psync" if depth == 1 else "io_uring")
                raw[f"fio_qd{depth}"].append(r)
            fio_rate = max(raw["fio_qd1"][-1]["bytes_per_s"], raw["fio_qd8"][-1]["bytes_per_s"])
            print(f"[{rep}] fio sequential: {fio_rate / 1e9:.2f} GB/s", flush=True)
            wall, _, cpu = timed([*CLI, "--version"])
            raw["fixed"].append({"wall_s": wall, "cpu_s": cpu})
            (ckpt / "engram-offload.index").unlink(missing_ok=True)
            evict(shards)
            wall, out, cpu = timed([*CLI, "index", str(ckpt), "--no-progress"])
            passed = float(out.split(" read in ")[1].split(" s")[0])
            raw["index"].append({"wall_s": wall, "cpu_s": cpu, "pass_s": passed, "bytes_per_s": data_bytes / wall,
                                 "pass_bytes_per_s": data_bytes / passed, "vs_fio": data_bytes / passed / fio_rate,
                                 "wall_vs_fio": data_bytes / wall / fio_rate})
            evict(shards)
            table.unlink(missing_ok=True)
            wall, _, cpu = timed([*CLI, "convert", str(ckpt), "--out", str(table), "--no-progress"])
            raw["convert"].append({"wall_s": wall, "cpu_s": cpu, "bytes_per_s": data_bytes / wall,
                                   "vs_fio": data_bytes / wall / fio_rate})
            evict([table])
            wall, _, cpu = timed([*CLI, "verify", str(table), "--no-progress"])
            raw["verify"].append({"wall_s": wall, "cpu_s": cpu, "bytes_per_s": table.stat().st_size / wall})
            print(f"[{rep}] index {raw['index'][-1]['wall_s']:.1f} s ({raw['index'][-1]['vs_fio']:.2f}x fio in its "
                  f"pass), convert {raw['convert'][-1]['wall_s']:.1f} s, verify {wall:.1f} s", flush=True)
            raw["opens_checkpoint"].append(opens(ckpt, shards, shm))
            raw["opens_table"].append(opens(table, [table], shm))
            for name in ("checkpoint", "table"):
                print(f"[{rep}] {name} opens to the first row: " + ", ".join(
                    f"{k} {v['wall_s']:.1f} s" for k, v in raw[f"opens_{name}"][-1].items()), flush=True)
        reads = random_reads(ckpt, table, shard, args.seconds, max(1, args.repeats - 1))
    finally:
        shutil.rmtree(shm.parent, ignore_errors=True)
    fio_best = max(median_of(raw["fio_qd1"])["bytes_per_s"], median_of(raw["fio_qd8"])["bytes_per_s"])
    start = {name: median_of(raw[name]) for name in ("index", "convert", "verify")}
    start["fixed_s"] = median_of(raw["fixed"])["wall_s"]
    start["fixed_cpu_s"] = median_of(raw["fixed"])["cpu_s"]
    # CPU a GB of each pass, less the command's start: what one core sustains on an idle machine
    start["cpu_s_per_gb"] = {k: (start[k]["cpu_s"] - start["fixed_cpu_s"]) / (data_bytes / 1e9)
                             for k in ("index", "convert", "verify")}
    start["opens"] = {name: {tier: median_of([r[tier] for r in raw[f"opens_{name}"]]) for tier in raw[f"opens_{name}"][0]}
                      for name in ("checkpoint", "table")}
    start["sidecar_bytes"] = (ckpt / "engram-offload.index").stat().st_size
    start["pipelines_s"] = {
        "index_then_first_row_direct": start["index"]["wall_s"] + start["opens"]["checkpoint"]["direct_scales_loader"]["wall_s"],
        "convert_verify_then_first_row_direct": start["convert"]["wall_s"] + start["verify"]["wall_s"]
        + start["opens"]["table"]["direct_scales_read"]["wall_s"],
    }
    result = {
        "machine": facts, "loadavg_after": os.getloadavg(), "shared_machine": True, "scale": args.scale,
        "rows": config.num_rows, "data_bytes": data_bytes, "shards": {p.name: p.stat().st_size for p in shards},
        "fio_sequential_bytes_per_s": fio_best, "startup": start, "random_reads": reads,
        "extrapolated_v41_flash": extrapolate(start, data_bytes, fio_best),
        "raw": raw,
    }
    write_json_atomic(args.out, result)
    print(json.dumps({k: result[k] for k in ("fio_sequential_bytes_per_s", "extrapolated_v41_flash")}, indent=2))
    print(json.dumps({"index": start["index"], "convert": start["convert"], "pipelines_s": start["pipelines_s"],
                      "random_reads": {k: reads[k] for k in ("vs_fio_reads", "resident_vs_read")}}, indent=2))
    print(f"wrote {args.out}")
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
