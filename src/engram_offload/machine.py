"""Facts about the machine a benchmark ran on, stored beside every result."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
