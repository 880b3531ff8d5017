"""Facts about the machine: those stored beside every benchmark result, and checks of free
memory and disk made before committing to a large allocation or write."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .errors import EngramError
from .units import format_bytes


class NotEnoughResources(EngramError):
    """The machine lacks the free memory or disk an operation needs (and it was not forced)."""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_id() -> str | None:
    """The CPU's family, model and stepping (``/proc/cpuinfo``), e.g. "family 25 model 1
    stepping 1": the model name of a VM's CPU often names only its maker."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("cpu family", "model", "stepping") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
    except OSError:
        return None
    if "cpu family" not in fields:
        return None
    return " ".join(f"{k.removeprefix('cpu ')} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields)


CPU_FLAGS = ("sse4_2", "avx", "avx2", "bmi2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "amx_tile", "hypervisor")  # what the native kernels and the fetch path's speed depend on


def _cpu_flags() -> list[str]:
    """Which of ``CPU_FLAGS`` the CPU has (``/proc/cpuinfo``; empty where it is not readable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in CPU_FLAGS if f in have]
    except OSError:
        pass
    return []


def _meminfo(key: str) -> int | None:
    """A ``/proc/meminfo`` figure in bytes (``MemTotal``, ``MemAvailable``), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_bytes() -> int | None:
    return _meminfo("MemTotal")


def available_memory_bytes() -> int | None:
    """Memory the kernel can give a new allocation without swapping (``MemAvailable``), or
    None where the system does not say."""
    return _meminfo("MemAvailable")


def free_disk_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still write on the file system holding ``path`` (a
    file or directory; a path not yet created is looked up by its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def check_free_memory(need: int, what: str, *, force: bool = False, flag: str = "--force") -> int | None:
    """Raise ``NotEnoughResources`` when ``need`` bytes exceed ``MemAvailable``; return what is
    available (None where unknown: nothing is checked). ``force`` only skips the refusal."""
    available = available_memory_bytes()
    if available is not None and need > available and not force:
        raise NotEnoughResources(
            f"{what} needs {format_bytes(need)} of memory, only {format_bytes(available)} is "
            f"available: free memory, choose something smaller, or pass {flag} to try anyway"
        )
    return available


def check_free_disk(path: str | os.PathLike[str], need: int, what: str, *, force: bool = False,
                    flag: str = "--force") -> int:
    """Raise ``NotEnoughResources`` when ``need`` bytes exceed the free space where ``path``
    lives; return the free bytes. ``force`` only skips the refusal."""
    free = free_disk_bytes(path)
    if need > free and not force:
        raise NotEnoughResources(
            f"{what} needs {format_bytes(need)} of disk, only {format_bytes(free)} is free on the "
            f"file system of {path}: free space, write elsewhere, or pass {flag} to try anyway"
        )
    return free


def _block_device(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The block device under ``path``: its name, and queue facts from sysfs where readable."""
    if path is None:
        return None
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    disk: dict[str, Any] = {"device": f"{os.major(dev)}:{os.minor(dev)}"}
    try:
        name = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve().name
        disk["name"] = name
        queue = Path(f"/sys/block/{name}/queue")
        for key in ("rotational", "logical_block_size", "scheduler", "nr_requests"):
            if (queue / key).exists():
                disk[key] = (queue / key).read_text().strip()
        model = Path(f"/sys/block/{name}/device/model")
        if model.exists():
            disk["model"] = model.read_text().strip()
    except OSError:
        pass
    try:
        out = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True,
                             text=True, timeout=5, check=True).stdout.split("\n")[1]
        disk["filesystem"] = " ".join(out.split())
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return disk


def machine_facts(data_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """CPU, cores, memory, load, kernel, library versions and (given a path) its disk and file system."""
    import numpy
    import torch

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cpu_id": _cpu_id(),
        "cpu_flags": _cpu_flags(),
        "cores": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "memory_bytes": _memory_bytes(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "data_device": _block_device(data_path),
    }
