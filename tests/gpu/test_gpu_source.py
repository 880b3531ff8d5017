"""RowSource, the adapter a serving engine calls, and the host-memory helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload.engram import rows
from engram_offload.gpu import (
    OrderingError,
    RowSource,
    TracingSync,
    page_span,
    register_host,
    tp_columns,
    uva_coherent,
    uva_view,
)

from tiny_tables import tiny_config


def make_table(config) -> torch.Tensor:
    x = torch.randn(config.num_rows, config.head_dim, generator=torch.Generator().manual_seed(0))
    return rows.encode_rows(x, config.row_format)  # [R, row_bytes]


def local_ids(config, tokens: int, seed: int = 1) -> torch.Tensor:
    """[T, L, C] ids within each layer's table."""
    rng = np.random.default_rng(seed)
    per_layer = [rng.integers(0, config.rows_per_layer[i], (tokens, config.cols_per_layer))
                 for i in config.layer_ids]
    return torch.from_numpy(np.stack(per_layer, axis=1))


def expected(config, table, ids, layer_id, c0, c1, dtype=torch.bfloat16):
    index = config.layer_ids.index(layer_id)
    flat = ids[:, index, c0:c1].reshape(-1) + config.layer_row_base(layer_id)
    return rows.decode_rows(table[flat], config.row_format, config.head_dim, dtype).view(ids.shape[0], c1 - c0, -1)


def test_tp_columns_shard_like_vllm():
    assert [tp_columns(24, 4, r) for r in range(4)] == [(0, 6), (6, 12), (12, 18), (18, 24)]
    assert tp_columns(5, 2, 1) == (3, 5)  # the last rank may own fewer
    with pytest.raises(ValueError, match="without columns"):
        tp_columns(4, 3, 2)  # cdiv(4, 3) = 2 columns a rank: rank 2 would start at 4
    with pytest.raises(ValueError, match="outside"):
        tp_columns(24, 4, 4)


@pytest.mark.parametrize("kind", ["table", "reader"])
def test_row_source_gives_each_layer_its_rows_after_its_event(kind):
    config = tiny_config(head_dim=64)
    table = make_table(config)
    sync = TracingSync()
    reads: list[int] = []

    def read_raw(flat_ids: np.ndarray) -> torch.Tensor:
        assert np.unique(flat_ids).size == flat_ids.size  # the source reads each row once
        reads.append(flat_ids.size)
        return table[torch.from_numpy(flat_ids)]

    source = (RowSource.from_table(table, config=config, device="cpu", sync=sync) if kind == "table"
              else RowSource(read_raw, config=config, device="cpu", sync=sync))
    for step in range(2):
        ids = local_ids(config, tokens=5, seed=step)
        c0, c1 = tp_columns(config.cols_per_layer, 2, 1)
        handle = source.start(ids, columns=(c0, c1))
        for layer_id in reversed(config.layer_ids):
            got = handle.rows(layer_id)
            assert torch.equal(got, expected(config, table, ids, layer_id, c0, c1))
        out = torch.empty_like(got)
        assert torch.equal(handle.rows(config.layer_ids[0], out=out), expected(config, table, ids, 1, c0, c1))
    assert kind == "table" or reads


def test_reading_rows_before_their_event_is_caught():
    config = tiny_config(head_dim=64)
    sync = TracingSync()
    source = RowSource.from_table(make_table(config), config=config, device="cpu", sync=sync)
    handle = source.start(local_ids(config, tokens=2))
    handle._events[0] = None  # a handle that lost its layer's event
    with pytest.raises(OrderingError):
        handle.rows(config.layer_ids[0])


def test_raw_rows_and_bad_arguments():
    config = tiny_config(head_dim=64)
    table = make_table(config)
    source = RowSource.from_table(table, config=config, device="cpu", dequantize=False)
    ids = local_ids(config, tokens=3)
    raw = source.start(ids).rows(3)
    flat = ids[:, 1].reshape(-1) + config.layer_row_base(3)
    assert torch.equal(raw.reshape(-1, config.row_bytes), table[flat])
    with pytest.raises(ValueError, match=r"must be \[T, 2, 4\]"):
        source.start(ids[:, :1])
    with pytest.raises(ValueError, match="columns"):
        source.start(ids, columns=(3, 3))
    with pytest.raises(KeyError, match="layer 2 has no Engram"):
        source.start(ids).rows(2)
    with pytest.raises(ValueError, match="exactly one"):
        RowSource(config=config, device="cpu")


