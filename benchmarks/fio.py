"""fio, the reference the storage benchmarks compare with, and the machine facts they record."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

from engram_offload.bench.cold import evict_file_pages
from engram_offload.machine import machine_facts as package_machine_facts


def fio_version() -> str | None:
    """``fio --version``, or None when fio is not installed."""
    if not shutil.which("fio"):
        return None
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()


def machine_facts(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The package's machine facts (of the drive holding ``path``) and fio's version."""
    return {**package_machine_facts(path), "fio": fio_version()}


def run_fio(path: str | os.PathLike[str], *, rw: str = "randread", bs: int | str = "4k", iodepth: int = 128,
            seconds: float | None = None, engine: str = "io_uring") -> dict[str, Any] | None:
    """One fio job reading ``path`` with O_DIRECT from a cold page cache, ``seconds`` long
    (None: the whole file once); None when fio is not installed. Returns its reads/s
    (``iops``), ``bytes_per_s``, ``seconds``, CPU a read (all, user, kernel), mean latency
    and the command line."""
    if not shutil.which("fio"):
        return None
    evict_file_pages(path)
    cmd = ["fio", f"--name={rw}", f"--filename={path}", f"--ioengine={engine}", "--direct=1", f"--rw={rw}",
           f"--bs={bs}", f"--iodepth={iodepth}", "--readonly", "--output-format=json"]
    if seconds is not None:
        cmd += [f"--runtime={seconds:g}", "--time_based"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    read = job["read"]
    ios, runtime = read["total_ios"], read["runtime"] / 1e3
    user_s, kernel_s = job["usr_cpu"] / 100 * runtime, job["sys_cpu"] / 100 * runtime
    per_read = 1e6 / ios if ios else float("nan")
    return {"iops": read["iops"], "bytes_per_s": read["bw_bytes"], "seconds": runtime,
            "cpu_us_per_read": (user_s + kernel_s) * per_read, "user_cpu_us_per_read": user_s * per_read,
            "kernel_cpu_us_per_read": kernel_s * per_read, "lat_mean_us": read["lat_ns"]["mean"] / 1e3,
            "command": " ".join(cmd)}
