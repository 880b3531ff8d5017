"""Host memory the GPU reads directly: registration, UVA views, and a coherence check.

- ``register_host(tensor)`` page-locks the pages under a CPU tensor in place
  (``cuMemHostRegister``, mapped and portable, read-only for memory mapped read-only), so a
  ``memory``, ``mmap`` or shared-memory table becomes GPU-readable without a second copy;
  ``close()`` unregisters it. Registration goes through the driver API, whose errors do not
  linger as the runtime's last error for an unrelated torch op to raise. Registrations are
  whole pages, counted per page range (``PageRegistry``): two tensors on one page share it,
  and closing one leaves the other's pages registered.
- ``device_reads_in_place(tensor, device)`` says whether the device can read a host tensor
  in place (UVA coherent, and read-only memory only where the device can register it
  read-only); where not, a store stages rows through pinned buffers instead.
- ``uva_view(tensor)`` is a CUDA tensor over the same bytes (the device address of pinned
  memory), for torch ops; Triton kernels also accept the pinned CPU tensor itself.
- ``uva_coherent()`` writes through host memory and reads through a UVA view. It fails
  closed: any error or mismatch means False, and UVA must not be used (confidential-computing
  GPUs can hand out memory that looks pinned but is not shared with the device).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import mmap
import threading
from dataclasses import dataclass, field
from typing import Callable, SupportsInt

import torch

__all__ = ["page_span", "register_host", "HostRegistration", "PageRegistry", "uva_view", "uva_coherent",
           "mapped_read_only", "read_only_register_supported", "device_reads_in_place"]

PAGE = mmap.PAGESIZE
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_MAPPED = 0x02
HOST_REGISTER_READ_ONLY = 0x08
ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED = 113  # CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED


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


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check_driver(status: int, call: str) -> None:
    """Raise naming ``call`` unless the driver's ``CUresult`` ``status`` is success."""
    if status != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(status, ctypes.byref(text))
        message = text.value.decode() if text.value else "unknown error"
        raise RuntimeError(f"{call} failed: {message} (CUresult {status})")


def _bind_context() -> None:
    """Make the device's primary context current in this thread (driver calls need one)."""
    torch.cuda.init()
    _check_cuda(torch.cuda.cudart().cudaFree(0), "cudaFree(0)")


def _has_driver() -> bool:
    try:
        _driver()
        return True
    except OSError:  # no libcuda (ROCm): the runtime's calls, hipified by torch
        return False


def _driver_register(start: int, length: int, flags: int) -> None:
    _bind_context()
    if not _has_driver():
        _check_cuda(torch.cuda.cudart().cudaHostRegister(start, length, flags), "cudaHostRegister")
        return
    _check_driver(_driver().cuMemHostRegister_v2(ctypes.c_void_p(start), ctypes.c_size_t(length),
                                                 ctypes.c_uint(flags)), "cuMemHostRegister")


def _driver_unregister(start: int) -> None:
    _bind_context()
    if not _has_driver():
        _check_cuda(torch.cuda.cudart().cudaHostUnregister(start), "cudaHostUnregister")
        return
    _check_driver(_driver().cuMemHostUnregister(ctypes.c_void_p(start)), "cuMemHostUnregister")


class PageRegistry:
    """Registered page ranges, disjoint, each counted by the registrations that use it.

    A request for pages ``[start, start + length)`` takes a reference on every registered
    range it overlaps and registers only the pages no range covers yet (the driver refuses
    to register a page twice); a range is unregistered when its last reference goes."""

    def __init__(self, register: Callable[[int, int, int], None] = _driver_register,
                 unregister: Callable[[int], None] = _driver_unregister) -> None:
        self._register, self._unregister = register, unregister
        self._spans: dict[int, list[int]] = {}  # start -> [length, references]
        self._starts: list[int] = []  # sorted starts
        self._lock = threading.Lock()

    def acquire(self, start: int, length: int, flags: int) -> list[int]:
        """Reference the pages ``[start, start + length)`` (registering the uncovered ones);
        returns the starts of the ranges referenced, for ``release``."""
        end = start + length
        with self._lock:
            i = max(0, bisect.bisect_right(self._starts, start) - 1)
            overlapping = [s for s in self._starts[i:] if s < end and s + self._spans[s][0] > start]
            gaps, cursor = [], start
            for s in overlapping:
                if s > cursor:
                    gaps.append((cursor, s - cursor))
                cursor = max(cursor, s + self._spans[s][0])
            if cursor < end:
                gaps.append((cursor, end - cursor))
            done: list[int] = []
            try:
                for s, n in gaps:
                    self._register(s, n, flags)
                    done.append(s)
            except BaseException:
                for s in done:
                    self._unregister(s)
                raise
            for s, n in gaps:
                self._spans[s] = [n, 0]
                bisect.insort(self._starts, s)
            touched = overlapping + [s for s, _ in gaps]
            for s in touched:
                self._spans[s][1] += 1
            return touched

    def release(self, starts: list[int]) -> None:
        """Drop one reference on each range; unregister those no registration uses any more."""
        with self._lock:
            for s in starts:
                span = self._spans[s]
                span[1] -= 1
                if span[1] == 0:
                    del self._spans[s]
                    self._starts.remove(s)
                    self._unregister(s)

    def registered(self) -> list[tuple[int, int, int]]:
        """``(start, length, references)`` of every registered range, by address."""
        with self._lock:
            return [(s, self._spans[s][0], self._spans[s][1]) for s in self._starts]