def test_page_span_covers_whole_pages():
    assert page_span(4096, 1, page=4096) == (4096, 4096)
    assert page_span(4095, 2, page=4096) == (0, 8192)
    assert page_span(8192 + 100, 8192, page=4096) == (8192, 12288)
    with pytest.raises(ValueError):
        page_span(0, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA behaviour")
def test_host_memory_helpers_fail_closed_without_cuda():
    assert uva_coherent() is False
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        register_host(torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        uva_view(torch.zeros(10, dtype=torch.uint8))


@pytest.mark.gpu
def test_registered_table_is_read_through_uva_in_place():
    from engram_offload.gpu import gather_rows
    config = tiny_config(head_dim=64)
    table = make_table(config)
    assert uva_coherent()
    with register_host(table):
        view = uva_view(table)
        assert view.is_cuda and torch.equal(view.cpu(), table)
        ids = torch.tensor([0, config.num_rows - 1, 7], device="cuda")
        got = gather_rows(table, ids, config, dtype=torch.float32)  # Triton reads the pinned CPU tensor
        assert torch.equal(got.cpu(), rows.decode_rows(table[ids.cpu()], config.row_format, 64))


@pytest.mark.gpu
def test_row_source_on_side_stream_and_cuda_graph():
    from engram_offload.gpu import CudaSync
    config = tiny_config(head_dim=64)
    table = make_table(config).pin_memory()
    source = RowSource.from_table(table, config=config, device="cuda", sync=CudaSync())
    ids = local_ids(config, tokens=4).cuda()
    handle = source.start(ids)
    rows_1 = handle.rows(1)
    graph, weight = torch.cuda.CUDAGraph(), torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    warm = torch.cuda.Stream()  # cuBLAS sets up outside the capture
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        rows_1 @ weight
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        result = rows_1 @ weight
    for seed in range(3):
        new = local_ids(config, tokens=4, seed=seed).cuda()
        assert source.start(new).rows(1).data_ptr() == rows_1.data_ptr()  # fixed address
        graph.replay()
        torch.cuda.synchronize()
        want = expected(config, table, new.cpu(), 1, 0, config.cols_per_layer).cuda() @ weight
        torch.testing.assert_close(result, want)  # the same matmul, captured and eager


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA behaviour")
def test_smoke_benchmark_says_no_cuda_device_in_one_line():
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_smoke.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "no CUDA device\n" and not result.stderr


@pytest.mark.parametrize("tier,options", [("direct", {"cache_bytes": 40 * 66, "fast_cache_bytes": 64 * 66}),
                                          ("memory", {"fast_cache_bytes": 64 * 66}), ("mmap", {})])
def test_row_source_over_any_store(disk_dir, tier, options):
    """from_store: a store that delivers to the device (kernels under the interpreter on a CPU),
    and a host store read through read_raw; both give each rank's columns of every layer."""
    from engram_offload import open_table, write_table

    config = tiny_config(head_dim=64)
    x = torch.randn(config.num_rows, config.head_dim, generator=torch.Generator().manual_seed(0))
    path = write_table(disk_dir / f"{tier}.tbl", config, x)  # the direct tier needs O_DIRECT: not tmpfs
    table = rows.encode_rows(x, config.row_format)
    sync = TracingSync()
    with open_table(path, tier, device="cpu", sync=sync, **options) as device_store, \
            open_table(path, "mmap") as host_store:
        for store in (device_store, host_store):
            source = RowSource.from_store(store, device="cpu", dtype=torch.float32)
            assert (source.store is store) == (store is device_store)
            for step in range(3):
                ids = local_ids(config, tokens=4, seed=step % 2)  # the third step repeats the first
                c0, c1 = tp_columns(config.cols_per_layer, 2, step % 2)
                handle = source.start(ids, columns=(c0, c1))
                for layer_id in config.layer_ids:
                    want = expected(config, table, ids, layer_id, c0, c1, torch.float32)
                    assert torch.equal(handle.rows(layer_id), want)
        if "fast_cache_bytes" in options:
            assert device_store.stats()["levels"][0]["hits"] > 0
    with pytest.raises(ValueError, match="from_store"):
        RowSource(config=config, device="meta", store=device_store)


@pytest.mark.gpu
def test_row_source_gather_captured_in_a_cuda_graph():
    """The capturable path: ids and output static, the gather inside the graph; replays read
    whatever ids the engine wrote into the static tensor."""
    from engram_offload.gpu import CudaSync
    config = tiny_config(head_dim=64)
    table = make_table(config).pin_memory()
    source = RowSource.from_table(table, config=config, device="cuda", sync=CudaSync(), max_tokens=4)
    static_ids = local_ids(config, tokens=4).cuda()
    out = torch.empty(4, config.cols_per_layer, 64, dtype=torch.bfloat16, device="cuda")
    source.gather(static_ids, 3, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        source.gather(static_ids, 3, out=out)
    for seed in range(3):
        new = local_ids(config, tokens=4, seed=seed + 10)
        static_ids.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), expected(config, table, new, 3, 0, config.cols_per_layer))


@pytest.mark.gpu
def test_row_source_buffers_stay_put_on_cuda_when_steps_grow():
    from engram_offload.gpu import CudaSync
    config = tiny_config(head_dim=64)
    table = make_table(config).pin_memory()
    source = RowSource.from_table(table, config=config, device="cuda", sync=CudaSync(), max_tokens=64)
    addresses = {source.start(local_ids(config, tokens=t).cuda()).rows(1).data_ptr() for t in (1, 8, 64, 2)}
    assert len(addresses) == 1
