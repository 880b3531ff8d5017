"""Each Engram layer on its own tier through the plugins' settings: ``"tier": {"1": "pinned", "14": "direct"}``."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.integrations.settings import check_graph_mode, open_store, parse_settings
from engram_offload.serving.layered import LayeredStore
from engram_offload.serving.sharding import column_range
from engram_offload.serving.store import open_table

from engram_tables import v41_config, write_v41_table

FIX = "start the engine without graphs"


@pytest.mark.parametrize("tier", [{"1": "pinned", "14": "direct"}, "14=direct/1=pinned", {1: "pinned", 14: "direct"}])
def test_a_placement_is_taken_in_either_form_and_said_one_way(tier):
    settings = parse_settings({"table": "t.table", "tier": tier, "cache_bytes": "1MiB"})
    assert settings.tier == "1=pinned/14=direct" and settings.tiers == ("pinned", "direct")
    assert settings.tier_of(1) == "pinned" and settings.tier_of(14) == "direct"
    assert not settings.reads_on_host(1) and settings.reads_on_host(14) and settings.host_read
    assert settings.cache_bytes == 1 << 20  # the host-read layers' cache


def test_a_placement_is_checked_like_a_tier():
    with pytest.raises(ValueError, match="unknown tier 'nvme' for layer 14"):
        parse_settings({"table": "t.table", "tier": {"1": "pinned", "14": "nvme"}})
    with pytest.raises(ValueError, match="layer 1 is named twice"):
        parse_settings({"table": "t.table", "tier": "1=pinned/1=direct"})
    with pytest.raises(ValueError, match="^the row server owns the tier of every layer"):
        parse_settings({"table": "t.table", "tier": "1=pinned/14=direct", "row_server": "/run/rows.sock"})
    with pytest.raises(ValueError, match="^the memory/pinned tier holds the whole table in memory"):
        parse_settings({"table": "t.table", "tier": "1=memory/14=pinned", "cache_bytes": "1MiB"})
    with pytest.raises(ValueError, match="^queue_depth is the direct tier's io_uring depth, not the memory/mmap"):
        parse_settings({"table": "t.table", "tier": "1=memory/14=mmap", "queue_depth": 8})
    assert parse_settings({"table": "t.table", "tier": "1=memory/14=direct", "queue_depth": 8}).queue_depth == 8


def test_the_graph_check_is_per_layer():
    settings = parse_settings({"table": "t.table", "tier": "1=pinned/14=direct"})
    check_graph_mode(settings, True, FIX, layer_id=1)  # layer 1 is read in place: any graph mode
    with pytest.raises(ValueError, match=f"^the direct tier reads rows on the host, which a FULL CUDA graph cannot "
                                         f"replay: {FIX}"):
        check_graph_mode(settings, True, FIX, layer_id=14)
    with pytest.raises(ValueError, match="^the direct tier reads rows on the host"):
        check_graph_mode(settings, True, FIX)  # any layer
    check_graph_mode(settings, False, FIX, layer_id=14)


def test_a_placement_opens_a_rank_share_bit_equal_to_the_table(tmp_path):
    config = v41_config()
    path, _ = write_v41_table(tmp_path / "v41.table", config, seed=11)
    settings = parse_settings({"table": str(path), "tier": {"1": "memory", "14": "direct"}, "cache_bytes": "64KiB"})
    columns = column_range(config.cols_per_layer, 1, 4)
    with open_store(settings, columns) as store, open_table(path, "memory") as whole:
        assert isinstance(store, LayeredStore) and store.placement == {1: "memory", 14: "direct"}
        assert store.in_place_rows(14) is None  # read on the host
        rows, first = store.in_place_rows(1)
        shard = store.stats()["columns"]
        assert shard == list(columns)
        raw = whole.tier.rows
        assert np.array_equal(rows.numpy(), raw[first:first + rows.shape[0]].numpy())
        for layer in store.layers:
            ids = np.arange(layer.base, layer.base + layer.count, dtype=np.int64)
            assert np.array_equal(store.read_raw(ids).numpy(), raw[ids].numpy())
