"""Cached stores over real table files: every tier, both policies, equal to the uncached store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table

from cache_fakes import small_config


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    config = small_config()
    x = torch.randn(config.num_rows, config.head_dim)
    return write_table(tmp_path_factory.mktemp("cached") / "t.tbl", config, x), config


@pytest.mark.parametrize("tier", ["memory", "mmap", "direct"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cached_gathers_equal_uncached(table, tier, policy):
    path, config = table
    rng = np.random.default_rng(1)
    with open_table(path, tier) as plain, open_table(
        path, tier, cache_bytes=200 * config.row_bytes, fast_cache_bytes=50 * config.row_bytes, policy=policy
    ) as cached:
        for _ in range(30):
            ids = torch.from_numpy(rng.zipf(1.2, size=(4, 2, 6)) % config.num_rows)
            assert torch.equal(cached.gather(ids, torch.bfloat16), plain.gather(ids, torch.bfloat16))
        s = cached.stats()
        assert s["store"]["hit_rate"] > 0.2
        assert [lv["level"] for lv in s["levels"]] == ["fast", "dram", "tier"]
        assert s["tier"]["tier"] == tier
