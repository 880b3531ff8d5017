"""Hardware descriptions: one GPU and the server around it, with sources.

Figures are per GPU unless named per server. Bandwidths are per direction, in bytes/s;
FLOPS are dense (no 2:4 sparsity). ``host_link_bw`` is what one GPU can pull from host
DRAM: a PCIe x16 link is capped by the slower end (GPU or host CPU), NVLink-C2C is shared by
the two GPUs of a Grace superchip. Prices are indicative on-demand dollars per GPU-hour and
change often: pass ``--price``. Sources are also tabulated in ``docs/planner.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypedDict

__all__ = ["GpuSpec", "GPUS", "get_gpu", "PCIE_GEN5_X16", "PCIE_GEN6_X16"]

GB = 1e9
TB = 1e12
PCIE_GEN5_X16 = 64 * GB  # 32 GT/s x 16 lanes, 128b/130b: ~63 GB/s per direction (PCI-SIG)
PCIE_GEN6_X16 = 128 * GB  # 64 GT/s PAM4, FLIT mode (PCI-SIG PCIe 6.0)


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator and its share of the server it sits in."""

    name: str
    hbm_bytes: float
    hbm_bw: float
    flops: dict[str, float]  # dense FLOPS by compute precision: bf16, fp8, fp4
    nvlink_bw: float  # GPU-to-GPU, per direction
    host_link: str
    host_link_bw: float  # per GPU, per direction
    host_dram_per_gpu: float
    gpus_per_server: int
    nvme_drives: int  # per server
    nvme_iops_per_drive: float  # 4 KiB random reads
    nvme_bw_per_drive: float
    nvme_capacity_per_drive: float
    price_per_hour: float
    nvme_latency_us: float = 80.0  # 4 KiB random read at low queue depth, TLC NVMe
    # Host CPU cores per server: DGX H100/H200 2 x Xeon Platinum 8480C, DGX B200 2 x Xeon
    # Platinum 8570, 56 cores each (DGX datasheets); DGX B300 2 x Xeon 6776P, 64 each; an
    # NVL72 tray 2 x Grace, 72 Arm cores each; MI355X servers 2 x 64 cores (assumed).
    host_cores: int = 112
    server: str = "DGX"  # the server these per-server figures describe (``planner.server``)
    sources: tuple[str, ...] = ()

    def peak_flops(self, precision: str) -> float:
        """Dense FLOPS at ``precision``, falling back to the next wider one the GPU has."""
        for p in {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16")}.get(precision, ("bf16",)):
            if p in self.flops:
                return self.flops[p]
        raise ValueError(f"{self.name} has no FLOPS figure for {precision}")

    @property
    def nvme_iops_per_server(self) -> float:
        return self.nvme_drives * self.nvme_iops_per_drive

    @property
    def nvme_bytes_per_server(self) -> float:
        return self.nvme_drives * self.nvme_capacity_per_drive

    def with_price(self, price: float | None) -> "GpuSpec":
        if price is None:
            return self
        if price <= 0:
            raise ValueError(f"--price must be a positive dollars-per-GPU-hour figure, got {price}")
        return replace(self, price_per_hour=price)


class _ServerStorage(TypedDict):
    """The NVMe fields of a ``GpuSpec`` that a server family shares, splatted into each spec."""

    nvme_drives: int
    nvme_iops_per_drive: float
    nvme_bw_per_drive: float
    nvme_capacity_per_drive: float


_DGX_HOPPER_STORAGE = _ServerStorage(  # DGX H100/H200: 8x 3.84 TB U.2 NVMe data drives (DGX H100 user guide)
    nvme_drives=8, nvme_iops_per_drive=1.4e6, nvme_bw_per_drive=6.9 * GB,  # Gen4 U.2, e.g. Kioxia CM6
    nvme_capacity_per_drive=3.84 * TB,
)
_DGX_BLACKWELL_STORAGE = _ServerStorage(  # DGX B200/B300: 8x 3.84 TB NVMe data drives (DGX B200/B300 user guides)
    nvme_drives=8, nvme_iops_per_drive=2.5e6, nvme_bw_per_drive=13 * GB,  # Gen5, e.g. Samsung PM1743
    nvme_capacity_per_drive=3.84 * TB,
)
_NVL72_TRAY_STORAGE = _ServerStorage(  # NVL72 compute tray (4 GPUs): 4x E1.S Gen5 assumed (tray allows up to 8)
    nvme_drives=4, nvme_iops_per_drive=2.5e6, nvme_bw_per_drive=13 * GB,
    nvme_capacity_per_drive=3.84 * TB,
)

GPUS: dict[str, GpuSpec] = {
    # nvidia.com/en-us/data-center/h100 (SXM5): 80 GB HBM3, 3.35 TB/s, FP8 1,979 TFLOPS and
    # BF16 989 TFLOPS dense (half the sparse figures), NVLink 900 GB/s; PCIe Gen5 x16 host.
    # DGX H100 datasheet: 2 TB system memory for 8 GPUs.
    "h100": GpuSpec(
        name="H100 SXM", hbm_bytes=80 * GB, hbm_bw=3.35 * TB,
        flops={"bf16": 989e12, "fp8": 1979e12}, nvlink_bw=450 * GB,
        host_link="PCIe Gen5 x16", host_link_bw=PCIE_GEN5_X16, host_dram_per_gpu=2 * TB / 8,
        gpus_per_server=8, price_per_hour=2.99, **_DGX_HOPPER_STORAGE,
        sources=("nvidia.com/en-us/data-center/h100", "DGX H100 datasheet"),
    ),
    # nvidia.com/en-us/data-center/h200: 141 GB HBM3e, 4.8 TB/s, compute as H100.
    # DGX H200 datasheet: 2 TB system memory.
    "h200": GpuSpec(
        name="H200 SXM", hbm_bytes=141 * GB, hbm_bw=4.8 * TB,
        flops={"bf16": 989e12, "fp8": 1979e12}, nvlink_bw=450 * GB,
        host_link="PCIe Gen5 x16", host_link_bw=PCIE_GEN5_X16, host_dram_per_gpu=2 * TB / 8,
        gpus_per_server=8, price_per_hour=3.79, **_DGX_HOPPER_STORAGE,
        sources=("nvidia.com/en-us/data-center/h200", "DGX H200 datasheet"),
    ),
    # HGX B200 (nvidia.com/en-us/data-center/hgx): 1.44 TB HBM3e for 8 GPUs = 180 GB each,
    # 8 TB/s; FP4 9, FP8 4.5, BF16 2.25 PFLOPS dense; NVLink 5 1.8 TB/s. DGX B200: 2 TB
    # memory, Xeon Platinum 8570 hosts (PCIe Gen5).
    "b200": GpuSpec(
        name="B200 (HGX)", hbm_bytes=180 * GB, hbm_bw=8 * TB,
        flops={"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 9e15}, nvlink_bw=900 * GB,
        host_link="PCIe Gen5 x16", host_link_bw=PCIE_GEN5_X16, host_dram_per_gpu=2 * TB / 8,
        gpus_per_server=8, price_per_hour=4.99, **_DGX_BLACKWELL_STORAGE,
        sources=("nvidia.com/en-us/data-center/hgx", "DGX B200 datasheet"),
    ),
    # HGX B300 / Blackwell Ultra (nvidia.com/en-us/data-center/hgx; NVIDIA technical blog
    # "Inside NVIDIA Blackwell Ultra"): 288 GB HBM3e, 8 TB/s, 15 PFLOPS dense FP4; FP8 and
    # BF16 as B200. The GPU links PCIe Gen6 but DGX B300's Xeon 6776P hosts are Gen5, so
    # host reads run at Gen5. DGX B300: 2 TB memory.
    "b300": GpuSpec(
        name="B300 (HGX)", hbm_bytes=288 * GB, hbm_bw=8 * TB,
        flops={"bf16": 2.25e15, "fp8": 4.5e15, "fp4": 15e15}, nvlink_bw=900 * GB,
        host_link="PCIe Gen5 x16 (Gen6 GPU, Gen5 host)", host_link_bw=PCIE_GEN5_X16,
        host_dram_per_gpu=2 * TB / 8, gpus_per_server=8, price_per_hour=6.00, host_cores=128,
        **_DGX_BLACKWELL_STORAGE,
        sources=("nvidia.com/en-us/data-center/hgx", "Inside NVIDIA Blackwell Ultra (NVIDIA blog)",
                 "DGX B300 datasheet"),
    ),
    # GB200 NVL72 (nvidia.com/en-us/data-center/gb200-nvl72): 13.4 TB HBM3e / 72 = 186 GB,
    # 8 TB/s; FP4 10, FP8 5, BF16 2.5 PFLOPS dense per GPU; NVLink-C2C 900 GB/s (450 per
    # direction) per Grace shared by 2 GPUs; 17 TB LPDDR5X / 36 Grace = 480 GB per Grace.
    "gb200": GpuSpec(
        name="GB200 NVL72", hbm_bytes=186 * GB, hbm_bw=8 * TB,
        flops={"bf16": 2.5e15, "fp8": 5e15, "fp4": 10e15}, nvlink_bw=900 * GB,
        host_link="NVLink-C2C (shared by 2 GPUs)", host_link_bw=450 * GB / 2,
        host_dram_per_gpu=480 * GB / 2, gpus_per_server=4, price_per_hour=5.50,
        host_cores=144, server="NVL72 compute tray", **_NVL72_TRAY_STORAGE,
        sources=("nvidia.com/en-us/data-center/gb200-nvl72",),
    ),
    # GB300 NVL72 (nvidia.com/en-us/data-center/gb300-nvl72): 288 GB HBM3e, 8 TB/s, FP4
    # 15 PFLOPS dense; C2C and LPDDR5X per Grace as GB200.
    "gb300": GpuSpec(
        name="GB300 NVL72", hbm_bytes=288 * GB, hbm_bw=8 * TB,
        flops={"bf16": 2.5e15, "fp8": 5e15, "fp4": 15e15}, nvlink_bw=900 * GB,
        host_link="NVLink-C2C (shared by 2 GPUs)", host_link_bw=450 * GB / 2,
        host_dram_per_gpu=480 * GB / 2, gpus_per_server=4, price_per_hour=7.00,
        host_cores=144, server="NVL72 compute tray", **_NVL72_TRAY_STORAGE,
        sources=("nvidia.com/en-us/data-center/gb300-nvl72",),
    ),
    # AMD Instinct MI355X (amd.com/en/products/accelerators/instinct/mi350/mi355x.html):
    # 288 GB HBM3E, 8 TB/s; MXFP4 10, FP8 5, FP16 2.5 PFLOPS dense; Infinity Fabric
    # 7 x 153.6 GB/s; PCIe Gen5 x16 host. 2 TB host memory for 8 GPUs is assumed.
    "mi355x": GpuSpec(
        name="MI355X", hbm_bytes=288 * GB, hbm_bw=8 * TB,
        flops={"bf16": 2.5e15, "fp8": 5e15, "fp4": 10e15}, nvlink_bw=7 * 153.6 * GB / 2,
        host_link="PCIe Gen5 x16", host_link_bw=PCIE_GEN5_X16, host_dram_per_gpu=2 * TB / 8,
        gpus_per_server=8, price_per_hour=3.50, host_cores=128, server="8-GPU OAM server (assumed)",
        **_DGX_BLACKWELL_STORAGE,
        sources=("amd.com Instinct MI355X product page",),
    ),
}
# Prices: indicative on-demand $/GPU-hour from US GPU-cloud list prices (e.g. Lambda and
# CoreWeave pricing pages, 2025-26). They move month to month; use --price.


def get_gpu(name: str) -> GpuSpec:
    """A GPU by name (case-insensitive, 'B300' or 'b300'); the error lists the known ones."""
    key = name.strip().lower().replace(" ", "").replace("-", "")
    try:
        return GPUS[key]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; choose one of: {', '.join(GPUS)}") from None
