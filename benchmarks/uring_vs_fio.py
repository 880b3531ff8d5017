"""Random O_DIRECT reads: UringReader against fio's io_uring engine.

Side by side in one run, repeated (default 3x), reporting medians:

* fio: ``--ioengine=io_uring --direct=1 --rw=randread --bs=<size> --iodepth=128``
  (time based), IOPS and CPU time per I/O from fio's usr/sys CPU figures;
* UringReader: random block-aligned reads of the same size at the same queue
  depth, issued in batches of ``--batch`` reads per ``read()`` call; reads/s
  and process CPU time (user + system) per read.

Read sizes default to 4096 (the fio reference), 1024 and 512 bytes (what a
tier serving 264-byte rows issues).  The data file (default 2 GiB) is created
under /tmp if absent and reused afterwards; its page cache is dropped before
every measurement.

    python benchmarks/uring_vs_fio.py --out benchmarks/results/uring_vs_fio.json
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time
from typing import Any

import numpy as np

from engram_offload.atomic import write_json_atomic
from engram_offload.bench.cold import evict_file_pages
from engram_offload.tiers import uring

from fio import machine_facts, run_fio

DEFAULT_FILE = "/tmp/engram_offload_uring_bench.bin"


def ensure_file(path: str, size: int) -> None:
    """Creates `path` with `size` bytes of real (non-sparse) data unless present."""
    if os.path.exists(path) and os.path.getsize(path) >= size:
        return
    chunk = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        written = 0
        while written < size:
            n = min(len(chunk), size - written)
            f.write(chunk[:n])
            written += n
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


def run_ours(path: str, bs: int, iodepth: int, runtime: float, batch: int,
             wait_batch: int, setup_flags: int) -> dict[str, float]:
    size = os.path.getsize(path)
    align = max(bs, 512) if bs <= 4096 else 4096
    nblocks = size // align - 1
    rng = np.random.default_rng(bs)
    # Offsets are generated up front so the timed loop measures only I/O.
    pool = [rng.integers(0, nblocks, batch).astype(np.int64) * align for _ in range(32)]
    dest = aligned_empty(batch * bs)
    dest_offsets = np.arange(batch, dtype=np.int64) * bs
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with uring.UringReader(fd, queue_depth=iodepth, setup_flags=setup_flags) as reader:
            reader.read(pool[0][:256], bs, dest, dest_offsets[:256])  # warm up
            calls0 = reader.syscalls
            reads = 0
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            i = 0
            while True:
                reader.read(pool[i % len(pool)], bs, dest, dest_offsets, wait_batch=wait_batch)
                reads += batch
                i += 1
                if time.perf_counter() - t0 >= runtime:
                    break
            wall = time.perf_counter() - t0
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            calls = reader.syscalls - calls0
    finally:
        os.close(fd)
    usr = ru1.ru_utime - ru0.ru_utime
    sys_ = ru1.ru_stime - ru0.ru_stime
    return {
        "reads_per_s": reads / wall,
        "cpu_us_per_read": (usr + sys_) / reads * 1e6,
        "usr_us_per_read": usr / reads * 1e6,
        "sys_us_per_read": sys_ / reads * 1e6,
        "reads_per_syscall": reads / max(calls, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default=DEFAULT_FILE)
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--sizes", default="4096,1024,512", help="read sizes in bytes")
    ap.add_argument("--iodepth", type=int, default=128)
    ap.add_argument("--runtime", type=int, default=10, help="seconds per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4096, help="reads per UringReader.read() call")
    ap.add_argument("--wait-batch", type=int, default=-1, help="completions awaited per syscall")
    ap.add_argument("--setup-flags", type=int, default=-1, help="IORING_SETUP_* (-1: automatic)")
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--out", default=None, help="write results JSON here")
    args = ap.parse_args(argv)

    if not uring.available():
        print(f"UringReader unavailable: {uring.unavailable_reason()}", file=sys.stderr)
        return 2
    fio = None if args.no_fio else shutil.which("fio")
    if not args.no_fio and fio is None:
        print("fio not found (apt-get install fio); use --no-fio to skip it", file=sys.stderr)
        return 2

    ensure_file(args.file, int(args.size_gib * (1 << 30)))
    sizes = [int(s) for s in args.sizes.split(",")]
    raw: dict[int, dict[str, list[dict[str, float]]]] = {bs: {"fio": [], "ours": []} for bs in sizes}
    for rep in range(args.repeats):
        for bs in sizes:
            if fio:
                r = run_fio(args.file, bs=bs, iodepth=args.iodepth, seconds=args.runtime)
                raw[bs]["fio"].append(r)
                print(f"[{rep}] fio  bs={bs:5d}: {r['iops']:10.0f} IOPS  {r['cpu_us_per_read']:.2f} us CPU/read", flush=True)
            evict_file_pages(args.file)
            r = run_ours(args.file, bs, args.iodepth, args.runtime, args.batch, args.wait_batch, args.setup_flags)
            raw[bs]["ours"].append(r)
            print(f"[{rep}] ours bs={bs:5d}: {r['reads_per_s']:10.0f} reads/s {r['cpu_us_per_read']:.2f} us CPU/read "
                  f"({r['reads_per_syscall']:.1f} reads/syscall)", flush=True)

    summary: dict[str, Any] = {}
    for bs in sizes:
        ours_rps = statistics.median(r["reads_per_s"] for r in raw[bs]["ours"])
        entry: dict[str, Any] = {
            "ours_reads_per_s": ours_rps,
            "ours_cpu_us_per_read": statistics.median(r["cpu_us_per_read"] for r in raw[bs]["ours"]),
            "ours_reads_per_syscall": statistics.median(r["reads_per_syscall"] for r in raw[bs]["ours"]),
        }
        if raw[bs]["fio"]:
            fio_iops = statistics.median(r["iops"] for r in raw[bs]["fio"])
            entry["fio_iops"] = fio_iops
            entry["fio_cpu_us_per_read"] = statistics.median(r["cpu_us_per_read"] for r in raw[bs]["fio"])
            entry["ratio_vs_fio"] = ours_rps / fio_iops
            # The ratio of each adjacent (fio, ours) pair is less sensitive to
            # drift in a shared or virtual device's throughput.
            entry["ratio_vs_fio_paired_median"] = statistics.median(
                o["reads_per_s"] / f["iops"] for o, f in zip(raw[bs]["ours"], raw[bs]["fio"])
            )
        summary[str(bs)] = entry
        print(f"median bs={bs}: " + ", ".join(f"{k}={v:.3f}" for k, v in entry.items()))

    result = {
        "benchmark": "uring_vs_fio",
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "fio_command": "fio --name=randread --filename=F --ioengine=io_uring --direct=1 --rw=randread "
                       f"--bs=<size> --iodepth={args.iodepth} --readonly --output-format=json "
                       f"--runtime={args.runtime} --time_based",
        "machine": machine_facts(args.file),
        "params": {
            "file_size_bytes": os.path.getsize(args.file),
            "iodepth": args.iodepth,
            "runtime_s": args.runtime,
            "repeats": args.repeats,
            "batch": args.batch,
            "wait_batch": args.wait_batch,
            "setup_flags": args.setup_flags,
        },
        "targets": {"ratio_vs_fio_min": 0.85, "cpu_us_per_read_max": 3.0},
        "median": summary,
        "runs": {str(bs): raw[bs] for bs in sizes},
    }
    if args.out:
        write_json_atomic(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
