"""A store and a Prefetcher delivering rows to the device: under the Triton interpreter on a CPU,
and on real CUDA streams (and a captured graph) when there is a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table
from engram_offload.engram import rows
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.hashing import NgramHasher
from engram_offload.serving.prefetch import Prefetcher

from tracing_sync import TracingSync

CONFIG = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=64,
                      prime_starts=(300, 500), row_format="fp8_e4m3_ue8m0")
VOCAB = 1000


@pytest.fixture(scope="module")
def table(disk_dir):
    x = torch.randn(CONFIG.num_rows, CONFIG.head_dim, generator=torch.Generator().manual_seed(3))
    path = write_table(disk_dir / "t.tbl", CONFIG, x)  # the direct tier needs O_DIRECT: not tmpfs
    return path, rows.encode_rows(x, CONFIG.row_format)


@pytest.fixture
def hasher():
    return NgramHasher(CONFIG, np.arange(VOCAB, dtype=np.int64) % 700)


def steps(seed: int = 0, count: int = 6):
    """Row ids of steps that repeat hot rows (HBM hits) and bring new ones (misses)."""
    rng = np.random.default_rng(seed)
    hot = rng.choice(CONFIG.num_rows, 40, replace=False)
    for _ in range(count):
        yield np.r_[rng.choice(hot, 30), rng.integers(0, CONFIG.num_rows, 20)]


@pytest.mark.parametrize("tier", ["direct", "memory"])
def test_store_kernels_under_the_interpreter_equal_the_table(table, tier):
    """The store's device branch with the Triton kernels (interpreted on a CPU): tiered gathers
    with UVA or step-local addressing, and the HBM fills."""
    path, raw = table
    options = {"cache_bytes": 30 * CONFIG.row_bytes} if tier == "direct" else {}
    with open_table(path, tier, device="cpu", sync=TracingSync(), fast_cache_bytes=32 * CONFIG.row_bytes,
                    **options) as store:
        for ids in steps(count=4):
            assert torch.equal(store.read_raw(ids), raw[ids])
        hbm = store.stats()["levels"][0]
        assert hbm["level"] == "hbm" and hbm["hits"] > 0 and hbm["misses"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["direct", "mmap", "memory", "pinned"])
def test_store_on_cuda_streams_equals_the_table(table, tier):
    from engram_offload.gpu import CudaSync

    path, raw = table
    with open_table(path, tier, device="cuda", sync=CudaSync(), fast_cache_bytes=32 * CONFIG.row_bytes,
                    staging_bytes=16 * CONFIG.row_bytes) as store:
        if tier in ("memory", "pinned"):  # the device reads the tier's own rows: no second copy
            device_table = store._device_rows.table
            assert device_table.table.data_ptr() == store.tier.rows.data_ptr()
            assert device_table.table.is_pinned()
        for ids in steps(seed=1, count=8):
            with store.fetch(np.unique(ids)) as lease:
                torch.cuda.current_stream().wait_event(lease.ready)
                assert lease.raw.is_cuda and torch.equal(lease.raw.cpu(), raw[np.unique(ids)])
            got = store.read_raw(ids)
            assert got.is_cuda and torch.equal(got.cpu(), raw[ids])
        assert store.stats()["levels"][0]["hits"] > 0


@pytest.mark.gpu
def test_device_prefetch_on_streams_feeds_a_captured_graph(table, hasher):
    """The fetch runs on a side stream outside the graph; the graph reads the layer's buffer,
    whose address stays fixed step after step."""
    from engram_offload.gpu import CudaSync

    path, _ = table
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, VOCAB, size=(4, 10))
    weight = torch.randn(CONFIG.head_dim, CONFIG.head_dim, device="cuda")
    with open_table(path, "mmap") as host_store, Prefetcher(host_store, hasher) as host, \
            open_table(path, "direct", device="cuda", sync=CudaSync(), cache_bytes=200 * CONFIG.row_bytes,
                       fast_cache_bytes=100 * CONFIG.row_bytes) as store, \
            Prefetcher(store, NgramHasher(CONFIG, hasher.token_map)) as pf:
        graph, result = None, None
        for t in range(tokens.shape[1]):
            pieces = list(tokens[:, t: t + 1])
            step, want_step = pf.begin_step([1, 2, 3, 4], pieces), host.begin_step([1, 2, 3, 4], pieces)
            layer_rows = pf.rows(CONFIG.layer_ids[1], step)  # the main stream waits for the part's event
            if graph is None:
                warm = torch.cuda.Stream()  # cuBLAS sets up outside the capture
                warm.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warm):
                    layer_rows @ weight
                torch.cuda.current_stream().wait_stream(warm)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    result = layer_rows @ weight
                address = layer_rows.data_ptr()
            assert layer_rows.data_ptr() == address
            graph.replay()
            want = host.rows(CONFIG.layer_ids[1], want_step).cuda() @ weight
            torch.testing.assert_close(result, want)
            assert torch.equal(pf.rows(CONFIG.layer_ids[0], step).cpu(), host.rows(CONFIG.layer_ids[0], want_step))
            pf.end_step(step)
            host.end_step(want_step)


@pytest.mark.gpu
def test_cuda_sync_refuses_a_pageable_copy():
    from engram_offload.gpu import CudaSync

    sync = CudaSync()
    dst = torch.empty(64, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="pageable"):
        sync.copy("side", dst, torch.zeros(64, dtype=torch.uint8))
    sync.copy("side", dst, torch.ones(64, dtype=torch.uint8).pin_memory())
    sync.synchronize(sync.record("side"))
    assert dst.eq(1).all()
