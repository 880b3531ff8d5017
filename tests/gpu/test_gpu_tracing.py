"""The tracing DeviceSync following tensors, and the ordering, allocator and host-copy bugs it
shows on a CPU: staging copies into blocks of another stream, output buffers that move,
pageable copies on the fetch path, and unregistering before the fetch and fill streams are done."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table
from engram_offload.engram import rows
from engram_offload.engram.hashing import NgramHasher
from engram_offload.gpu import OrderingError
from engram_offload.gpu.hbm_cache import FILL_STREAM
from engram_offload.gpu.sync import FETCH, MAIN, PageableCopyError, kernel_access
from engram_offload.serving.prefetch import Prefetcher

from tiny_tables import tiny_config
from tracing_sync import TracingSync


def traced() -> TracingSync:
    return TracingSync(tensors=True)


# ---------------------------------------------------------------------- the model
def test_an_allocation_is_a_write_by_its_stream():
    sync = traced()
    with sync.tracking():
        buf = sync.empty("side", (8,), torch.uint8, "cpu")
        with pytest.raises(OrderingError, match="before its writer"):
            sync.run("copy", lambda: buf.fill_(1))  # the copy stream never waited for "side"
        sync.wait_stream("copy", "side")
        sync.run("copy", lambda: buf.fill_(1))


def test_work_outside_run_is_main_stream_work():
    sync = traced()
    with sync.tracking():
        made = torch.arange(6).view(2, 3)  # main stream
        sync.wait_stream("side", MAIN)
        late = made.t().reshape(-1)  # a copy kernel on the main stream, after the wait
        with pytest.raises(OrderingError, match="clone"):
            sync.run("side", lambda: late.sum())


def test_a_freed_block_needs_the_other_streams_keep_alive():
    sync = traced()
    with sync.tracking():
        buf = sync.empty(MAIN, (16,), torch.uint8, "cpu")
        sync.wait_stream("side", MAIN)
        sync.run("side", buf.sum)  # read on "side", which main never waits for
        del buf  # back to main's pool: main's next allocation may overwrite it
        with pytest.raises(OrderingError, match="freed while"):
            sync.check()
        kept = sync.empty(MAIN, (16,), torch.uint8, "cpu")
        sync.wait_stream("side", MAIN)
        sync.run("side", kept.sum)
        sync.keep_alive(kept, "side")  # record_stream: the allocator waits for "side"
        del kept
        sync.check()


def test_device_work_reading_pageable_host_memory_is_a_blocking_copy():
    sync = traced()
    with sync.tracking():
        host = torch.from_numpy(np.arange(4))
        with pytest.raises(PageableCopyError, match="pageable"):
            sync.run("side", lambda: host + 1)
        device = sync.upload("side", np.arange(4), "cpu")  # through the pinned ring
        assert sync.run("side", lambda: device + 1).tolist() == [1, 2, 3, 4]
        sync.run("host", lambda: host + 1)  # host work may read it


def test_a_kernel_launch_is_one_access():
    sync = traced()
    with sync.tracking():
        out = sync.empty("side", (4,), torch.int64, "cpu")
        src = sync.empty(MAIN, (4,), torch.int64, "cpu")
        with pytest.raises(OrderingError):
            sync.run("side", lambda: kernel_access([src], [out]).__enter__())
    with kernel_access([src], [out]):  # without a tracer: nothing
        pass


def test_tracking_needs_a_tensor_tracer():
    with pytest.raises(ValueError, match="tensors=True"):
        with TracingSync().tracking():
            pass


# ---------------------------------------------------------------------- a store with a device
@pytest.fixture(scope="module")
def table_file(disk_dir):
    config = tiny_config(head_dim=64)
    x = torch.randn(config.num_rows, config.head_dim, generator=torch.Generator().manual_seed(3))
    path = write_table(disk_dir / "t.tbl", config, x)  # the direct tier needs O_DIRECT: not tmpfs
    return path, rows.encode_rows(x, config.row_format)


def steps(num_rows: int, count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    hot = rng.choice(num_rows, 30, replace=False)
    for _ in range(count):
        yield np.unique(np.r_[rng.choice(hot, 20), rng.integers(0, num_rows, 12)])


@pytest.mark.parametrize("tier", ["mmap", "direct", "memory"])
def test_store_fetches_are_ordered_against_the_allocator(table_file, tier):
    """Item 2: staged rows land in a block the fetch stream allocated, so the copy stream
    waits for the fetch stream first; item 8: ids, slot maps and fill indices are uploaded, never copied pageable."""
    path, raw = table_file
    options = {"cache_bytes": 20 * 66} if tier == "direct" else {}
    sync = traced()
    with open_table(path, tier, device="cpu", sync=sync, fast_cache_bytes=24 * 66,
                    staging_bytes=8 * 66, **options) as store:
        with sync.tracking():
            for ids in steps(store.num_rows, 6):
                with store.fetch(ids) as lease:
                    sync.wait(MAIN, lease.ready)
                    with sync.paused():
                        assert torch.equal(lease.raw, raw[ids])
        assert store.stats()["levels"][0]["hits"] > 0


def test_closing_a_device_store_waits_for_its_streams_before_unregistering(table_file):
    """Item 6: the table is unregistered (and the tier unmapped) only after the host has
    waited for the fetch and fill streams."""
    path, _ = table_file
    sync = traced()
    store = open_table(path, "memory", device="cpu", sync=sync, fast_cache_bytes=24 * 66)
    for ids in steps(store.num_rows, 3):
        with store.fetch(ids):
            pass
    assert not sync.host_knows_finished(FETCH)
    store.close()
    assert sync.host_knows_finished(FETCH) and sync.host_knows_finished(FILL_STREAM)


def run_prefetcher(table_file, widths, **options) -> set:
    """Steps of 4 sequences with ``widths`` new tokens each through a device Prefetcher (a
    direct store with DRAM and HBM levels, under the tensor tracer), checked against a host
    Prefetcher; returns the (layer, address) of every layer's rows."""
    path, _ = table_file
    config = tiny_config(head_dim=64)
    hasher = NgramHasher(config, np.arange(1000, dtype=np.int64) % 700)
    sync = traced()
    rng = np.random.default_rng(4)
    addresses = set()
    with open_table(path, "direct", device="cpu", sync=sync, cache_bytes=40 * 66, fast_cache_bytes=30 * 66) as store, \
            open_table(path, "mmap") as host_store, Prefetcher(store, hasher, **options) as pf, \
            Prefetcher(host_store, NgramHasher(config, hasher.token_map)) as host:
        with sync.tracking():
            for width in widths:
                pieces = [rng.integers(0, 1000, width) for _ in range(4)]
                step, want = pf.begin_step([1, 2, 3, 4], pieces), host.begin_step([1, 2, 3, 4], pieces)
                for layer_id in config.layer_ids:
                    got = pf.rows(layer_id, step)
                    addresses.add((layer_id, got.data_ptr()))
                    with sync.paused():
                        assert torch.equal(got, host.rows(layer_id, want))
                pf.end_step(step)
                host.end_step(want)
            if options.get("max_tokens"):
                too_many = [rng.integers(0, 1000, options["max_tokens"]) for _ in range(4)]
                with pytest.raises(ValueError, match="max_tokens="):
                    pf.begin_step([1, 2, 3, 4], too_many)
    return addresses


def test_device_prefetcher_uploads_its_row_orders(table_file):
    """Item 8 for the Prefetcher: each layer's row order reaches the dequant through the
    pinned upload ring, never a pageable copy."""
    run_prefetcher(table_file, (1, 2, 1))


def test_device_prefetcher_buffers_keep_their_addresses_when_steps_grow(table_file):
    """Item 4: with max_tokens, a step with more tokens than any before keeps the addresses
    (a graph captured around the layers stays valid); a step over max_tokens raises."""
    addresses = run_prefetcher(table_file, (1, 3, 2), max_tokens=12)  # 4, 12, 8 tokens a step
    assert len(addresses) == len(tiny_config().layer_ids)
