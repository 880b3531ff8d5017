"""The plugins' settings and start-up checks (no engine needed)."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from engram_offload.engram.config import EngramConfig
from engram_offload.integrations.auto import MachineFacts, read_facts, resolve_tier
from engram_offload.integrations.settings import (
    AUTO,
    KEYS,
    OffloadSettings,
    check_graph_mode,
    check_layout,
    open_store,
    parse_settings,
    settings_from_json,
)
from engram_offload.planner import Assumptions, Workload
from engram_offload.planner.realtext import RealTextMRC
from engram_offload.serving.rowserver import RowClient, start_row_server
from engram_offload.serving.store import TableStore
from engram_offload.units import format_bytes

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
    ({"table": "t", "tier": "mmap", "policy": "fifo"}, "policy 'fifo' is unknown"),
    ({"table": "t", "tier": "mmap", "cache_bytes": "lots"}, "size 'lots' not understood"),
    ({"table": "t", "tier": "mmap", "admission": "yes"}, "'admission' must be true or false"),
    ({"table": 7, "tier": "mmap"}, "'table' must be a string"),
    ({"table": "t", "tier": "direct", "queue_depth": 0}, "'queue_depth' must be an integer >= 1"),
    ({"table": "t", "tier": "mmap", "log_every": -1}, "'log_every' must be an integer >= 0"),
    ({"table": "t", "tier": "mmap", "wait_timeout_s": 0}, "'wait_timeout_s' must be a number of seconds from 0.001 "),
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
    deep = '{"table": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ValueError) as err:
        settings_from_json(deep, "ENGRAM_OFFLOAD_CONFIG")
    assert str(err.value) == ("ENGRAM_OFFLOAD_CONFIG is not valid JSON (nested too deeply to read): give one flat "
                              "object")
    assert settings_from_json('{"table": "x", "tier": "mmap", "wait_timeout_s": 86400}', "ENV").wait_timeout_s == 86400


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


@pytest.mark.parametrize("order", [1, -1])
def test_a_table_whose_later_orders_primes_differ_refused(order):
    """Only one n-gram order's primes differ (the second, the last), in the second layer."""
    layout = layout_of(CONFIG)
    primes = [[list(o) for o in layer] for layer in layout["primes"]]
    primes[1][order][-1] += 2  # the last head of that order
    with pytest.raises(ValueError, match=f"layer {CONFIG.layer_ids[1]}'s head primes differ"):
        check_layout(CONFIG, "t.table", **dict(layout, primes=primes))


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
    ({"table": "t", "tier": "mmap", "log_every": True},
     "engram_offload setting 'log_every' must be an integer >= 0, got True"),
    ({"table": "t", "tier": "direct", "queue_depth": 2.0},
     "engram_offload setting 'queue_depth' must be an integer >= 1, got 2.0"),
    ({"table": "t", "tier": "mmap", "wait_timeout_s": True},
     "engram_offload setting 'wait_timeout_s' must be a number of seconds from 0.001 to 86400, got True"),
    *(({"table": "t", "tier": "mmap", "wait_timeout_s": value},
       f"engram_offload setting 'wait_timeout_s' must be a number of seconds from 0.001 to 86400, got {value!r}")
      for value in (float("inf"), 1e308, 1e-300, float("nan"))),
    *(({"table": "t", "tier": "remote", "pool": "redis://h:1", key: value},
       f"engram_offload setting {key!r} must be a string, not blank, got {value!r}")
      for key, value in (("table", " "), ("table", "\t\n"), ("fallback", ""), ("pool", "  "))),
])
def test_each_refusal_says_exactly_what_to_change(raw, message):
    with pytest.raises(ValueError) as err:
        parse_settings(raw)
    assert str(err.value) == message


def test_the_smallest_values_allowed_are_taken():
    s = parse_settings({"table": "t", "tier": "direct", "queue_depth": 1, "log_every": 0, "wait_timeout_s": 0.5})
    assert (s.queue_depth, s.log_every, s.wait_timeout_s) == (1, 0, 0.5)
    assert parse_settings({"table": "t", "tier": "mmap", "log_every": 1}).log_every == 1


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
    plain = parse_settings({"table": "t", "tier": "mmap"})
    same = {"log_every": 5, "wait_timeout_s": 3, "allow_untested_engine": True}
    assert parse_settings({"table": "t", "tier": "mmap", **same}).store_key() == plain.store_key()
    assert plain.store_key() == tuple(getattr(plain, k) for k in KEYS if k not in same)
    assert parse_settings({"table": "t", "tier": "mmap", "policy": "lru"}).store_key() != plain.store_key()


