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


def test_the_shared_tiers_segment_registers_read_only(tmp_path):
    """The shared tier maps its segment read-only: registration must pass the read-only flag
    (without it cuMemHostRegister fails on x86 hosts), and a store on a CPU device reads it in place."""
    from engram_offload import open_table, write_table

    from tiny_tables import tiny_config
    from tracing_sync import TracingSync

    config = tiny_config(head_dim=64)
    x = torch.randn(config.num_rows, config.head_dim, generator=torch.Generator().manual_seed(1))
    path = write_table(tmp_path / "t.tbl", config, x)
    shm = tmp_path / "shm"
    shm.mkdir()
    with open_table(path, "shared", shm_dir=shm, device="cpu", sync=TracingSync()) as store:
        rows_ = store.tier.rows
        assert mapped_read_only(rows_.data_ptr(), rows_.numel())
        driver = Driver()
        registration = register_host(rows_, registry=PageRegistry(driver.register, driver.unregister))
        assert driver.calls[0][3] == 0x0B  # portable | mapped | read-only
        registration.close()
        ids = np.array([0, 7, config.num_rows - 1])
        with store.fetch(ids) as lease:
            assert store._device_rows.table is not None  # read in place
            assert torch.equal(lease.raw, rows_[torch.from_numpy(ids)])


@pytest.mark.gpu
def test_registration_on_cuda_shares_pages_and_leaves_no_runtime_error(tmp_path):
    buffer = torch.zeros(3 * PAGE, dtype=torch.uint8)
    base = -buffer.data_ptr() % PAGE
    first = register_host(buffer[base: base + 100])
    second = register_host(buffer[base + 200: base + PAGE + 10])  # shares the first page
    first.close()
    assert buffer[base + 200: base + PAGE + 10].is_pinned()  # still registered for the second
    second.close()
    path = tmp_path / "rows.bin"
    path.write_bytes(bytes(4 * PAGE))
    with open(path, "rb") as f:
        read_only = mmap.mmap(f.fileno(), 4 * PAGE, prot=mmap.PROT_READ)
    view = torch.frombuffer(read_only, dtype=torch.uint8)
    try:
        register_host(view, read_only=False).close()  # may fail on this host: it must fail here
    except RuntimeError:
        pass
    torch.ones(4, device="cuda").sum().item()  # no error left behind for an unrelated op
    del view


@pytest.mark.gpu
def test_a_shared_table_opens_on_cuda_in_place_or_staged(tmp_path):
    from engram_offload import open_table, write_table

    from tiny_tables import tiny_config

    config = tiny_config(head_dim=64)
    x = torch.randn(config.num_rows, config.head_dim, generator=torch.Generator().manual_seed(1))
    path = write_table(tmp_path / "t.tbl", config, x)
    shm = tmp_path / "shm"
    shm.mkdir()
    ids = np.array([0, 7, config.num_rows - 1])
    with open_table(path, "shared", shm_dir=shm, device="cuda") as store:
        got = store.read_raw(ids)
        assert got.is_cuda and torch.equal(got.cpu(), store.tier.rows[torch.from_numpy(ids)])


@pytest.mark.gpu
def test_the_fetch_stream_runs_at_high_priority():
    from engram_offload.gpu import CudaSync
    from engram_offload.gpu.sync import FETCH

    sync = CudaSync()
    assert sync.stream(FETCH).priority < sync.stream("other").priority
