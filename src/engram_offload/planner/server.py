"""The server around the GPUs: host DRAM, NVMe drives, PCIe generation, host cores.

A GPU preset (``hardware.GPUS``) carries its reference server (a DGX, an NVL72 tray). An
operator's server differs: ``server_for`` starts from a server preset (``dgx``: the GPU's
own reference server; ``pcie``: a generic 2-socket PCIe Gen5 GPU server), then a JSON file
of the same keys, then single figures (the ``plan`` flags), and says for every figure
whether it was given or assumed, and by what.

Keys (JSON and, with dashes, ``plan``'s flags): ``gpus_per_server``, ``host_dram`` (per
server; a size, ``1T``), ``nvme_drives``, ``nvme_iops`` (each drive's 4 KiB random
reads/s), ``nvme_bytes_per_s`` (each drive's read bandwidth), ``nvme_capacity`` (each
drive's), ``nvme_latency_us``, ``pcie`` (the host link's generation, x16), ``host_cores``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from ..table.safeio import parse_json, read_input
from ..units import parse_size
from .hardware import GB, PCIE_GEN5_X16, PCIE_GEN6_X16, TB, GpuSpec

__all__ = ["SERVER_KEYS", "SERVER_PRESETS", "ServerFigure", "load_server_file", "server_for"]

PCIE_X16 = {4: PCIE_GEN5_X16 / 2, 5: PCIE_GEN5_X16, 6: PCIE_GEN6_X16}  # bytes/s per direction

SERVER_KEYS = ("gpus_per_server", "host_dram", "nvme_drives", "nvme_iops", "nvme_bytes_per_s", "nvme_capacity",
               "nvme_latency_us", "pcie", "host_cores")

# A generic 2-socket PCIe Gen5 server with 8 GPUs (ASSUMED, a typical build, not a product):
# 1 TiB of DDR5, 4 x 7.68 TB Gen4 U.2 NVMe data drives of the DGX Hopper drives' class
# (Kioxia CM6: 1.4M 4 KiB reads/s, 6.9 GB/s), 2 x 32 cores.
_PCIE_SERVER: dict[str, Any] = {
    "gpus_per_server": 8, "host_dram": 2**40, "nvme_drives": 4, "nvme_iops": 1.4e6, "nvme_bytes_per_s": 6.9 * GB,
    "nvme_capacity": 7.68 * TB, "nvme_latency_us": 80.0, "pcie": 5, "host_cores": 64,
}
SERVER_PRESETS = {
    "dgx": "the GPU preset's reference server (DGX for H100-B300, NVL72 tray for GB200/GB300)",
    "pcie": "a generic 2-socket PCIe Gen5 server: 8 GPUs, 1 TiB DRAM, 4 x 7.68 TB Gen4 NVMe, 64 cores (assumed)",
}


@dataclass(frozen=True)
class ServerFigure:
    """One figure of the server and where it came from (``given``: by the operator)."""

    key: str
    value: float
    text: str
    given: bool
    source: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _of_gpu(gpu: GpuSpec) -> dict[str, Any]:
    """The server figures a GPU preset carries."""
    pcie = next((g for g, bw in PCIE_X16.items() if "PCIe" in gpu.host_link and bw == gpu.host_link_bw), 0)
    return {"gpus_per_server": gpu.gpus_per_server, "host_dram": gpu.host_dram_per_gpu * gpu.gpus_per_server,
            "nvme_drives": gpu.nvme_drives, "nvme_iops": gpu.nvme_iops_per_drive,
            "nvme_bytes_per_s": gpu.nvme_bw_per_drive, "nvme_capacity": gpu.nvme_capacity_per_drive,
            "nvme_latency_us": gpu.nvme_latency_us, "pcie": pcie, "host_cores": gpu.host_cores}


def _number(key: str, value: Any) -> float:
    """A figure as a number: sizes and rates take the unit parser (``1T``, ``6.9G``)."""
    if isinstance(value, bool):
        raise ValueError(f"server figure {key}: {value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        if not (isinstance(value, str) and key in ("host_dram", "nvme_capacity", "nvme_bytes_per_s")):
            raise ValueError(f"server figure {key}: {value!r} is not a number") from None
        number = float(parse_size(value))
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"server figure {key}: {value!r} must be a finite number >= 0")
    return number


# the largest value each figure may take: far beyond any machine, so that none overflows a plan
_MOST = {"gpus_per_server": 4096, "host_dram": 2**60, "nvme_drives": 4096, "nvme_iops": 1e10,
         "nvme_bytes_per_s": 1e13, "nvme_capacity": 2**60, "nvme_latency_us": 1e8, "pcie": 6, "host_cores": 2**20}


def _check(key: str, value: float) -> float:
    if key in ("gpus_per_server", "host_cores") and (value < 1 or value != int(value)):
        raise ValueError(f"server figure {key} must be a whole number >= 1, got {value:g}")
    if key == "nvme_drives" and value != int(value):
        raise ValueError(f"server figure nvme_drives must be a whole number, got {value:g}")
    if value > _MOST[key]:
        raise ValueError(f"server figure {key} must be at most {_MOST[key]:,g}, got {value:g}")
    if key == "pcie" and value not in PCIE_X16:
        raise ValueError(f"server figure pcie must be a PCIe generation: {', '.join(map(str, PCIE_X16))}; "
                         f"got {value:g}")
    if key in ("nvme_iops", "nvme_bytes_per_s", "nvme_latency_us", "host_dram") and value <= 0:
        raise ValueError(f"server figure {key} must be > 0, got {value:g}")
    return value


def load_server_file(path: str | Path) -> dict[str, Any]:
    """A server description: a JSON object of ``SERVER_KEYS`` (and ``preset``)."""
    path = Path(path)
    try:
        data = parse_json(read_input(path, "server file"), str(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"no server file at {path}: give a JSON object, e.g. "
                                '{"host_dram": "1T", "nvme_drives": 4}') from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a server file holds one JSON object of figures, e.g. {{\"host_dram\": \"1T\"}}")
    unknown = sorted(set(data) - set(SERVER_KEYS) - {"preset"})
    if unknown:
        raise ValueError(f"{path}: unknown server figure(s) {', '.join(unknown)}; known: preset, {', '.join(SERVER_KEYS)}")
    return data


def _text(key: str, value: float) -> str:
    if key in ("host_dram", "nvme_capacity"):
        return f"{value / 2**40:.2f} TiB" if value >= 2**40 else f"{value / 2**30:.0f} GiB"
    if key == "nvme_iops":
        return f"{value / 1e6:.2f}M reads/s a drive"
    if key == "nvme_bytes_per_s":
        return f"{value / 1e9:.1f} GB/s a drive"
    if key == "nvme_latency_us":
        return f"{value:g} us"
    if key == "pcie":
        return f"Gen{value:g} x16" if value else "not PCIe"
    return f"{value:g}"


def server_for(gpu: GpuSpec, preset: str = "dgx", file: Mapping[str, Any] | None = None,
               given: Mapping[str, Any] | None = None) -> tuple[GpuSpec, list[ServerFigure]]:
    """``gpu`` in the server described by ``preset``, then ``file``'s figures, then ``given``
    (None values are not given), and every figure with its source."""
    file = dict(file or {})
    preset = str(file.pop("preset", preset) if preset == "dgx" else preset)
    if preset not in SERVER_PRESETS:
        raise ValueError(f"unknown server preset {preset!r}; choose one of: {', '.join(SERVER_PRESETS)}, "
                         "or give a JSON file of figures")
    base = _of_gpu(gpu) if preset == "dgx" else _PCIE_SERVER
    base_source = f"assumed: {gpu.server} ({gpu.name} preset)" if preset == "dgx" else "assumed: generic PCIe server"
    values: dict[str, float] = {}
    figures: list[ServerFigure] = []
    for key in SERVER_KEYS:
        value, source, was_given = float(base[key]), base_source, False
        if key in file:
            value, source, was_given = _check(key, _number(key, file[key])), "given: server file", True
        if given and given.get(key) is not None:
            value, source, was_given = _check(key, _number(key, given[key])), "given: flag", True
        values[key] = value
        figures.append(ServerFigure(key, value, _text(key, value), was_given, source))
    n = int(values["gpus_per_server"])
    out = replace(
        gpu, gpus_per_server=n, host_dram_per_gpu=values["host_dram"] / n, nvme_drives=int(values["nvme_drives"]),
        nvme_iops_per_drive=values["nvme_iops"], nvme_bw_per_drive=values["nvme_bytes_per_s"],
        nvme_capacity_per_drive=values["nvme_capacity"], nvme_latency_us=values["nvme_latency_us"],
        host_cores=int(values["host_cores"]), server=gpu.server if preset == "dgx" else "generic PCIe server",
    )
    pcie = int(values["pcie"])
    if pcie and (preset != "dgx" or any(f.key == "pcie" and f.given for f in figures)):
        out = replace(out, host_link=f"PCIe Gen{pcie} x16", host_link_bw=PCIE_X16[pcie])
    return out, figures
