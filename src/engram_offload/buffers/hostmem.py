"""Host memory the GPU reads directly: registration, UVA views, and a coherence check.

- ``register_host(tensor)`` page-locks the pages under a CPU tensor in place
  (``cudaHostRegister``, mapped and portable), so a ``memory``, ``mmap`` or shared-memory
  table becomes GPU-readable without a second copy; ``close()`` unregisters it.
- ``uva_view(tensor)`` is a CUDA tensor over the same bytes (the device address of pinned
  memory), for torch ops; Triton kernels also accept the pinned CPU tensor itself.
- ``uva_coherent()`` writes through host memory and reads through a UVA view. It fails
  closed: any error or mismatch means False, and UVA must not be used (confidential-computing
  GPUs can hand out memory that looks pinned but is not shared with the device).
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from typing import SupportsInt

import torch

__all__ = ["page_span", "register_host", "HostRegistration", "uva_view", "uva_coherent"]

PAGE = mmap.PAGESIZE
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_MAPPED = 0x02
HOST_REGISTER_READ_ONLY = 0x08


def page_span(address: int, nbytes: int, page: int = PAGE) -> tuple[int, int]:
    """The whole pages ``(start, length)`` covering ``nbytes`` at ``address``."""
    if nbytes <= 0:
        raise ValueError(f"nothing to register: {nbytes} bytes")
    start = address - address % page
    end = -(-(address + nbytes) // page) * page
    return start, end - start


def _byte_span(tensor: torch.Tensor) -> int:
    """Bytes from the tensor's first element to just past its last (any strides >= 0)."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA device, and none is available")


def _check_cuda(code: SupportsInt, call: str) -> None:
    """Raise naming ``call`` unless ``code`` (a ``cudaError`` or its int value) is success."""
    value = int(getattr(code, "value", code))
    if value != 0:
        message = torch.cuda.cudart().cudaGetErrorString(code)
        raise RuntimeError(f"{call} failed: {message} (error {value})")


@dataclass
class HostRegistration:
    """Pages of host memory registered with CUDA; unregistered by ``close()`` or on exit of ``with``."""

    tensor: torch.Tensor
    start: int
    length: int
    open: bool = True

    def close(self) -> None:
        if self.open:
            self.open = False
            _check_cuda(torch.cuda.cudart().cudaHostUnregister(self.start), "cudaHostUnregister")

    def __enter__(self) -> "HostRegistration":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register_host(tensor: torch.Tensor, *, read_only: bool = False) -> HostRegistration:
    """Page-lock the whole pages under CPU ``tensor`` in place and map them for the GPU.

    ``read_only`` registers memory that is mapped read-only (a table file opened for reading).
    Keep the returned registration (and the tensor) alive while the GPU reads the table.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"register_host takes a CPU tensor, got one on {tensor.device}")
    nbytes = _byte_span(tensor)
    start, length = page_span(tensor.data_ptr(), nbytes)
    _require_cuda("register_host")
    if tensor.is_pinned():
        raise ValueError("this tensor's memory is already pinned; use it as it is")
    flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED | (HOST_REGISTER_READ_ONLY if read_only else 0)
    _check_cuda(torch.cuda.cudart().cudaHostRegister(start, length, flags), "cudaHostRegister")
    return HostRegistration(tensor, start, length)


def _device_pointer(host_pointer: int) -> int:
    """The device address of pinned (or registered) host memory (``cuMemHostGetDevicePointer``)."""
    driver = ctypes.CDLL("libcuda.so.1")
    pointer = ctypes.c_uint64(0)
    status = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), ctypes.c_void_p(host_pointer), 0)
    if status != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed (CUresult {status}): is the memory pinned?")
    return pointer.value


class _DeviceArray:
    """Exposes device memory to ``torch.as_tensor`` and keeps the host tensor alive with the view."""

    def __init__(self, host: torch.Tensor, pointer: int) -> None:
        self.host = host
        typestr = {torch.uint8: "|u1", torch.int8: "|i1", torch.int16: "<i2", torch.int32: "<i4",
                   torch.int64: "<i8", torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8"}
        if host.dtype not in typestr:
            raise ValueError(f"uva_view supports {list(typestr)}, got {host.dtype} (view it as uint8)")
        size = host.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "strides": tuple(s * size for s in host.stride()),
            "typestr": typestr[host.dtype],
            "data": (pointer, False),
            "version": 3,
        }


def uva_view(tensor: torch.Tensor, device: torch.device | str | int | None = None) -> torch.Tensor:
    """A CUDA tensor over the bytes of a pinned (or registered) CPU ``tensor``: no copy."""
    if tensor.device.type != "cpu":
        raise ValueError(f"uva_view takes a pinned CPU tensor, got one on {tensor.device}")
    _require_cuda("uva_view")
    if not tensor.is_pinned():
        raise ValueError("uva_view needs pinned memory: pin the tensor or register_host() it first")
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        torch.cuda.init()
        pointer = _device_pointer(tensor.data_ptr())
        return torch.as_tensor(_DeviceArray(tensor, pointer), device="cuda")


def uva_coherent(device: torch.device | str | int | None = None, nbytes: int = 1 << 20) -> bool:
    """Whether bytes written by the host are what the GPU reads through a UVA view. Fails closed."""
    if not torch.cuda.is_available():
        return False
    try:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for round_ in range(2):  # two patterns, so stale bytes cannot pass
            pattern = (torch.arange(nbytes, dtype=torch.int64) * (31 + 2 * round_) + round_) % 251
            host.copy_(pattern.to(torch.uint8))
            seen = uva_view(host, device).clone().cpu()
            if not torch.equal(seen, host):
                return False
        return True
    except Exception:  # noqa: BLE001 - any failure means UVA is not safe to use
        return False