PAGES = PageRegistry()  # the process's registrations


@dataclass
class HostRegistration:
    """Pages of host memory registered with CUDA; unregistered by ``close()`` or on exit of
    ``with`` (pages another registration still uses stay registered)."""

    tensor: torch.Tensor
    start: int
    length: int
    open: bool = True
    spans: list[int] = field(default_factory=list)  # the page ranges referenced in ``registry``
    registry: PageRegistry | None = None

    def close(self) -> None:
        if self.open:
            self.open = False
            (self.registry or PAGES).release(self.spans)

    def __enter__(self) -> "HostRegistration":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register_host(tensor: torch.Tensor, *, read_only: bool | None = None,
                  registry: PageRegistry | None = None) -> HostRegistration:
    """Page-lock the whole pages under CPU ``tensor`` in place and map them for the GPU.

    ``read_only`` registers memory mapped read-only (a table file or shared segment opened
    for reading); ``None`` looks at the mapping. Read-only memory on a device that cannot
    register it read-only raises (read such a table through staging buffers instead).
    ``registry``: where the pages are counted (default: the process's, over the driver).
    Keep the returned registration (and the tensor) alive while the GPU reads the table.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"register_host takes a CPU tensor, got one on {tensor.device}")
    nbytes = _byte_span(tensor)
    start, length = page_span(tensor.data_ptr(), nbytes)
    if registry is None:
        _require_cuda("register_host")
        if tensor.is_pinned():
            raise ValueError("this tensor's memory is already pinned; use it as it is")
    if read_only is None:
        read_only = mapped_read_only(start, length)
    if read_only and registry is None and not read_only_register_supported(torch.cuda.current_device()):
        raise RuntimeError("this memory is mapped read-only and the device cannot register read-only host "
                           "memory: read the table through staging buffers (open_table does so by itself)")
    flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED | (HOST_REGISTER_READ_ONLY if read_only else 0)
    pages = registry or PAGES
    return HostRegistration(tensor, start, length, spans=pages.acquire(start, length, flags), registry=pages)


def mapped_read_only(address: int, nbytes: int) -> bool:
    """Whether any page of ``[address, address + nbytes)`` is mapped without write permission
    (``/proc/self/maps``); False where that file cannot be read."""
    end = address + max(nbytes, 1)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if lo < end and hi > address and "w" not in perms:
                    return True
    except OSError:
        return False
    return False


@functools.lru_cache(maxsize=None)
def read_only_register_supported(device_index: int) -> bool:
    """Whether CUDA device ``device_index`` can register read-only host memory
    (``CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED``); False on any error."""
    try:
        _bind_context()
        value = ctypes.c_int(0)
        status = _driver().cuDeviceGetAttribute(ctypes.byref(value), ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                                                ctypes.c_int(device_index))
        return status == 0 and value.value == 1
    except (OSError, RuntimeError, AttributeError):
        return False


@functools.lru_cache(maxsize=None)
def _coherent(device_index: int) -> bool:
    return uva_coherent(device_index)


def device_reads_in_place(tensor: torch.Tensor, device: torch.device | str) -> bool:
    """Whether ``device`` can read host ``tensor`` in place over UVA: a CPU device always (it
    is the memory), a CUDA device when UVA is coherent there (``uva_coherent``, checked once
    a device) and the tensor is pinned or can be registered (read-only memory needs the
    device's read-only registration)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    if not torch.cuda.is_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _coherent(index):
        return False
    if tensor.is_pinned():
        return True
    start, length = page_span(tensor.data_ptr(), max(_byte_span(tensor), 1))
    return not mapped_read_only(start, length) or read_only_register_supported(index)


def _device_pointer(host_pointer: int) -> int:
    """The device address of pinned (or registered) host memory (``cuMemHostGetDevicePointer``)."""
    driver = _driver()
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
