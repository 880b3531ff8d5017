"""N processes attaching one shared segment: every page checked by each (before the seal) vs
the seal and a sample of pages (after).

    nice python benchmarks/bench_shared_attach.py [--table T.table | --scale 0.011] [--processes 8] \\
        [--repeats 3] [--out benchmarks/results/shared_attach.json]

The table is ``--table``, or one of ``--scale`` of DeepSeek V4.1-Flash written by the project's
table writer to a temporary file (0.011: 2.08 GiB of rows). One process loads it into a segment
in a temporary folder of ``/dev/shm`` (timed, once). Then, for each mode and repeat,
``--processes`` separate processes (spawned: each imports the package on its own) meet at a
barrier and open the table on the ``shared`` tier at once, header read included:

* ``full``: ``verify_attach="full"``, every page against the table's checksums, as each attach
  did before the seal;
* ``sample``: the default, the seal against the file's ``fstat`` and 32 pages.

Reported per mode: the wall time from the barrier to the last process attached, each
process's seconds to open and of those its attach check, and its pages checked, medians over
``--repeats``; the CPU as ``lscpu`` names it. Every wait on a process is bounded (``--timeout``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engram_offload import EngramConfig  # noqa: E402
from engram_offload.atomic import write_json_atomic  # noqa: E402
from engram_offload.machine import machine_facts  # noqa: E402
from engram_offload.table import make_random_table, read_header  # noqa: E402
from engram_offload.tiers import open_tier  # noqa: E402

MODES = {"full": "full", "sample": None}  # mode -> verify_attach (None: the tier's default)


def _attacher(table: str, shm_dir: str, verify_attach: str | None, start: Any, done: Any, answers: Any,
              timeout: float) -> None:
    """A process: wait at ``start``, open the table on the shared tier, answer, hold it until ``done``."""
    options = {} if verify_attach is None else {"verify_attach": verify_attach}
    start.wait(timeout)
    began = time.monotonic()
    try:
        tier = open_tier("shared", read_header(table), shm_dir=shm_dir, progress=False, **options)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        answers.put({"error": f"{type(exc).__name__}: {exc}"})
        return
    with tier:
        ended = time.monotonic()
        stats = tier.stats()
        answers.put({"began": began, "ended": ended, "seconds": ended - began, "loaded_here": stats["loaded_here"],
                     "attach_check": stats["attach_check"], "attach_pages_checked": stats["attach_pages_checked"],
                     "attach_check_seconds": stats["attach_check_seconds"]})
        done.wait(timeout)


def attach_round(table: str, shm_dir: str, mode: str, processes: int, timeout: float) -> dict[str, Any]:
    """``processes`` processes attaching at once in ``mode``: wall seconds to the last, and each one's."""
    ctx = multiprocessing.get_context("spawn")
    start, done, answers = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1), ctx.Queue()
    workers = [ctx.Process(target=_attacher, args=(table, shm_dir, MODES[mode], start, done, answers, timeout),
                           daemon=True) for _ in range(processes)]
    for w in workers:
        w.start()
    try:
        start.wait(timeout)  # every process imported and ready
        each = [answers.get(timeout=timeout) for _ in workers]
        errors = [e["error"] for e in each if "error" in e]
        if errors:
            raise RuntimeError(f"{len(errors)} of {processes} processes could not attach: {errors[0]}")
        done.wait(timeout)
    except BaseException:
        done.abort()  # the processes stop waiting
        raise
    finally:
        for w in workers:
            w.join(timeout)
            if w.is_alive():
                w.kill()
                w.join(5)
    if any(e["loaded_here"] for e in each):
        raise RuntimeError("a process loaded the segment instead of attaching it: it was replaced meanwhile")
    return {"wall_seconds": max(e["ended"] for e in each) - min(e["began"] for e in each),
            "process_seconds": sorted(e["seconds"] for e in each),
            "attach_check_seconds": sorted(e["attach_check_seconds"] for e in each),
            "pages_checked": sorted(e["attach_pages_checked"] for e in each),
            "attach_check": sorted({e["attach_check"] for e in each})}


def lscpu_model() -> str:
    """The CPU's model name as ``lscpu`` gives it."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", help="an existing table (default: one of --scale written to a temporary file)")
    ap.add_argument("--scale", type=float, default=0.011,
                    help="of DeepSeek V4.1-Flash (default 0.011: 2.08 GiB of rows)")
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds any one wait on a process may take")
    ap.add_argument("--out", default="engram-bench/shared_attach.json",
                    help="the results JSON (default engram-bench/shared_attach.json; benchmarks/results/"
                         "shared_attach.json is the committed record: write there only to update it)")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="shared-attach-"))
    shm_dir = Path(tempfile.mkdtemp(prefix="shared-attach-", dir="/dev/shm"))
    try:
        if args.table:
            table = Path(args.table)
        else:
            print(f"writing a table of scale {args.scale} to {scratch}", flush=True)
            table = make_random_table(scratch / "attach.table", EngramConfig.from_name("deepseek-v4.1-flash")
                                      .scaled(args.scale), seed=1)
        layout = read_header(table).layout
        began = time.monotonic()
        with open_tier("shared", read_header(table), shm_dir=str(shm_dir), progress=False) as loader:
            assert loader.loaded
        load_seconds = time.monotonic() - began
        result: dict[str, Any] = {
            "machine": machine_facts(table), "cpu_model_lscpu": lscpu_model(), "args": vars(args),
            "table_rows_bytes": layout.num_rows * layout.row_bytes, "table_pages": layout.num_pages,
            "load_seconds": load_seconds, "modes": {}}
        print(f"table {layout.num_rows * layout.row_bytes / 2**30:.2f} GiB ({layout.num_pages:,} pages), loaded "
              f"and sealed in {load_seconds:.1f} s; CPU {result['cpu_model_lscpu']}", flush=True)
        for mode in MODES:
            rounds = [attach_round(str(table), str(shm_dir), mode, args.processes, args.timeout)
                      for _ in range(args.repeats)]
            result["modes"][mode] = {
                "rounds": rounds, "median_wall_seconds": statistics.median(r["wall_seconds"] for r in rounds),
                "median_process_seconds": statistics.median(s for r in rounds for s in r["process_seconds"]),
                "median_check_seconds": statistics.median(s for r in rounds for s in r["attach_check_seconds"]),
                "pages_checked_per_process": rounds[0]["pages_checked"][0], "attach_check": rounds[0]["attach_check"]}
            walls = ", ".join(f"{r['wall_seconds']:.2f}" for r in rounds)
            print(f"{mode}: {walls} s to attach all {args.processes}", flush=True)
        print(f"\n{args.processes} processes attaching {layout.num_rows * layout.row_bytes / 2**30:.2f} GiB, "
              f"medians of {args.repeats}")
        print(f"{'mode':8s} {'wall s':>9s} {'per process s':>14s} {'its check s':>12s} {'pages each':>12s}")
        for mode, m in result["modes"].items():
            print(f"{mode:8s} {m['median_wall_seconds']:9.3f} {m['median_process_seconds']:14.3f} "
                  f"{m['median_check_seconds']:12.3f} {m['pages_checked_per_process']:12,d}")
        full, sample = (result["modes"][m]["median_wall_seconds"] for m in MODES)
        result["speedup_wall"] = full / sample
        print(f"the seal: {result['speedup_wall']:.0f}x less wall time to attach them all")
        write_json_atomic(Path(args.out), result)
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
