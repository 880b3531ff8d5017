"""Host memory the device reads in place (page spans, registration, UVA views), and the GPU
smoke script without a device."""

from __future__ import annotations

import pytest
import torch

from engram_offload.engram import rows
from engram_offload.gpu import page_span, register_host, uva_coherent, uva_view

from tiny_tables import tiny_config


def make_table(config) -> torch.Tensor:
    x = torch.randn(config.num_rows, config.head_dim, generator=torch.Generator().manual_seed(0))
    return rows.encode_rows(x, config.row_format)  # [R, row_bytes]


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA behaviour")
def test_smoke_benchmark_says_no_cuda_device_in_one_line():
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_smoke.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "no CUDA device\n" and not result.stderr
