"""Stream memory operations: a stream writes a word of pinned host memory, or waits until one
holds a value, with no host thread involved (``cuStreamWriteValue32/64_v2``,
``cuStreamWaitValue32/64_v2``), called through ctypes on libcuda as ``buffers.hostmem`` does.

A write follows a memory fence over the stream's earlier work (``CU_STREAM_WRITE_VALUE_DEFAULT``),
so a host thread that sees the value also sees what the stream wrote before it. A wait is an
equality (``CU_STREAM_WAIT_VALUE_EQ``). Stream capture records both as memory-operation nodes,
which a CUDA graph replays with the values given at capture. ``supported(device)`` says whether
this driver has them and the device reads host memory coherently; where not, callers keep their
CPU waits.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from ..buffers.hostmem import _check_driver, _coherent, _device_pointer, _driver

__all__ = ["supported", "write_value", "wait_value"]

WAIT_VALUE_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ
WRITE_VALUE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: fenced after the stream's earlier writes
ATTRIBUTE_64_BIT = 122  # CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS (the v2 operations)
_addresses: dict[int, int] = {}  # host address of a word -> its device address


@functools.lru_cache(maxsize=None)
def _entry(name: str) -> Any:
    """The driver's ``name`` with its argument types, or None where libcuda or the entry point is missing."""
    try:
        fn = getattr(_driver(), name)
    except (OSError, AttributeError):
        return None
    value = ctypes.c_uint64 if name.endswith("64_v2") else ctypes.c_uint32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, value, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _index(device: torch.device | str | int | None) -> int:
    if isinstance(device, int):
        return device
    index = None if device is None else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    names = ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2")
    return all(_entry(name) is not None for name in names) and _coherent(index)


def supported(device: torch.device | str | int | None = None) -> bool:
    """Whether streams on CUDA ``device`` can write and wait on 32-bit words of pinned host
    memory (the v2 entry points are in this driver, and the device sees host memory coherently)."""
    if not torch.cuda.is_available() or (isinstance(device, (str, torch.device)) and torch.device(device).type != "cuda"):
        return False
    try:
        return _supported(_index(device))
    except (OSError, RuntimeError, AttributeError):
        return False


@functools.lru_cache(maxsize=None)
def _supports_64_bit(index: int) -> bool:
    value = ctypes.c_int(0)
    status = _driver().cuDeviceGetAttribute(ctypes.byref(value), ATTRIBUTE_64_BIT, ctypes.c_int(index))
    return status == 0 and value.value == 1 and _entry("cuStreamWaitValue64_v2") is not None


def _address(word: torch.Tensor) -> int:
    """The device address of ``word``: device memory as it is, pinned host memory mapped (cached)."""
    if word.is_cuda:
        return word.data_ptr()
    if not word.is_pinned():
        raise ValueError("a stream memory operation needs a word of pinned host memory (or device memory)")
    host = word.data_ptr()
    found = _addresses.get(host)
    if found is None:
        found = _addresses[host] = _device_pointer(host)
    return found


def _call(op: str, stream: torch.cuda.Stream, word: torch.Tensor, value: int, flags: int) -> None:
    size = word.element_size()
    if word.numel() != 1 or size not in (4, 8):
        raise ValueError(f"a stream memory operation takes one 32- or 64-bit word, got {word.dtype} "
                         f"{tuple(word.shape)}")
    bits = 8 * size
    if bits == 64 and not _supports_64_bit(stream.device.index):
        raise RuntimeError("this device has no 64-bit stream memory operations: use a 32-bit word")
    name = f"cuStream{op}Value{bits}_v2"
    fn = _entry(name)
    if fn is None:
        raise RuntimeError(f"this CUDA driver lacks {name}: update the driver, or keep the CPU waits")
    status = fn(ctypes.c_void_p(stream.cuda_stream), _address(word), value & ((1 << bits) - 1), flags)
    _check_driver(status, name)


def write_value(stream: torch.cuda.Stream, word: torch.Tensor, value: int) -> None:
    """Enqueue on ``stream``: write ``value`` into ``word`` once the stream's earlier work is done
    and visible (a fenced write)."""
    _call("Write", stream, word, value, WRITE_VALUE_DEFAULT)


def wait_value(stream: torch.cuda.Stream, word: torch.Tensor, value: int) -> None:
    """Enqueue on ``stream``: later work starts once ``word`` holds ``value`` (the host never blocks)."""
    _call("Wait", stream, word, value, WAIT_VALUE_EQ)
