"""served_table: a trained model's table on a tier, converted on the fly or from a given file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engram_offload.engram.config import EngramConfig
from engram_offload.model.serving import TIERS, served_table
from engram_offload.serving.store import open_table
from engram_offload.table.convert import convert_checkpoint


def test_an_unknown_tier_is_refused_naming_the_choices(model_dir):
    with pytest.raises(ValueError) as caught:
        with served_table(model_dir, "shared"):
            pass
    assert str(caught.value) == "unknown tier 'shared': choose one of memory, pinned, mmap, direct"
    assert TIERS == ("memory", "pinned", "mmap", "direct")


def test_a_table_converted_on_the_fly_serves_the_checkpoints_rows_and_is_removed_after(model_dir, tmp_path):
    table = convert_checkpoint(model_dir, tmp_path / "t.engram", EngramConfig.from_hf_config(model_dir / "config.json"),
                               progress=False)
    with open_table(table, "memory") as memory:
        ids = np.random.default_rng(3).integers(0, memory.num_rows, 500)
        want = memory.gather(ids)
    with served_table(model_dir, "mmap") as store:
        converted = Path(store.stats()["table"])
        assert converted != table and converted.name == "table.engram" and converted.is_file()
        assert store.stats()["tier"]["tier"] == "mmap" and store.stats()["levels"][0]["level"] == "tier"  # no cache
        assert store.gather(ids).equal(want)
        assert store.stats()["levels"][0]["rows"] == len(np.unique(ids))
    assert store.closed and not converted.parent.exists()


def test_a_given_table_is_served_behind_the_cache_and_policy_asked_for(model_dir, tmp_path):
    table = convert_checkpoint(model_dir, tmp_path / "t.engram", EngramConfig.from_hf_config(model_dir / "config.json"),
                               progress=False)
    with served_table(model_dir, "memory", table=table, cache_bytes=1 << 16, policy="lfu") as store:
        assert Path(store.stats()["table"]) == table
        dram = store.stats()["levels"][0]
        assert (dram["level"], dram["policy"], dram["capacity_bytes"] <= 1 << 16) == ("dram", "lfu", True)
    assert store.closed and table.is_file()  # the caller's file stays
