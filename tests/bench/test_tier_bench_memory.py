"""``bench-tier``'s up-front memory bound covers what one caller's batch really allocates."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table
from engram_offload.bench.tier_bench import memory_needs
from engram_offload.engram.config import EngramConfig


@pytest.mark.parametrize("batch", [20_000, 200_000])  # mostly distinct ids; 9x more ids than rows
def test_a_callers_batch_allocates_no_more_than_the_bound_counts(tmp_path, batch):
    config = EngramConfig.from_name("deepseek-v4.1-flash").scaled(2e-5)
    path = write_table(tmp_path / "t.tbl", config, torch.randn(config.num_rows, config.head_dim))
    needs = memory_needs("memory", config.num_rows, config.row_bytes, 48, batch=batch, callers=1)
    bound = next(n for name, _, n, _ in needs if name == "batch")
    with open_table(path, "memory") as store:
        tracemalloc.start()  # NumPy's allocations (the ids and their copies); torch's rows counted below
        try:
            ids = np.random.default_rng(0).integers(0, store.num_rows, batch)
            rows = store.read_raw(ids)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak + rows.numel() <= bound, f"{peak + rows.numel()} bytes allocated, {bound} counted"
