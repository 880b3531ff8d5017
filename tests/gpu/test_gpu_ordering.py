"""DeviceSync, the HBM row cache and the staging ring, ordered under the tracing DeviceSync."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload.engram import rows
from engram_offload.gpu import HbmRowCache, ImmediateSync, OrderingError, StagingRing
from engram_offload.gpu.reference import gather_raw_ref

from tracing_sync import TracingSync


def test_tracing_sync_rejects_a_read_before_its_writer_is_waited_for():
    sync = TracingSync()
    sync.run("side", lambda: None, writes={"rows": [0]})
    event = sync.record("side")
    with pytest.raises(OrderingError, match="before its writer"):
        sync.run("main", lambda: None, reads={"rows": [0]})
    sync.run("main", lambda: None, reads={"rows": [1]})  # another part is free
    sync.wait("main", event)
    sync.run("main", lambda: None, reads={"rows": [0]})


def test_tracing_sync_rejects_an_overwrite_before_the_reader_finished():
    sync = TracingSync()
    sync.run("main", lambda: None, reads={"buf": None})
    with pytest.raises(OrderingError, match="before its reader"):
        sync.run("side", lambda: None, writes={"buf": [3]})  # a part of a buffer read whole
    sync.wait_stream("side", "main")
    sync.run("side", lambda: None, writes={"buf": [3]})


def test_host_waits_through_synchronize_and_done():
    sync = TracingSync()
    sync.run("copy", lambda: None, reads={"staging": [0]})
    event = sync.record("copy")
    with pytest.raises(OrderingError):
        sync.run("host", lambda: None, writes={"staging": [0]})
    assert sync.done(event)
    sync.run("host", lambda: None, writes={"staging": [0]})


def fp8_table(num_rows: int = 64, seed: int = 0) -> torch.Tensor:
    x = torch.randn(num_rows, 64, generator=torch.Generator().manual_seed(seed))
    return rows.encode_rows(x, "fp8_e4m3_ue8m0")  # [num_rows, 66]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_hbm_cache_returns_the_table_rows_and_fills_after_every_reader(policy):
    table = fp8_table()
    sync = TracingSync()
    cache = HbmRowCache(table, capacity=8, device="cpu", policy=policy, sync=sync)
    rng = np.random.default_rng(0)
    for step in range(12):
        ids = torch.from_numpy(rng.choice(np.r_[np.arange(6), rng.integers(0, 64, 6)], size=10))
        out = torch.empty(10, 66, dtype=torch.uint8)
        stream = "main" if step % 2 else "side"  # steps on two streams: the fill must wait for both
        cache.gather(ids, out, stream=stream)  # the two streams never wait for each other
        assert torch.equal(out, gather_raw_ref(table, ids)), f"step {step}"
    stats = cache.stats.as_dict()
    assert stats["hits"] > 0 and stats["misses"] > 0 and cache.resident == 8
    resident = np.flatnonzero(cache._slot_host >= 0)
    assert torch.equal(cache.slots[cache.slot_of_row[resident].long()], table[resident])


def test_hbm_fill_waits_for_every_step_since_the_last_fill_on_every_stream():
    table = fp8_table()
    sync = TracingSync()
    cache = HbmRowCache(table, capacity=2, device="cpu", sync=sync)
    cache.gather(torch.tensor([1, 2]), torch.empty(2, 66, dtype=torch.uint8))  # fills slots 0, 1
    for stream in ("side", "main"):  # all hits: no fill, two streams that never meet
        cache.gather(torch.tensor([1, 2]), torch.empty(2, 66, dtype=torch.uint8), stream=stream)
    out = torch.empty(2, 66, dtype=torch.uint8)
    cache.gather(torch.tensor([1, 3]), out, stream="main")  # 3 evicts 2, which "side" read
    assert torch.equal(out, table[[1, 3]]) and cache._slot_host[3] >= 0 > cache._slot_host[2]


def test_hbm_cache_without_waiting_for_the_fill_would_race():
    """The tracing sync sees a gather that reads the slot map before a pending fill is waited for."""
    table = fp8_table()
    sync = TracingSync()
    cache = HbmRowCache(table, capacity=4, device="cpu", sync=sync)
    cache.gather(torch.tensor([1, 2]), torch.empty(2, 66, dtype=torch.uint8))
    cache._fill_event = None  # forget the fill, as a broken cache would
    with pytest.raises(OrderingError):
        cache.gather(torch.tensor([1, 3]), torch.empty(2, 66, dtype=torch.uint8))


def test_hbm_cache_dequantizes_hits_and_misses_alike():
    table = fp8_table(seed=1)
    cache = HbmRowCache(table, capacity=4, device="cpu", sync=ImmediateSync())
    for _ in range(2):
        out = torch.empty(3, 64)
        cache.gather(torch.tensor([5, 9, 5]), out, config_or_format="fp8_e4m3_ue8m0")
        assert torch.equal(out, rows.decode_rows(table[[5, 9, 5]], "fp8_e4m3_ue8m0", 64))
    assert cache.stats.hits == 3
    with pytest.raises(IndexError):
        cache.gather(torch.tensor([64]), torch.empty(1, 66, dtype=torch.uint8))


def test_staging_ring_reuses_a_buffer_only_after_its_copy():
    sync = TracingSync()
    ring = StagingRing(2, 16, device="cpu", sync=sync)
    dsts = [torch.zeros(16, dtype=torch.uint8) for _ in range(5)]
    for i, dst in enumerate(dsts):
        def read_into(buffer, i=i):
            buffer[:10] = i + 1
            return 10
        event = ring.stage(read_into, dst)
        sync.wait("main", event)
        assert dst[:10].eq(i + 1).all() and dst[10:].eq(0).all()


def test_staging_ring_that_skipped_the_event_would_race():
    sync = TracingSync()
    ring = StagingRing(1, 8, device="cpu", sync=sync)
    ring.stage(lambda b: 8, torch.zeros(8, dtype=torch.uint8))
    ring._events[0] = None  # a ring that forgot the copy's event
    with pytest.raises(OrderingError, match="staging"):
        ring.stage(lambda b: 8, torch.zeros(8, dtype=torch.uint8))


def test_staging_ring_rejects_oversized_reads():
    ring = StagingRing(1, 8, device="cpu")
    with pytest.raises(ValueError, match="returned 9 bytes"):
        ring.stage(lambda b: 9, torch.zeros(8, dtype=torch.uint8))


@pytest.mark.gpu
def test_hbm_cache_and_staging_on_cuda_streams():
    from engram_offload.gpu import CudaSync
    sync = CudaSync()
    table = fp8_table(num_rows=256).pin_memory()
    cache = HbmRowCache(table, capacity=32, device="cuda", sync=sync)
    rng = np.random.default_rng(1)
    for step in range(20):
        ids = torch.from_numpy(rng.integers(0, 64, 48))
        out = torch.empty(48, 66, dtype=torch.uint8, device="cuda")
        cache.gather(ids, out, stream="side" if step % 2 else "main")
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), table[ids])
    assert cache.stats.hits > 0
    ring = StagingRing(2, 1 << 20, device="cuda", sync=sync)
    dsts = [torch.zeros(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(6)]
    for i, dst in enumerate(dsts):
        def read_into(buffer, i=i):
            buffer.fill_(i + 1)
            return buffer.numel()
        sync.wait("main", ring.stage(read_into, dst))
    torch.cuda.synchronize()
    assert all(dst.eq(i + 1).all() for i, dst in enumerate(dsts))


def test_upload_ring_grows_a_buffer_to_the_array_and_reuses_it_after_its_copy():
    sync = TracingSync()
    small, large = np.arange(5, dtype=np.int32), np.arange(40_000, dtype=np.int64)  # 320,000 bytes
    for array in (small, large, large.reshape(200, 200), small):
        got = sync.upload("side", array, "cpu")
        assert got.dtype == torch.from_numpy(array).dtype and torch.equal(got, torch.from_numpy(array))
    ring = sync.__dict__["_upload_rings"]["cpu"]
    assert [b.numel() for b in ring.buffers[:4]] == [1 << 16, 1 << 19, 1 << 19, 1 << 16]
    assert all(any(src.data_ptr() == b.data_ptr() for b in ring.buffers) for _, src in sync.copies)
