"""The plugins' settings and start-up checks (no engine needed)."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from engram_offload.integrations.settings import (
    KEYS,
    OffloadSettings,
    check_graph_mode,
    check_layout,
    open_store,
    parse_settings,
    settings_from_json,
)
from engram_offload.serving.rowserver import RowClient, start_row_server
from engram_offload.serving.store import TableStore

from engram_tables import v41_config, write_v41_table

CONFIG = v41_config()


def test_every_key_parsed():
    s = parse_settings({"table": "/t.table", "tier": "direct", "cache_bytes": "2GiB", "fast_cache_bytes": 4096,
                        "policy": "lfu", "admission": True, "row_server": None, "staging_bytes": "64M",
                        "queue_depth": 32, "log_every": 10, "wait_timeout_s": 5})
    assert s == OffloadSettings(table="/t.table", tier="direct", cache_bytes=2 << 30, fast_cache_bytes=4096,
                                policy="lfu", admission=True, staging_bytes=64 << 20, queue_depth=32,
                                log_every=10, wait_timeout_s=5.0)
    assert parse_settings({"table": "t", "tier": "shared", "verify_reads": False}).verify_reads is False
    remote = parse_settings({"table": "/t.table", "tier": "remote", "pool": "redis://127.0.0.1:7000",
                             "fallback": "/f.table"})
    assert (remote.pool, remote.fallback) == ("redis://127.0.0.1:7000", "/f.table") and remote.host_read
    assert s.host_read and not parse_settings({"table": "t", "tier": "pinned"}).host_read
    assert parse_settings({"table": "t", "tier": "pinned", "row_server": "/s"}).host_read


@pytest.mark.parametrize("raw, message", [
    ({"table": "t", "teir": "direct"}, r"unknown engram_offload setting\(s\) 'teir': the keys are table, tier,"),
    ({"tier": "direct"}, "needs 'table'"),
    ({"table": "t", "tier": "nvme"}, "tier 'nvme' is unknown: choose one of memory, pinned, shared, mmap"),
    ({"table": "t", "policy": "fifo"}, "policy 'fifo' is unknown"),
    ({"table": "t", "cache_bytes": "lots"}, "size 'lots' not understood"),
    ({"table": "t", "admission": "yes"}, "'admission' must be true or false"),
    ({"table": 7}, "'table' must be a string"),
    ({"table": "t", "queue_depth": 0}, "'queue_depth' must be an integer >= 1"),
    ({"table": "t", "log_every": -1}, "'log_every' must be an integer >= 0"),
    ({"table": "t", "wait_timeout_s": 0}, "'wait_timeout_s' must be a number of seconds > 0"),
    ({"table": "t", "tier": "shared", "cache_bytes": "1G"}, "drop cache_bytes and fast_cache_bytes"),
    (["table", "t"], "must be a JSON object"),
    ({"table": "t", "tier": "direct", "pool": "redis://h:1"}, "pool and fallback are the remote tier's settings"),
    ({"table": "t", "tier": "remote"}, "the remote tier needs 'pool'"),
    ({"table": "t", "tier": "mmap", "queue_depth": 8}, "queue_depth is the direct tier's io_uring depth"),
    ({"table": "redis://h:1/ab", "tier": "remote", "verify_reads": True}, "drop verify_reads"),
])
def test_bad_settings_refused_in_one_line(raw, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_settings(raw)
    assert "\n" not in str(err.value)


def test_settings_from_json():
    assert settings_from_json('{"table": "x", "tier": "mmap"}', "ENV").tier == "mmap"
    with pytest.raises(ValueError, match="ENV is not valid JSON"):
        settings_from_json("{table: x}", "ENV")


def layout_of(config):
    return dict(layer_ids=config.layer_ids, head_dim=config.head_dim,
                primes=[config.primes[i] for i in config.layer_ids],
                num_embeddings=[config.rows_per_layer[i] for i in config.layer_ids])


def test_layout_of_the_same_model_accepted():
    check_layout(CONFIG, "t.table", **layout_of(CONFIG))
    bigger = dict(layout_of(CONFIG), num_embeddings=[n + 64 for n in layout_of(CONFIG)["num_embeddings"]])
    check_layout(CONFIG, "t.table", **bigger)  # vLLM may declare padded row counts


@pytest.mark.parametrize("other, message", [
    (v41_config(layer_ids=(1, 15)), r"Engram layers \[1, 14\], the checkpoint's \[1, 15\]"),
    (CONFIG.replace(head_dim=128), "head_dim 256, the checkpoint's 128"),
    (CONFIG.replace(prime_starts=(101, 101, 101)), "layer 1's head primes differ"),
    (CONFIG.replace(n_heads=7), "head primes differ"),
])
def test_a_table_of_another_model_refused(other, message):
    with pytest.raises(ValueError, match=message) as err:
        check_layout(CONFIG, "t.table", **layout_of(other))
    assert "engram-offload convert" in str(err.value) and "\n" not in str(err.value)


def test_other_row_format_and_fewer_rows_refused():
    with pytest.raises(ValueError, match="bf16 rows, the checkpoint's fp8_e4m3_ue8m0"):
        check_layout(CONFIG.replace(row_format="bf16"), "t", **layout_of(CONFIG))
    fewer = dict(layout_of(CONFIG), num_embeddings=[n - 1 for n in layout_of(CONFIG)["num_embeddings"]])
    with pytest.raises(ValueError, match="layer 1 has"):
        check_layout(CONFIG, "t", **fewer)


def test_host_read_under_full_graphs_refused_with_the_fix():
    fix = "start with --enforce-eager"
    for raw in ({"table": "t", "tier": "direct"}, {"table": "t", "tier": "mmap"},
                {"table": "t", "tier": "pinned", "row_server": "/run/rows.sock"}):
        s = parse_settings(raw)
        check_graph_mode(s, False, fix)
        with pytest.raises(ValueError, match=f"FULL CUDA graph cannot replay: {fix}, or use a tier the GPU"):
            check_graph_mode(s, True, fix)
    for tier in ("memory", "pinned", "shared"):
        check_graph_mode(parse_settings({"table": "t", "tier": tier}), True, fix)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return write_v41_table(tmp_path_factory.mktemp("settings") / "v41.table", CONFIG)[0]


def test_open_store_direct_with_cache_and_columns(table):
    store = open_store(parse_settings({"table": str(table), "tier": "direct", "cache_bytes": 100 * 264}),
                       (6, 12))
    try:
        assert isinstance(store, TableStore) and store.columns == (6, 12) and store.levels
    finally:
        store.close()


def test_open_store_through_a_row_server(table):
    folder = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    sock = folder / "rows.sock"
    server = start_row_server(table, sock, tier="mmap")
    try:
        client = open_store(parse_settings({"table": str(table), "tier": "mmap", "row_server": str(sock)}), (0, 6))
        assert isinstance(client, RowClient) and client.columns == (0, 6)
        assert client.verify == "sample"  # its rows are checked against this table file
        client.close()
        with pytest.raises(ValueError, match="reads the table on the mmap tier, not direct"):
            open_store(parse_settings({"table": str(table), "tier": "direct", "row_server": str(sock)}), None)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("raw, message", [
    ({}, "engram_offload needs 'table': a table file from `engram-offload convert` or a pool URL"),
    (["t"], "engram_offload settings must be a JSON object, got list"),
    ({"table": "t", "b": 1, "a": 2}, "unknown engram_offload setting(s) 'a', 'b': the keys are " + ", ".join(KEYS)),
    ({"table": "t", "tier": "remote"}, "the remote tier needs 'pool' (the pool's redis:// URL) or a pool URL as 'table'"),
    ({"table": "redis://h:1/ab", "tier": "remote", "verify_reads": False},
     "the remote tier checks every row against its pool checksum: drop verify_reads"),
    ({"table": "t", "tier": "direct", "verify_reads": True}, "the direct tier checks every page it reads: drop verify_reads"),
    ({"table": "t", "tier": "mmap", "verify_reads": False}, "the mmap tier checks every page it reads: drop verify_reads"),
    ({"table": "t", "tier": "shared", "fast_cache_bytes": 4096},
     "the shared tier holds the whole table in memory the GPU reads in place: drop cache_bytes and fast_cache_bytes"),
    ({"table": "t", "tier": "direct", "fallback": "/f.table"},
     "pool and fallback are the remote tier's settings, not the direct tier's: set tier to remote or drop them"),
    ({"table": "t", "log_every": True}, "engram_offload setting 'log_every' must be an integer >= 0, got True"),
    ({"table": "t", "tier": "direct", "queue_depth": 2.0},
     "engram_offload setting 'queue_depth' must be an integer >= 1, got 2.0"),
    ({"table": "t", "wait_timeout_s": True},
     "engram_offload setting 'wait_timeout_s' must be a number of seconds > 0, got True"),
])
def test_each_refusal_says_exactly_what_to_change(raw, message):
    with pytest.raises(ValueError) as err:
        parse_settings(raw)
    assert str(err.value) == message


def test_the_smallest_values_allowed_are_taken():
    s = parse_settings({"table": "t", "tier": "direct", "queue_depth": 1, "log_every": 0, "wait_timeout_s": 0.5})
    assert (s.queue_depth, s.log_every, s.wait_timeout_s) == (1, 0, 0.5)
    assert parse_settings({"table": "t", "log_every": 1}).log_every == 1


def test_the_graph_mode_refusal_names_the_row_server_or_the_tier():
    fix = "start with --enforce-eager"
    tail = f"reads rows on the host, which a FULL CUDA graph cannot replay: {fix}, or use a tier the GPU reads " \
           "in place (memory, pinned, shared)"
    for raw, where in (({"table": "t", "tier": "direct"}, "the direct tier"),
                       ({"table": "t", "tier": "pinned", "row_server": "/run/rows.sock"},
                        "the row server at /run/rows.sock")):
        with pytest.raises(ValueError) as err:
            check_graph_mode(parse_settings(raw), True, fix)
        assert str(err.value) == f"{where} {tail}"


def test_the_layout_refusal_names_both_models_first_primes():
    other = CONFIG.replace(prime_starts=(101, 101, 101))
    ours, theirs = CONFIG.primes[CONFIG.layer_ids[0]][0], other.primes[other.layer_ids[0]][0]
    with pytest.raises(ValueError) as err:
        check_layout(CONFIG, "t.table", **layout_of(other))
    assert str(err.value) == (f"the table t.table was converted from another model (layer {CONFIG.layer_ids[0]}'s "
                              f"head primes differ (first heads {tuple(ours[:2])} vs {tuple(theirs[:2])})): convert "
                              "this checkpoint's table with `engram-offload convert CHECKPOINT TABLE`")


def test_open_store_takes_every_setting(table):
    store = open_store(parse_settings({"table": str(table), "tier": "mmap", "cache_bytes": 100 * 264,
                                       "fast_cache_bytes": 50 * 264, "policy": "lfu", "admission": True}), None)
    try:
        assert store.tier.name == "mmap"
        levels = store.stats()["levels"]
        assert [level.get("policy") for level in levels if level["level"] != "tier"] == ["lfu", "lfu"]
        assert any(level.get("admission") for level in levels)
    finally:
        store.close()


def test_open_store_hands_the_direct_tiers_options_and_the_tier_itself(table):
    store = open_store(parse_settings({"table": str(table), "tier": "direct", "queue_depth": 8}), None)
    try:
        assert store.tier.name == "direct" and store.tier.queue_depth == 8
    finally:
        store.close()


def test_the_store_key_leaves_out_only_what_does_not_change_the_store():
    plain = parse_settings({"table": "t"})
    assert parse_settings({"table": "t", "log_every": 5, "wait_timeout_s": 3}).store_key() == plain.store_key()
    assert plain.store_key() == tuple(getattr(plain, k) for k in KEYS if k not in ("log_every", "wait_timeout_s"))
    assert parse_settings({"table": "t", "policy": "lru"}).store_key() != plain.store_key()


def test_open_store_takes_a_staging_size(table):
    store = open_store(parse_settings({"table": str(table), "tier": "mmap", "staging_bytes": "1MiB"}), None)
    store.close()
