"""Host memory registration: page ranges counted per registration, read-only mappings."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from engram_offload.buffers.hostmem import (
    PAGE,
    PageRegistry,
    device_reads_in_place,
    mapped_read_only,
    register_host,
)


class Driver:
    """Keeps registered page ranges as the CUDA driver does: a page registered twice, or an
    unregister of an address that does not start a registration, is an error."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}
        self.calls: list[tuple] = []

    def register(self, start: int, length: int, flags: int) -> None:
        assert start % PAGE == 0 and length % PAGE == 0
        for s, n in self.ranges.items():
            if s < start + length and s + n > start:
                raise RuntimeError("cuMemHostRegister failed: CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED")
        self.ranges[start] = length
        self.calls.append(("register", start, length, flags))

    def unregister(self, start: int) -> None:
        if start not in self.ranges:
            raise RuntimeError("cuMemHostUnregister failed: CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")
        del self.ranges[start]
        self.calls.append(("unregister", start))


def test_two_tensors_on_one_page_share_its_registration():
    driver = Driver()
    pages = PageRegistry(driver.register, driver.unregister)
    buffer = torch.zeros(3 * PAGE, dtype=torch.uint8)
    base = -buffer.data_ptr() % PAGE  # the first page boundary in the buffer
    a, b = buffer[base: base + 100], buffer[base + 200: base + PAGE + 10]  # both on the first page
    first = register_host(a, registry=pages)
    second = register_host(b, registry=pages)  # its first page is a's: only the next one is new
    assert [c[0] for c in driver.calls] == ["register", "register"]
    assert sorted(driver.ranges.items()) == [(first.start, PAGE), (first.start + PAGE, PAGE)]
    first.close()  # b still reads the first page: nothing is unregistered
    assert len(driver.ranges) == 2
    second.close()
    assert driver.ranges == {} and pages.registered() == []
    second.close()  # closing twice does nothing


def test_a_registration_covering_others_registers_only_the_gaps():
    driver = Driver()
    pages = PageRegistry(driver.register, driver.unregister)
    start = 64 * PAGE
    inner = pages.acquire(start + PAGE, PAGE, 3)
    outer = pages.acquire(start, 4 * PAGE, 3)
    assert sorted(driver.ranges.items()) == [(start, PAGE), (start + PAGE, PAGE), (start + 2 * PAGE, 2 * PAGE)]
    pages.release(inner)
    assert len(driver.ranges) == 3  # the outer registration still holds the middle page
    pages.release(outer)
    assert driver.ranges == {}


def test_a_failed_registration_leaves_nothing_registered():
    driver = Driver()
    pages = PageRegistry(driver.register, driver.unregister)
    start = 64 * PAGE
    driver.ranges[start + 2 * PAGE] = PAGE  # registered behind the registry's back
    pages.acquire(start + PAGE, PAGE, 3)
    with pytest.raises(RuntimeError, match="ALREADY_REGISTERED"):
        pages.acquire(start, 4 * PAGE, 3)  # the gap at start registers, the last one fails
    assert sorted(driver.ranges) == [start + PAGE, start + 2 * PAGE]
    assert pages.registered() == [(start + PAGE, PAGE, 1)]


def test_read_only_mappings_are_seen(tmp_path):
    path = tmp_path / "rows.bin"
    path.write_bytes(bytes(4 * PAGE))
    with open(path, "rb") as f:
        read_only = mmap.mmap(f.fileno(), 4 * PAGE, prot=mmap.PROT_READ)
    view = np.frombuffer(read_only, dtype=np.uint8)
    assert mapped_read_only(view.ctypes.data + 10, 100)
    writable = np.zeros(4 * PAGE, dtype=np.uint8)
    assert not mapped_read_only(writable.ctypes.data, writable.nbytes)
    driver = Driver()
    registration = register_host(torch.from_numpy(writable), registry=PageRegistry(driver.register, driver.unregister))
    assert driver.calls[0][3] == 0x03  # portable | mapped
    registration.close()
    del view
    read_only.close()


def test_a_cpu_device_reads_host_memory_in_place():
    assert device_reads_in_place(torch.zeros(4), "cpu")
    if not torch.cuda.is_available():
        assert not device_reads_in_place(torch.zeros(4), "cuda")
