"""The direct tier's native row read beside fio, on the same table, in one run.

    nice python benchmarks/bench_native_rows.py --table T.table --repeats 3 --seconds 5 --out R.json

Per repeat: ``fio --ioengine=io_uring --direct=1 --rw=randread --bs=4k --iodepth=Q`` (the
command of ``fio.run_fio``), then the direct tier (``uring`` engine, queue depth
Q) reading batches of random sorted distinct row ids, for each batch size, pages checked,
through the native call and (for reference) the Python steps (the tier's ``native_disabled``
patched for the run: the page checksums still take their C helper). Reports medians of
reads/s (page reads) and CPU us per read (``os.times`` user + system of this process).
``torch.set_num_threads(1)``: the gather of the Python steps would otherwise spin torch's
thread pool.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from engram_offload.atomic import write_json_atomic
from engram_offload.bench.cold import evict_file_pages
from engram_offload.table import read_header
from engram_offload.tiers import direct as direct_module
from engram_offload.tiers import open_tier

sys.path.insert(0, str(Path(__file__).parent))
from fio import run_fio  # noqa: E402


def direct_run(table: Path, seconds: float, queue_depth: int, batch: int, native: bool) -> dict:
    """Batches of ``batch`` random ids for ``seconds``: page reads/s and CPU us per read."""
    evict_file_pages(table)
    rng = np.random.default_rng(batch)
    with open_tier("direct", read_header(table), engine="uring", queue_depth=queue_depth) as t, \
            mock.patch.object(direct_module, "native_disabled", lambda: not native):
        batches = [np.unique(rng.integers(0, t.num_rows, batch)) for _ in range(32)]
        out = torch.empty((batch, t.row_bytes), dtype=torch.uint8)  # [batch, row_bytes]
        before, cpu0, start = t.stats(), os.times(), time.perf_counter()
        i = 0
        while time.perf_counter() - start < seconds:
            ids = batches[i % len(batches)]
            t.read_rows(ids, out[: len(ids)])
            i += 1
        wall, cpu1, after = time.perf_counter() - start, os.times(), t.stats()
    reads = after["reads"] - before["reads"]
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {"reads_per_s": reads / wall, "rows_per_s": (after["rows"] - before["rows"]) / wall,
            "cpu_us_per_read": cpu / reads * 1e6, "pages_checked": after["pages_checked"] - before["pages_checked"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", required=True, help="a table on a file system with O_DIRECT")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    p.add_argument("--queue-depth", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--no-python", action="store_true", help="skip the Python steps (reference)")
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    table, q, s = Path(args.table), args.queue_depth, args.seconds
    configs = [(f"{'native' if native else 'python'}_b{batch}", batch, native)
               for native in ([True] if args.no_python else [True, False]) for batch in args.batches]
    runs: dict[str, list[dict]] = {"fio": [], **{name: [] for name, *_ in configs}}
    for rep in range(args.repeats):
        print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr)
        fio = run_fio(table, iodepth=q, seconds=s)
        if fio:
            runs["fio"].append(fio)
        for name, batch, native in configs:
            runs[name].append(direct_run(table, s, q, batch, native))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    median: dict[str, dict] = {}
    if runs["fio"]:
        median["fio"] = {"reads_per_s": med("fio", "iops"), "cpu_us_per_read": med("fio", "cpu_us_per_read")}
    for name, *_ in configs:
        median[name] = {"reads_per_s": med(name, "reads_per_s"), "cpu_us_per_read": med(name, "cpu_us_per_read")}
        if "fio" in median:
            median[name]["vs_fio_reads"] = median[name]["reads_per_s"] / median["fio"]["reads_per_s"]
            median[name]["vs_fio_cpu"] = median[name]["cpu_us_per_read"] / median["fio"]["cpu_us_per_read"]

    print(f"{'':28} {'reads/s':>10} {'CPU us/read':>12} {'x fio reads':>12} {'x fio CPU':>10}")
    for name, m in median.items():
        print(f"{name:28} {m['reads_per_s']:10,.0f} {m['cpu_us_per_read']:12.2f} "
              f"{m.get('vs_fio_reads', 1.0):12.2f} {m.get('vs_fio_cpu', 1.0):10.2f}")
    if args.out:
        result = {"benchmark": "bench_native_rows",
                  "command": "python benchmarks/bench_native_rows.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "table": str(table), "table_bytes": table.stat().st_size,
                  "params": {"repeats": args.repeats, "seconds": s, "queue_depth": q, "batches": args.batches},
                  "loadavg_end": os.getloadavg(), "median": median, "runs": runs}
        write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