def test_open_store_takes_a_staging_size(table):
    store = open_store(parse_settings({"table": str(table), "tier": "mmap", "staging_bytes": "1MiB"}), None)
    store.close()


# ---------------------------------------------------------------------- the tier: named, or auto
TABLE = CONFIG.table_bytes
HALF = Assumptions(dram_usable_fraction=0.5)  # exact in binary: the fit's edge is a whole byte


def share_bytes(world, config=CONFIG):
    """The largest rank's rows of the table at ``world`` ranks (vLLM's column split), in bytes."""
    part = -(-config.cols_per_layer // world)
    return max(sum(sum(config.head_sizes(layer)[r * part:(r + 1) * part]) for layer in config.layer_ids)
               for r in range(world)) * config.row_bytes


def auto(world, free, replicas=1, rotational=False, shm_free=None, a=HALF):
    return resolve_tier(parse_settings({"table": "t", "tier": "auto"}), world, replicas=replicas,
                        facts=MachineFacts(free, rotational, shm_free), config=CONFIG, assumptions=a)


def test_the_tier_is_required_and_auto_is_one():
    with pytest.raises(ValueError) as err:
        parse_settings({"table": "t"})
    assert str(err.value) == ("engram_offload needs 'tier': one of memory, pinned, shared, mmap, direct, remote, or "
                              "\"auto\" to choose from this machine's free DRAM and disk")
    with pytest.raises(TypeError):
        OffloadSettings(table="t")  # type: ignore[call-arg]
    assert parse_settings({"table": "t", "tier": "auto", "policy": "lru", "staging_bytes": "1M"}).tier == AUTO
    with pytest.raises(ValueError) as err:
        parse_settings({"table": "t", "tier": "nvme"})
    assert str(err.value) == ("engram_offload tier 'nvme' is unknown: choose one of memory, pinned, shared, mmap, "
                              "direct, remote, or auto")


@pytest.mark.parametrize("raw, message", [
    ({"table": "t", "tier": "auto", "cache_bytes": "1G", "queue_depth": 8},
     "tier auto chooses among pinned, shared, direct and sizes the row cache itself: drop cache_bytes, queue_depth, "
     "or name a tier"),
    ({"table": "t", "tier": "auto", "verify_reads": False},
     "tier auto chooses among pinned, shared, direct and sizes the row cache itself: drop verify_reads, or name a tier"),
    ({"table": "t", "tier": "auto", "row_server": "/run/rows.sock"},
     "tier auto chooses among pinned, shared, direct and sizes the row cache itself: drop row_server, or name a tier"),
    ({"table": "redis://h:1/ab", "tier": "auto"},
     "tier auto chooses a tier of this machine, and a pool URL is read by the remote tier: set tier to remote"),
])
def test_auto_refuses_what_only_a_named_tier_takes(raw, message):
    with pytest.raises(ValueError) as err:
        parse_settings(raw)
    assert str(err.value) == message


def test_auto_is_resolved_before_the_store_or_the_graph_check():
    settings = parse_settings({"table": "t", "tier": "auto"})
    for call in (lambda: open_store(settings, None), lambda: check_graph_mode(settings, True, "fix")):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == "tier auto is chosen at start-up: pass the settings through auto.resolve_tier first"


def test_a_named_tier_is_kept():
    settings = parse_settings({"table": "t", "tier": "mmap"})
    assert resolve_tier(settings, 4, facts=MachineFacts(None, True, None)) == (settings, "tier mmap as set")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_auto_chooses_pinned_while_every_rank_share_fits(world):
    """Each rank's share together are the table: it fits in the usable DRAM up to the byte."""
    settings, why = auto(world, 2 * TABLE)
    assert settings.tier == "pinned" and settings.cache_bytes is None
    assert why == (f"auto chose pinned: {format_bytes(TABLE)} ({world} ranks, up to {format_bytes(share_bytes(world))} "
                   f"a rank) fits in 50% of {format_bytes(2 * TABLE)} free DRAM")
    assert auto(world, 2 * TABLE - 2)[0].tier == "direct"


def test_auto_shares_one_copy_between_replicas_where_dev_shm_holds_it():
    settings, why = auto(2, 2 * TABLE, replicas=3, shm_free=TABLE)
    assert settings.tier == "shared"
    assert why == f"auto chose shared: one {format_bytes(TABLE)} copy for 3 replicas fits in 50% of " \
                  f"{format_bytes(2 * TABLE)} free DRAM"
    assert auto(2, 2 * TABLE, replicas=3, shm_free=TABLE - 1)[0].tier == "direct"  # 3 private copies do not fit
    settings, why = auto(2, 6 * TABLE, replicas=3, shm_free=TABLE - 1)
    assert settings.tier == "pinned" and why.startswith(f"auto chose pinned: {format_bytes(3 * TABLE)} (3 replicas x "
                                                        "2 ranks, up to ")


def test_auto_chooses_direct_behind_the_planners_row_cache():
    """V4.1-Flash's layout at TP 4: the smallest cache reaching the planner's target on real text,
    or what the DRAM allows."""
    v41, gib = EngramConfig.from_name("deepseek-v4.1-flash"), 1 << 30
    settings = parse_settings({"table": "t", "tier": "auto"})
    chosen, why = resolve_tier(settings, 4, facts=MachineFacts(200 * gib, False, None), config=v41)
    assert why == ("auto chose direct: 188.8 GiB (4 ranks, up to 47.2 GiB a rank) does not fit in 80% of 200.0 GiB "
                   "free DRAM; a 28.6 GiB row cache a rank (90% hits on real text)")
    rows = chosen.cache_bytes // v41.row_bytes
    assert chosen.tier == "direct" and chosen.cache_bytes == rows * v41.row_bytes
    curve = RealTextMRC(v41.rows_per_token // 4, share_bytes(4, v41) // v41.row_bytes)  # the largest rank's rows
    assert curve.hit_ratio(rows) >= Workload().target_hit_rate > curve.hit_ratio(rows - 1)
    chosen, why = resolve_tier(settings, 4, facts=MachineFacts(100 * gib, False, None), config=v41)
    assert chosen.cache_bytes == int(0.8 * 100 * gib // (4 * v41.row_bytes)) * v41.row_bytes  # all it may take
    assert why.endswith("; a 20.0 GiB row cache a rank (85% hits on real text)")
    chosen, why = auto(2, 100)  # no DRAM to speak of: no cache
    assert chosen.tier == "direct" and chosen.cache_bytes is None and why.endswith("; a 0 B row cache a rank (0% hits "
                                                                                   "on real text)")


def test_auto_under_cuda_graphs_chooses_only_a_tier_read_in_place():
    v41, gib = EngramConfig.from_name("deepseek-v4.1-flash"), 1 << 30
    settings = parse_settings({"table": "t", "tier": "auto"})
    fix = "start vLLM with --enforce-eager"
    chosen, _ = resolve_tier(settings, 4, facts=MachineFacts(300 * gib, False, None), config=v41, graphs_fix=fix)
    assert chosen.tier == "pinned"  # fits: the graphs do not matter
    with pytest.raises(ValueError) as err:
        resolve_tier(settings, 4, facts=MachineFacts(200 * gib, False, None), config=v41, graphs_fix=fix)
    assert str(err.value) == ("tier auto found no tier the GPU reads in place: 188.8 GiB (4 ranks, up to 47.2 GiB a "
                              "rank) does not fit in 80% of 200.0 GiB free DRAM, and a tier read on the host (direct) "
                              "cannot run in the engine's CUDA graphs: start vLLM with --enforce-eager, or free DRAM")


def test_auto_refuses_what_it_cannot_judge():
    with pytest.raises(ValueError) as err:
        auto(4, TABLE, rotational=True)
    assert str(err.value) == (f"tier auto found no tier: {format_bytes(TABLE)} (4 ranks, up to "
                              f"{format_bytes(share_bytes(4))} a rank) does not fit in 50% of {format_bytes(TABLE)} "
                              "free DRAM, and t is on a rotational disk: free DRAM, move the table to NVMe, or name "
                              "a tier")
    assert auto(4, 2 * TABLE, rotational=True)[0].tier == "pinned"  # the disk matters only when DRAM does not hold it
    with pytest.raises(ValueError) as err:
        auto(4, None)
    assert str(err.value) == "tier auto cannot tell this machine's free DRAM (no MemAvailable): name a tier"


def test_auto_reads_the_tables_layout_and_this_machines_facts(table):
    facts = read_facts(str(table))
    assert isinstance(facts.free_dram, int) and facts.free_dram > 0  # Linux: MemAvailable
    assert facts.rotational in (True, False, None) and (facts.shm_free is None or facts.shm_free >= 0)
    settings = parse_settings({"table": str(table), "tier": "auto"})
    chosen, why = resolve_tier(settings, 2, facts=MachineFacts(2 * TABLE, False, None))  # the default 80%
    assert chosen == OffloadSettings(table=str(table), tier="pinned")
    assert why.endswith(f"fits in 80% of {format_bytes(2 * TABLE)} free DRAM")
