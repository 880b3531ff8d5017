"""The remote tier and the pool commands against real Redis servers on 127.0.0.1."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import xxhash

from engram_offload.errors import ChecksumError, TierError
from engram_offload.pool.client import PoolClient, PoolError, key_slot
from engram_offload.pool.key import KEY_ENV, PoolKey, PoolKeyError, load_key
from engram_offload.pool.layout import POOL_LAYOUT_VERSION, PoolLayout, PoolLayoutError, fingerprint, rows_with_sums
from engram_offload.pool.publish import (
    _complete_record,
    _hgetall,
    drop_table,
    pool_status,
    publish_table,
    read_pool_table,
)
from engram_offload.pool.servers import free_port_base
from engram_offload.table import make_random_table, read_header
from engram_offload.tiers import open_tier
from engram_offload.tiers.remote import RemoteTier, open_pool_table

from redis_servers import fresh_pool, migrate_slot, redis_cluster, redis_single, skip_without_redis  # noqa: F401
from second_uid import NOBODY, in_child, needs_root
from tier_cases import FORMATS
from tiny_tables import tiny_config

EXTENT_ROWS = 97  # small and odd: many extents, some of them short


@pytest.fixture(scope="module", autouse=True)
def pool_key_file(tmp_path_factory):
    """``$ENGRAM_OFFLOAD_POOL_KEY``: the module's own key file (written by the first publish)."""
    path = tmp_path_factory.mktemp("pool-key") / "pool.key"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KEY_ENV, str(path))
        yield path


def read(tier, ids) -> np.ndarray:
    out = torch.empty((len(ids), tier.row_bytes), dtype=torch.uint8)
    return tier.read_rows(np.asarray(ids, np.int64), out).numpy()


def read_counted(tier, ids) -> tuple[np.ndarray, int, int]:
    """The rows of ``ids``, and the ranges and bytes the tier read from the pool for them."""
    before = tier.stats()
    rows = read(tier, ids)
    after = tier.stats()
    return rows, after["reads"] - before.get("reads", 0), after["bytes_read"] - before.get("bytes_read", 0)


def edge_ids(playout: PoolLayout) -> np.ndarray:
    """The first and last row of every extent."""
    return np.concatenate([playout.starts, playout.starts + playout.counts - 1])


def pool_keys(url: str) -> dict[bytes, str]:
    """Every key in the pool -> xxh3 of its value (strings) or of its hash fields."""
    with PoolClient(url) as client:
        out = {}
        for key in client.scan("*"):
            kind = client.call("TYPE", key)
            value = client.call("GET", key) if kind == b"string" else b"\0".join(client.call("HGETALL", key))
            out[key] = xxhash.xxh3_64_hexdigest(value)
    return out


@pytest.fixture(scope="module")
def second_table(tmp_path_factory):
    """Same layout as the bf16 table of ``tables`` but other rows: another fingerprint."""
    path = tmp_path_factory.mktemp("second") / "bf16-80-seed12.tbl"
    return make_random_table(path, tiny_config("bf16", 80), seed=12)


@pytest.mark.parametrize("fmt", FORMATS, ids=[f"{f}-{d}" for f, d in FORMATS])
@pytest.mark.parametrize("which", ["single", "cluster"])
def test_rows_equal_memory_at_every_extent_edge(tables, fmt, which, request):
    pool = request.getfixturevalue(f"redis_{which}")
    path, _ = tables[fmt]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    header = read_header(path)
    with open_tier("memory", header) as memory, RemoteTier(header, pool=pool.url) as remote:
        n = remote.num_rows
        rng = np.random.default_rng(3)
        ids = np.concatenate([edge_ids(remote.pool_layout), rng.integers(0, n, 500), [n - 1, 0, 0, 5, 4, 6]])
        assert np.array_equal(read(remote, ids), read(memory, ids))
        assert np.array_equal(read(remote, np.arange(n)), read(memory, np.arange(n)))  # merged ranges
        assert remote.stats()["nodes"] == (3 if which == "cluster" else 1)


def test_extents_follow_the_table_heads(tables):
    header = read_header(tables[("fp32", 64)][0])
    playout = PoolLayout(header, EXTENT_ROWS)
    config = header.config
    assert playout.starts[0] == 0 and playout.starts[-1] + playout.counts[-1] == config.num_rows
    assert np.array_equal(playout.starts[1:], playout.starts[:-1] + playout.counts[:-1])  # tiling
    layer = config.layer_ids[1]
    head_start = config.layer_row_base(layer) + config.head_offsets(layer)[3]
    k = playout.keys.index(f"{playout.fingerprint}:engram:l{layer}:h3:e0")
    assert playout.starts[k] == head_start and playout.counts.max() == EXTENT_ROWS


def test_open_by_fingerprint_without_the_file(tables, redis_cluster):
    path, _ = tables[("int8", 64)]
    result = publish_table(path, redis_cluster.url, extent_rows=EXTENT_ROWS, progress=False)
    with open_pool_table(f"{redis_cluster.url}/{result['fingerprint']}") as remote, \
            open_tier("memory", read_header(path)) as memory:
        assert remote.header.config == memory.header.config
        ids = np.arange(remote.num_rows)[::-3].copy()  # memory tier: a reversed view fails (reported)
        assert np.array_equal(read(remote, ids), read(memory, ids))
    with pytest.raises(PoolError, match="not in the pool"):
        open_pool_table(f"{redis_cluster.url}/0123456789abcdef")


def test_a_file_that_is_not_the_named_table_is_refused(tables, second_table, redis_single):
    path, _ = tables[("bf16", 80)]
    publish_table(path, redis_single.url, extent_rows=EXTENT_ROWS, progress=False)
    with pytest.raises(PoolError, match="names table"):
        RemoteTier(read_header(second_table), pool=f"{redis_single.url}/{fingerprint(read_header(path))}")
    with pytest.raises(ValueError, match="not the pooled table"):
        RemoteTier(read_header(path), pool=redis_single.url, fallback=second_table)


def test_a_half_finished_publish_is_not_served_and_resumes(tables, fresh_pool):
    pool = fresh_pool(1)
    path, _ = tables[("fp16", 48)]
    total = PoolLayout(read_header(path), EXTENT_ROWS).num_extents

    def interrupt(extent):
        if extent == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False, on_extent=interrupt)
    with pytest.raises(PoolError, match="not completely published"):
        RemoteTier(read_header(path), pool=pool.url)
    assert not pool_status(pool.url)["tables"][0]["complete"]
    result = publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    assert (result["skipped"], result["sent"]) == (5, total - 5)
    with RemoteTier(read_header(path), pool=pool.url) as remote, open_tier("memory", read_header(path)) as memory:
        assert np.array_equal(read(remote, np.arange(remote.num_rows)), read(memory, np.arange(remote.num_rows)))
    with pytest.raises(PoolError, match="extents of 97 rows"):
        publish_table(path, pool.url, extent_rows=50, progress=False)


def test_a_missing_extent_raises_naming_it(tables, fresh_pool):
    pool = fresh_pool(1)
    path, _ = tables[("fp32", 64)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=pool.url, retries=1, retry_backoff_s=0) as remote:
        victim = remote.pool_layout.keys[7]
        with PoolClient(pool.url) as client:
            client.call("DEL", victim)
        with pytest.raises(TierError, match=f"extent {victim} .*missing"):
            read(remote, [int(remote.pool_layout.starts[7]) + 1])
        assert remote.stats()["retries"] == 1
        read(remote, [int(remote.pool_layout.starts[8])])  # other extents still serve


def flip_in_pool(url: str, key: str, offset: int) -> bytes:
    """Flip one byte of ``key``'s value at ``offset`` in the pool; return the byte it held."""
    with PoolClient(url) as client:
        old = client.call("GETRANGE", key, offset, offset)
        client.call("SETRANGE", key, offset, bytes([old[0] ^ 0x5A]))
    return old


def restore_in_pool(url: str, key: str, offset: int, old: bytes) -> None:
    with PoolClient(url) as client:
        client.call("SETRANGE", key, offset, old)


@pytest.mark.parametrize("where", ["row", "checksum"])
def test_a_row_altered_in_the_pool_raises_naming_it_or_comes_from_the_fallback(tables, fresh_pool, where):
    pool = fresh_pool(3)
    path, expected = tables[("bf16", 80)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    header = read_header(path)
    options = dict(pool=pool.url, retries=1, retry_backoff_s=0)
    with RemoteTier(header, **options) as bare, RemoteTier(header, fallback=path, **options) as guarded:
        playout = bare.pool_layout
        extent, within = 5, 40
        row = int(playout.starts[extent]) + within
        key = playout.keys[extent]
        offset = within * playout.stride + (7 if where == "row" else header.layout.row_bytes + 2)
        flip_in_pool(pool.url, key, offset)
        with PoolClient(pool.url) as client:
            node = client.address(client.node_of(key))
        for ids in ([row], np.arange(row - 30, row + 30), np.arange(header.layout.num_rows)):  # one row, merged ranges
            with pytest.raises(TierError, match=f"pool node {node}: row {row} of extent {key} failed its checksum.*"
                                                r"drop and publish the table again: engram-offload pool drop "
                                                f"{playout.fingerprint}, pool publish TABLE\\), and no fallback "
                                                "tier is configured$"):
                read(bare, ids)
            assert np.array_equal(read(guarded, ids), expected[ids])
        assert bare.stats()["checksum_rereads"] == 3 and bare.stats()["checksum_failures"] == 3
        assert guarded.stats()["fallback_rows"] == 3
        others = np.delete(np.arange(header.layout.num_rows), row)
        assert np.array_equal(read(bare, others), expected[others])


def test_a_transient_bad_row_is_read_again_and_served(tables, fresh_pool):
    pool = fresh_pool(1)
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=pool.url) as remote:
        key, offset = remote.pool_layout.keys[2], 10 * remote.stride + 5
        old = flip_in_pool(pool.url, key, offset)
        real_fetch, fetches = remote._fetch, []

        def fetch_then_restore(jobs):
            got = real_fetch(jobs)
            if not fetches:  # the bad byte came back once; the pool is whole again for the re-read
                restore_in_pool(pool.url, key, offset, old)
            fetches.append(len(jobs))
            return got

        remote._fetch = fetch_then_restore
        ids = np.arange(remote.num_rows)
        assert np.array_equal(read(remote, ids), expected)
        assert fetches == [1, 1]  # the request, then the one bad row again
        stats = remote.stats()
        assert stats["checksum_rereads"] == 1 and stats.get("checksum_failures", 0) == 0


def test_bad_rows_on_several_nodes_are_read_again_each_from_its_node(tables, fresh_pool):
    """Transiently bad rows of extents on two nodes, the lower row id on the later node: the
    re-read asks each node for its own rows and puts every row back in its place."""
    pool = fresh_pool(3)
    path, expected = tables[("bf16", 80)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=pool.url, retries=0) as remote:
        playout, (addresses, node_of) = remote.pool_layout, remote._topology
        assert len(addresses) == 3
        low = next(e for e in range(len(playout.keys)) if node_of[e] > 0)  # its node is not the first
        high = next(e for e in range(low + 1, len(playout.keys)) if node_of[e] < node_of[low])
        flips = [(playout.keys[e], 4 * remote.stride + 9) for e in (low, high)]
        olds = [flip_in_pool(pool.url, key, offset) for key, offset in flips]
        real_fetch, fetches = remote._fetch, []

        def fetch_then_restore(jobs):
            got = real_fetch(jobs)
            if not fetches:  # the bad bytes came back once; the pool is whole again for the re-read
                for (key, offset), old in zip(flips, olds):
                    restore_in_pool(pool.url, key, offset, old)
            fetches.append(sorted(job.address for job in jobs))
            return got

        remote._fetch = fetch_then_restore
        ids = np.arange(remote.num_rows)
        assert np.array_equal(read(remote, ids), expected)
        assert fetches[1] == sorted([addresses[node_of[low]], addresses[node_of[high]]])  # one job a node
        stats = remote.stats()
        assert stats["checksum_rereads"] == 2 and stats.get("checksum_failures", 0) == 0


def test_repeated_ids_are_read_once_and_stats_name_the_pool(tables, redis_single):
    path, expected = tables[("int8", 64)]
    publish_table(path, redis_single.url, extent_rows=EXTENT_ROWS, progress=False)
    header = read_header(path)
    with RemoteTier(header, pool=redis_single.url) as bare, \
            RemoteTier(header, pool=redis_single.url, fallback=path) as guarded:
        sparse = [0, 0, *range(100, 1700, 100)]  # 17 rows far apart, one twice: too few neighbours to merge
        for ids, ranges, rows in (([3, 3], 1, 1), ([3, 3, 500], 2, 2), ([500, 3], 2, 2), ([7], 1, 1),
                                  ([5, 3], 1, 3), (sparse, 17, 17)):  # 3 and 5: one range, the row between too
            got, read_ranges, read_bytes = read_counted(bare, ids)
            assert np.array_equal(got, expected[ids])
            assert (read_ranges, read_bytes) == (ranges, rows * bare.stride)  # no row twice
        stats = bare.stats()
        assert {key: stats[key] for key in ("pool", "nodes", "fingerprint", "extent_rows", "fallback")} == {
            "pool": redis_single.url, "nodes": 1, "fingerprint": fingerprint(header), "extent_rows": EXTENT_ROWS,
            "fallback": None}
        assert guarded.stats()["fallback"] == guarded._fallback.name == "mmap"


def test_neighbouring_rows_merge_into_one_range_only_when_that_saves_a_sixteenth(tables, redis_single):
    """merge_gap_bytes of two rows: rows at most 3 apart in one extent share a range, but only
    when the merges save at least 1/16 of the commands; a merged range reads the rows between."""
    path, expected = tables[("int8", 64)]
    publish_table(path, redis_single.url, extent_rows=EXTENT_ROWS, progress=False)
    header = read_header(path)
    with RemoteTier(header, pool=redis_single.url) as probe:
        stride = probe.stride
    far = [int(i) for i in range(300, 300 + 15 * 200, 200)]  # 15 rows of 15 extents, far apart
    with RemoteTier(header, pool=redis_single.url, merge_gap_bytes=2 * stride) as remote:
        for ids, ranges, rows in (
                ([0, 3], 1, 4), ([0, 4], 2, 2),  # 3 apart: merged; 4 apart: not
                ([96, 97], 2, 2),  # neighbours across an extent's end: never one range
                ([5, 200, 201], 2, 3),  # the merge of two rows that are not the first ones
                ([0, 1, *far[:14]], 15, 16),  # 16 ids, one merge: it saves 1/16, done
                ([0, 1, *far], 17, 17)):  # 17 ids, one merge: less than 1/16, not done
            got, read_ranges, read_bytes = read_counted(remote, ids)
            assert np.array_equal(got, expected[ids])
            assert (read_ranges, read_bytes) == (ranges, rows * stride), ids


def test_a_node_that_fails_once_is_read_again_and_every_nodes_rows_land_in_place(tables, fresh_pool):
    pool = fresh_pool(3)
    path, expected = tables[("bf16", 80)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=pool.url, retries=1, retry_backoff_s=0) as remote:
        addresses, _ = remote._topology
        real_fetch, calls = remote._fetch, []

        def second_node_fails_once(jobs):
            done, failures = real_fetch(jobs)
            calls.append([job.address for job in jobs])
            if len(calls) == 1:  # the first request: the middle node's answer is lost
                failures += [(job, "injected") for job, _, _ in done if job.address == addresses[1]]
                done = [item for item in done if item[0].address != addresses[1]]
            return done, failures

        remote._fetch = second_node_fails_once
        rng = np.random.default_rng(5)
        for ids in (np.arange(remote.num_rows), np.sort(rng.choice(remote.num_rows, 400, replace=False))):
            calls.clear()
            assert np.array_equal(read(remote, ids), expected[ids])
            assert calls[1] == [addresses[1]]  # only the failed node is asked again
        stats = remote.stats()
        assert stats["retries"] == 2 and stats.get("checksum_rereads", 0) == 0  # no row landed out of place


def test_an_extent_moved_to_another_node_is_read_there_after_one_retry_with_every_row_in_place(tables, fresh_pool):
    """A reshard finished under the tier: the old owner answers MOVED, the node's request fails,
    and its runs are asked again of their new owners, landing where each run belongs (the
    owner's remaining runs are no longer back to back in the data)."""
    pool = fresh_pool(3)
    path, expected = tables[("bf16", 80)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=pool.url, retries=1, retry_backoff_s=0) as remote:
        playout, (addresses, node_of) = remote.pool_layout, remote._topology
        owned = [e for e in range(len(playout.keys)) if node_of[e] == node_of[0]]
        moved = owned[len(owned) // 2]  # between other extents of its node
        slot = key_slot(playout.keys[moved])
        source, target, _, dst_id = migrate_slot(pool, slot)
        conn = source.connect(5.0)
        try:
            for key in conn.call("CLUSTER", "GETKEYSINSLOT", slot, 100):
                assert conn.call("MIGRATE", "127.0.0.1", target.port, key, 0, 5000) == b"OK"
        finally:
            conn.close()
        for node in pool.nodes:  # every node told the new owner, as redis-cli --cluster reshard does
            conn = node.connect(5.0)
            try:
                assert conn.call("CLUSTER", "SETSLOT", slot, "NODE", dst_id) == b"OK"
            finally:
                conn.close()
        ids = np.arange(remote.num_rows)
        assert np.array_equal(read(remote, ids), expected)
        stats = remote.stats()
        assert stats["retries"] == 1 and stats.get("checksum_rereads", 0) == 0
        assert np.array_equal(read(remote, ids), expected) and remote.stats()["retries"] == 1  # the new map kept


def test_a_node_marked_down_skips_only_its_own_rows_and_a_thread_keeps_one_connection_a_node(tables, fresh_pool):
    pool = fresh_pool(3)
    path, expected = tables[("int8", 64)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=pool.url, fallback=path, down_s=600) as remote:
        addresses, node_of = remote._topology
        ids = np.arange(remote.num_rows)
        for _ in range(3):
            assert np.array_equal(read(remote, ids), expected)
        assert sorted(conn.address for conn in remote._conns) == sorted(addresses)  # reused, read after read
        remote._mark_down(addresses[0])  # the first node's job is skipped; the others are still sent
        assert np.array_equal(read(remote, ids), expected)
        stats = remote.stats()
        on_first = int(sum(remote.pool_layout.counts[node_of == 0]))
        assert stats["down_skips"] == 1 and stats["fallback_rows"] == on_first
        assert stats.get("checksum_rereads", 0) == 0  # no other node's rows went missing
        worker = threading.Thread(target=read, args=(remote, ids))
        worker.start()
        worker.join(30)
        assert len(remote._conns) == 3 + 2  # the other thread's own, to the two nodes up


def test_a_node_address_is_split_at_its_last_colon(monkeypatch):
    import engram_offload.tiers.remote as remote_module

    tier, made = bare_tier(), []
    tier._local, tier._conns_lock, tier._conns, tier.timeout_s = threading.local(), threading.Lock(), [], 0.5

    class Client:
        auth = ("user", "secret")

    class Recorded:
        def __init__(self, *args):
            made.append(args)

    tier._client = Client()
    monkeypatch.setattr(remote_module, "NodeConnection", Recorded)
    first = tier._connection("::1:6379")
    assert tier._connection("::1:6379") is first and tier._conns == [first]
    tier._connection("127.0.0.1:7000")
    assert made == [("::1", 6379, 0.5, ("user", "secret")), ("127.0.0.1", 7000, 0.5, ("user", "secret"))]


def test_a_pool_of_two_nodes_serves_every_row_from_its_owner(tables, fresh_pool):
    pool = fresh_pool(2)
    path, expected = tables[("fp16", 48)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=pool.url, retries=0) as remote:
        assert len(remote._topology[0]) == 2
        assert np.array_equal(read(remote, np.arange(remote.num_rows)), expected)
        assert remote.stats().get("retries", 0) == 0


def bare_tier(stride: int = 16) -> RemoteTier:
    """A remote tier with no pool behind it, for its reply handling alone."""
    tier = RemoteTier.__new__(RemoteTier)
    tier.stride = stride
    return tier


def job_of(runs: int, nbytes: int = 0):
    from engram_offload.tiers.remote import _Job

    pieces = np.array([piece for i in range(runs) for piece in (b"<key %d>" % i, b"<range %d>" % i)], object)
    return _Job("127.0.0.1:1", np.arange(runs), b"".join(pieces.tolist()), nbytes, None, pieces)


@pytest.mark.parametrize("replies, why", [
    ([b"x" * 16, "ERR boom"], "error reply 'ERR boom'"),
    ([None], "got nothing for a range of whole rows: the extent is missing or foreign (the node lost its data? "
             "publish the table again)"),
    ([b""], "got nothing for a range of whole rows"),
    ([b"x" * 16, b"x" * 20], "got 20 bytes for a range of whole rows"),
    ([b"x" * 16, b"x" * 32], "48 bytes for 64"),
], ids=["error", "nil", "empty", "part-row", "short"])
def test_a_nodes_bad_replies_are_named_by_the_first_bad_one(replies, why):
    import hiredis

    replies = [hiredis.ReplyError(r) if isinstance(r, str) else r for r in replies]
    assert bare_tier()._diagnose(job_of(len(replies), nbytes=64), replies).startswith(why)


class AskedNode:
    """A node that answers ASKING and the re-sent reads, recording what it was sent."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.sent, self.asked = fail, [], []

    def send(self, data: bytes) -> None:
        if self.fail:
            raise ConnectionRefusedError("refused")
        self.sent.append(data)

    def read_replies(self, n):
        self.asked.append(n)
        return [b"+OK" if i % 2 == 0 else b"rows of %d" % i for i in range(n)]


def test_ask_redirects_are_followed_node_by_node_and_others_left_as_they_are():
    import hiredis

    from engram_offload.tiers.remote import _ASKING

    tier, forgotten = bare_tier(), []
    nodes = {"127.0.0.1:3": AskedNode(fail=True), "127.0.0.1:2": AskedNode()}
    tier._connection = nodes.__getitem__
    tier._forget = forgotten.append
    job = job_of(5)
    replies = [b"row 0", hiredis.ReplyError("ASK 10 127.0.0.1:3"), hiredis.ReplyError("MOVED 11 127.0.0.1:2"),
               hiredis.ReplyError("ASK 12 127.0.0.1:2"), hiredis.ReplyError("ASK 12 127.0.0.1:2")]
    got = tier._follow_asks(job, replies)
    asked = nodes["127.0.0.1:2"]
    assert asked.sent == [_ASKING + b"<key 3><range 3>" + _ASKING + b"<key 4><range 4>"]
    assert asked.asked == [4]  # ASKING's reply and the read's, for each run
    assert forgotten == ["127.0.0.1:3"]  # its stream state is unknown after a failure
    assert got[:3] == replies[:3] and got[3:] == [b"rows of 1", b"rows of 3"]  # a failed node leaves the ASK
    assert tier._follow_asks(job, replies[:1] + replies[2:3]) == [replies[0], replies[2]]  # no ASK: as they were


def test_open_pool_table_needs_a_fingerprint_and_reads_the_head_within_the_tiers_timeout(tables, redis_single,
                                                                                        monkeypatch):
    import engram_offload.tiers.remote as remote_module

    with pytest.raises(ValueError) as caught:
        open_pool_table(redis_single.url)
    assert str(caught.value) == (f"{redis_single.url!r} names no table: use redis://host:port[,host:port...]/"
                                 "FINGERPRINT (fingerprints: engram-offload pool status)")
    path, expected = tables[("int8", 64)]
    publish_table(path, redis_single.url, extent_rows=EXTENT_ROWS, progress=False)
    url = f"{redis_single.url}/{fingerprint(read_header(path))}"
    timeouts = []

    class Recording(PoolClient):
        def __init__(self, urls, timeout=5.0):
            timeouts.append(timeout)
            super().__init__(urls, timeout=timeout)

    monkeypatch.setattr(remote_module, "PoolClient", Recording)
    with open_pool_table(url) as default, open_pool_table(url, timeout_s=0.75, retries=4) as tuned:
        assert timeouts == [2.0, 2.0, 0.75, 0.75]  # the head's read, then the tier's own client
        assert (default.timeout_s, default.retries) == (2.0, 2) and (tuned.timeout_s, tuned.retries) == (0.75, 4)
        assert np.array_equal(read(tuned, [0, 5, 700]), expected[[0, 5, 700]])


def as_old_layout(url: str, path, version: int) -> None:
    """Rewrite a published table as an older pool layout wrote it: version 1 bare rows, versions 2
    and 4 each row followed by a 4-byte checksum of its bytes, version 3 a header naming a
    format-2 table by its block digests."""
    import json

    import xxhash

    playout = PoolLayout(read_header(path), EXTENT_ROWS)
    rb = playout.header.layout.row_bytes
    with PoolClient(url) as client:
        for key in playout.keys:
            rows = np.frombuffer(client.call("GET", key), np.uint8).reshape(-1, playout.stride).copy()
            if version == 1:
                client.call("SET", key, rows[:, :rb].tobytes())
            elif version in (2, 4):
                sums = np.array([xxhash.xxh3_64_intdigest(row[:rb].tobytes()) & 0xFFFFFFFF for row in rows], "<u4")
                rows[:, rb: rb + 4] = sums.view(np.uint8).reshape(-1, 4)  # the low half of each row's XXH3
                client.call("SET", key, rows[:, : rb + 4].tobytes())
        record = json.loads(client.call("GET", playout.header_key))
        record["pool_layout"] = version
        if version == 1:
            del record["row_checksum"]
        if version == 3:
            del record["sums_digest"]
            record["block_digests"] = "00" * 8
            record["table"].update(version=2, block_size=1 << 20, num_blocks=1)
        client.call("SET", playout.header_key, json.dumps(record, sort_keys=True).encode())


@pytest.mark.parametrize("version, why", [(1, "rows without checksums"), (2, "row checksums not bound"),
                                          (3, "tables named by their block digests"), (4, "row checksums not keyed")])
def test_a_pool_of_an_old_layout_is_refused_until_published_again(tables, fresh_pool, capsys, version, why):
    pool = fresh_pool(1)
    path, expected = tables[("fp16", 48)]
    header = read_header(path)
    fp = fingerprint(header)
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    as_old_layout(pool.url, path, version)
    for opening in (lambda: RemoteTier(header, pool=pool.url), lambda: open_pool_table(f"{pool.url}/{fp}")):
        with pytest.raises(PoolLayoutError, match=f"pool layout version {version} .*{why}.*re-publish with "
                           "engram-offload pool publish"):
            opening()
    [status] = pool_status(pool.url)["tables"]
    assert status["pool_layout"] == version and not status["complete"] and "re-publish" in status["problems"][0]
    assert pool_cli(["pool", "status", "--pool", pool.url]) == 0
    out = capsys.readouterr().out  # a version-3 header is not read as a table: no row counts
    assert "INCOMPLETE: " in out and f"published with pool layout version {version} " in out
    result = publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    assert result["sent"] == result["extents"]  # every old extent replaced
    assert pool_status(pool.url)["tables"][0]["pool_layout"] == POOL_LAYOUT_VERSION
    with RemoteTier(header, pool=pool.url) as remote:
        assert np.array_equal(read(remote, np.arange(remote.num_rows)), expected)


def test_publishing_a_damaged_file_fails_and_leaves_no_complete_table(tables, fresh_pool, tmp_path):
    pool = fresh_pool(1)
    source, _ = tables[("bf16", 80)]
    path = tmp_path / "damaged.tbl"
    path.write_bytes(source.read_bytes())
    header = read_header(path)
    layout = header.layout
    page = layout.num_pages - 3
    with open(path, "r+b") as f:  # one byte of a row in a late page: many extents go out first
        f.seek(layout.data_offset + page * layout.page_bytes + 2 * layout.row_bytes + 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ChecksumError, match=f"data page {page} "):
        publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with PoolClient(pool.url) as client:
        assert client.call("GET", PoolLayout(header, EXTENT_ROWS).complete_key) is None
    assert not pool_status(pool.url)["tables"][0]["complete"]
    with pytest.raises(PoolError, match="not completely published"):
        RemoteTier(header, pool=pool.url)


def test_a_killed_node_fails_over_or_raises_and_serves_after_republish(tables, fresh_pool):
    pool = fresh_pool(3)
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    header = read_header(path)
    ids = np.arange(header.layout.num_rows)
    options = dict(pool=pool.url, retries=2, timeout_s=0.5, retry_backoff_s=0.01)
    with RemoteTier(header, fallback=path, **options) as guarded, RemoteTier(header, **options) as bare:
        assert np.array_equal(read(guarded, ids), expected) and np.array_equal(read(bare, ids), expected)
        with PoolClient(pool.url) as client:  # a node holding extents but not the table's manifest
            meta = client.address(client.node_of(PoolLayout(header, EXTENT_ROWS).header_key))
        victim = next(node for node in pool.nodes if f"127.0.0.1:{node.port}" != meta)
        victim.kill()
        start = time.monotonic()
        assert np.array_equal(read(guarded, ids), expected)  # the lost nodes' rows from the fallback
        assert time.monotonic() - start < 5
        assert 0 < guarded.stats()["fallback_rows"] < len(ids)
        start = time.monotonic()
        with pytest.raises(TierError, match=f"pool node 127.0.0.1:{victim.port} failed for extent "):
            read(bare, ids)
        assert time.monotonic() - start < 5
        victim.start()  # back empty: nothing is persisted
        pool.wait_ready()
        with pytest.raises(TierError, match="missing"):
            read(bare, ids)
        result = publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
        assert 0 < result["sent"] < result["extents"]
        assert np.array_equal(read(bare, ids), expected)


def test_a_second_table_and_its_drop_leave_the_first_untouched(tables, second_table, fresh_pool):
    pool = fresh_pool(3)
    first, _ = tables[("bf16", 80)]
    publish_table(first, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    before = pool_keys(pool.url)
    result = publish_table(second_table, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    after = pool_keys(pool.url)
    assert {k: after[k] for k in before} == before and len(after) > len(before)
    assert {t["fingerprint"] for t in pool_status(pool.url)["tables"]} == {
        fingerprint(read_header(first)), result["fingerprint"]}
    assert drop_table(pool.url, result["fingerprint"]) == len(after) - len(before)
    assert pool_keys(pool.url) == before
    assert drop_table(pool.url, result["fingerprint"]) == 0
    with RemoteTier(read_header(first), pool=pool.url) as remote, open_tier("memory", read_header(first)) as memory:
        assert np.array_equal(read(remote, np.arange(remote.num_rows)), read(memory, np.arange(remote.num_rows)))


def pool_cli(argv: list[str]) -> int:
    from engram_offload.commands import pool

    parser = argparse.ArgumentParser(prog="engram-offload")
    pool.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_publish_status_drop(tables, fresh_pool, capsys):
    pool = fresh_pool(1)
    path, _ = tables[("int8", 64)]
    fp = fingerprint(read_header(path))
    assert pool_cli(["pool", "publish", str(path), "--pool", pool.url, "--extent-rows", "500", "--no-progress"]) == 0
    assert f"table {fp} is in the pool" in capsys.readouterr().out
    assert pool_cli(["pool", "status", "--pool", pool.url]) == 0
    out = capsys.readouterr().out
    assert f"table {fp}: " in out and out.rstrip().endswith(f"rows, pool layout v{POOL_LAYOUT_VERSION}, complete")
    assert pool_cli(["pool", "drop", fp, "--pool", pool.url]) == 0
    assert "keys deleted" in capsys.readouterr().out
    assert pool_cli(["pool", "status", "--pool", pool.url]) == 0
    assert "no tables" in capsys.readouterr().out


def test_cli_serve_starts_a_cluster_and_stops_it(tmp_path):
    skip_without_redis()
    port = free_port_base(3)
    code = ("import argparse, sys; from engram_offload.commands import pool; p = argparse.ArgumentParser(); "
            "pool.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))")
    proc = subprocess.Popen([sys.executable, "-c", code, "pool", "serve", "--pool-nodes", "3", "--port", str(port),
                             "--dir", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert "serving a Redis Cluster on redis://127.0.0.1:" in proc.stdout.readline()
        with PoolClient(f"redis://127.0.0.1:{port + 2}") as client:
            assert client.cluster and len(client.nodes) == 3
            assert client.each_node("CONFIG", "GET", "appendonly") == [[b"appendonly", b"no"]] * 3
            assert client.each_node("CONFIG", "GET", "save") == [[b"save", b""]] * 3
            assert client.each_node("CONFIG", "GET", "bind") == [[b"bind", b"127.0.0.1"]] * 3
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(15) == 0
    with pytest.raises(PoolError, match="no pool node answers"):
        PoolClient(f"redis://127.0.0.1:{port}", timeout=1)


def test_a_password_protected_pool(tables, fresh_pool):
    pool = fresh_pool(1)
    path, expected = tables[("fp32", 64)]
    with PoolClient(pool.url) as client:
        client.each_node("CONFIG", "SET", "requirepass", "s3cret")
    url = pool.url.replace("redis://", "redis://:s3cret@")
    publish_table(path, url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=url) as remote:
        assert np.array_equal(read(remote, np.arange(remote.num_rows)), expected)
        assert "s3cret" not in remote.stats()["pool"] and ":***@" in remote.stats()["pool"]
    with pytest.raises(PoolError, match="refused the credentials"):
        RemoteTier(read_header(path), pool=url.replace("s3cret", "wrong"))
    with pytest.raises(PoolError, match="refused the credentials"):  # the key file's password is not this one
        PoolClient(pool.url)
    os.environ[KEY_ENV], kept = "/nonexistent/pool.key", os.environ[KEY_ENV]
    try:
        with pytest.raises(PoolError, match="NOAUTH"):
            PoolClient(pool.url)
        with pytest.raises(PoolKeyError, match=r"^no pool key file at /nonexistent/pool.key: the row checks need the "
                                            "publisher's; copy it here .mode 0600. or set ENGRAM_OFFLOAD_POOL_KEY"):
            RemoteTier(read_header(path), pool=url)
    finally:
        os.environ[KEY_ENV] = kept


def test_threads_share_a_tier_and_any_out_layout_works(tables, redis_cluster):
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    publish_table(path, redis_cluster.url, extent_rows=EXTENT_ROWS, progress=False)
    errors = []
    with RemoteTier(read_header(path), pool=redis_cluster.url) as remote:
        def worker(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(20):
                    ids = rng.integers(0, remote.num_rows, 300)
                    if not np.array_equal(read(remote, ids), expected[ids]):
                        errors.append(f"thread {seed}: wrong rows")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"thread {seed}: {exc!r}")

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        ids = np.array([9, 3, 3, 700, 2], np.int64)
        out = torch.empty((remote.row_bytes, len(ids)), dtype=torch.uint8).t()  # not contiguous
        remote.read_rows(ids, out)
        assert np.array_equal(out.numpy(), expected[ids])


def test_a_hung_node_times_out_within_the_bound(tables, fresh_pool):
    pool = fresh_pool(1)
    path, expected = tables[("fp16", 48)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=pool.url, retries=1, timeout_s=0.3, retry_backoff_s=0,
                    down_s=0) as remote:  # no mark: the read right after SIGCONT tries the node
        process = pool.nodes[0].process
        process.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(TierError, match="timed out"):
                read(remote, [0, 1, 500])
            assert time.monotonic() - start < 2 * (0.3 * 2 + 0.3)  # (retries + 1) x timeout, and the map refresh
        finally:
            process.send_signal(signal.SIGCONT)
        assert np.array_equal(read(remote, [0, 1, 500]), expected[[0, 1, 500]])  # fresh sockets afterwards


def test_open_table_serves_the_pool_by_file_or_by_url_behind_a_cache(tables, redis_single):
    from engram_offload import open_table

    path, _ = tables[("fp8_e4m3_ue8m0", 64)]
    publish_table(path, redis_single.url, extent_rows=EXTENT_ROWS, progress=False)
    fp = fingerprint(read_header(path))
    ids = np.random.default_rng(4).integers(0, read_header(path).layout.num_rows, 300)
    with open_table(path, "memory") as memory:
        want = memory.gather(ids)
        with open_table(path, "remote", pool=redis_single.url, cache_bytes=50 * memory.row_bytes) as by_file, \
                open_table(f"{redis_single.url}/{fp}", "remote") as by_url:
            for _ in range(2):  # the second pass hits the cache
                assert torch.equal(by_file.gather(ids), want)
            assert torch.equal(by_url.gather(ids), want)
            assert by_file.stats()["levels"][0]["hits"] > 0
    with pytest.raises(ValueError, match="tier='remote'"):
        open_table(f"{redis_single.url}/{fp}", "mmap")


# ---------------------------------------------------------------------- rows out of place (pool layout 3)
def test_a_row_copied_over_another_with_its_checksum_is_caught(tables, fresh_pool):
    """A row and its checksum written over another row of its extent: its checksum holds for
    its own id only, so the read raises or comes from the fallback, and open finds the extent
    no longer matching its manifest digest."""
    pool = fresh_pool(1)
    path, expected = tables[("int8", 64)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    header = read_header(path)
    options = dict(pool=pool.url, retries=0)
    with RemoteTier(header, **options) as bare, RemoteTier(header, fallback=path, **options) as guarded:
        playout, stride = bare.pool_layout, bare.stride
        key, first = playout.keys[2], int(playout.starts[2])
        with PoolClient(pool.url) as client:
            moved = client.call("GETRANGE", key, 3 * stride, 4 * stride - 1)
            client.call("SETRANGE", key, 7 * stride, moved)
        with pytest.raises(TierError, match=f"row {first + 7} of extent {key} failed its checksum"):
            read(bare, [first + 7])
        assert np.array_equal(read(guarded, [first + 3, first + 7]), expected[[first + 3, first + 7]])
        assert guarded.stats()["fallback_rows"] == 1
    with pytest.raises(PoolError, match=f"altered after it was published: extent {key} does not match its manifest"):
        RemoteTier(header, pool=pool.url, verify_extents="all")


def test_an_extent_swapped_for_another_of_the_same_length_is_caught(tables, fresh_pool):
    pool = fresh_pool(1)
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    header = read_header(path)
    options = dict(pool=pool.url, retries=0)
    with RemoteTier(header, **options) as bare, RemoteTier(header, fallback=path, **options) as guarded:
        playout = bare.pool_layout
        assert playout.counts[0] == playout.counts[1]
        with PoolClient(pool.url) as client:
            client.call("SET", playout.keys[0], client.call("GET", playout.keys[1]))
        ids = np.arange(int(playout.counts[0]))  # every row of extent 0
        with pytest.raises(TierError, match=f"extent {playout.keys[0]} failed its checksum"):
            read(bare, ids)
        assert np.array_equal(read(guarded, ids), expected[ids])
        assert guarded.stats()["fallback_rows"] == ids.size
    with pytest.raises(PoolError, match=f"extent {playout.keys[0]} does not match its manifest digest"):
        RemoteTier(header, pool=pool.url, verify_extents="all")


# ---------------------------------------------------------------------- a stopped node: the circuit breaker
def test_a_stopped_node_is_marked_down_and_reads_go_to_the_fallback_at_once(tables, fresh_pool):
    pool = fresh_pool(1)
    path, expected = tables[("fp8_e4m3_ue8m0", 64)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    header = read_header(path)
    node = pool.nodes[0].process
    options = dict(pool=pool.url, retries=2, timeout_s=0.5, retry_backoff_s=0.01, verify_extents="none")
    with RemoteTier(header, fallback=path, down_s=600, **options) as guarded, \
            RemoteTier(header, down_s=600, **options) as bare, \
            RemoteTier(header, fallback=path, down_s=0.2, **options) as brief:
        node.send_signal(signal.SIGSTOP)
        try:
            for seed in range(5):
                ids = np.random.default_rng(seed).integers(0, header.layout.num_rows, 50)
                assert np.array_equal(read(guarded, ids), expected[ids])
            stats = guarded.stats()
            assert stats["timeouts"] == 1 and stats.get("retries", 0) == 0  # one wait, then none
            assert stats["down_skips"] == 4 and stats["fallback_requests"] == 5
            with pytest.raises(TierError, match="(no reply .timed out after 0.5 s|[0-9]: timed out).*"
                                                "without a retry"):  # the second: at AUTH (the key file's password)
                read(bare, [1])
            with pytest.raises(TierError, match="marked down for 600 s after it timed out"):
                read(bare, [2])
            assert bare.stats()["timeouts"] == 1
            assert np.array_equal(read(brief, [3]), expected[[3]])
        finally:
            node.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30  # once its mark ends, a read tries the node again
        while time.monotonic() < deadline:
            before = brief.stats()["fallback_requests"]
            assert np.array_equal(read(brief, [5, 6]), expected[[5, 6]])
            if brief.stats()["fallback_requests"] == before:
                break
            time.sleep(0.05)
        assert brief.stats()["fallback_requests"] == before


def test_rows_of_an_extent_whose_slot_is_migrating_are_read_where_they_are(tables, fresh_pool):
    """Mid-reshard: an extent handed over to the node importing its slot is answered with
    ``ASK`` by its owner; the tier asks the importing node (after ``ASKING``), without a
    retry, and the extents still at the owner are read there."""
    pool = fresh_pool(3)
    path, _ = tables[("int8", 64)]
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=pool.url, retries=0) as remote, \
            open_tier("memory", read_header(path)) as memory:
        playout, (addresses, node_of) = remote.pool_layout, remote._topology
        moved = next(e for e in range(3, len(playout.keys)) if node_of[e] == len(addresses) - 1)  # the last job's
        slot = key_slot(playout.keys[moved])
        source, target, _, _ = migrate_slot(pool, slot)
        conn = source.connect(5.0)
        try:
            assert conn.call("MIGRATE", "127.0.0.1", target.port, playout.keys[moved], 0, 5000) == b"OK"
            assert str(conn.call("GETRANGE", playout.keys[moved], 0, 0)).startswith("ASK")
        finally:
            conn.close()
        ids = np.concatenate([edge_ids(playout), np.arange(int(playout.starts[moved]),
                                                           int(playout.starts[moved] + playout.counts[moved]))])
        ids = np.unique(ids)
        assert np.array_equal(read(remote, ids), read(memory, ids))
        assert np.array_equal(read(remote, ids[::-1]), read(memory, ids[::-1]))
        assert remote.stats()["retries"] == 0
    with RemoteTier(read_header(path), pool=pool.url, verify_extents="all") as reopened, \
            open_tier("memory", read_header(path)) as memory:  # opening reads the moved extent whole too
        assert np.array_equal(read(reopened, ids), read(memory, ids))


# ----------------------------------------------------------------- options, opening and a node's failures
def test_options_a_remote_tier_cannot_use_are_refused_before_it_connects(tables):
    header = read_header(tables[("int8", 64)][0])
    nowhere = "redis://127.0.0.1:1"  # nothing listens there: each refusal comes first
    for options, message in (
            (dict(verify_extents="some"), "verify_extents must be one of sample, all, none, got 'some'"),
            (dict(retries=-1), "retries must be >= 0 and timeout_s > 0, got -1 and 2.0"),
            (dict(timeout_s=0), "retries must be >= 0 and timeout_s > 0, got 2 and 0"),
            (dict(retries=-1, timeout_s=0.5), "retries must be >= 0 and timeout_s > 0, got -1 and 0.5")):
        with pytest.raises(ValueError) as caught:
            RemoteTier(header, pool=nowhere, **options)
        assert str(caught.value) == message


def test_the_extents_checked_at_open_none_all_or_a_sample_of_whole_extents(tables, monkeypatch):
    import engram_offload.tiers.remote as remote_module
    from engram_offload.tiers.remote import _extents_to_verify

    playout = PoolLayout(read_header(tables[("int8", 64)][0]), EXTENT_ROWS)
    every = list(range(playout.num_extents))
    assert _extents_to_verify(playout, "none") == [] and _extents_to_verify(playout, "all") == every
    assert _extents_to_verify(playout, "sample") == every  # the table is smaller than the sample
    full = EXTENT_ROWS * playout.stride
    real_rng = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda *args: real_rng(11))
    first = real_rng(11).permutation(playout.num_extents)[:4]
    assert all(playout.counts[first] == EXTENT_ROWS)  # the first picks are whole extents under this seed
    for sample_bytes, count in ((3 * full, 3), (3 * full - 1, 2), (1, 1)):  # at least one
        monkeypatch.setattr(remote_module, "VERIFY_SAMPLE_BYTES", sample_bytes)
        assert _extents_to_verify(playout, "sample") == sorted(first[:count].tolist())


def test_a_table_altered_in_many_extents_is_refused_at_open_naming_three(tables, fresh_pool):
    pool = fresh_pool(1)
    path, _ = tables[("int8", 64)]
    header = read_header(path)
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    playout, fp = PoolLayout(header, EXTENT_ROWS), fingerprint(header)
    for altered, more in ((3, ""), (4, " (and 1 more)")):
        for extent in range(altered):
            flip_in_pool(pool.url, playout.keys[extent], 8)
        with pytest.raises(PoolError) as caught:
            RemoteTier(header, pool=pool.url, verify_extents="all")
        named = "; ".join(f"extent {playout.keys[e]} does not match its manifest digest" for e in range(3))
        assert str(caught.value) == (
            f"table {fp} in the pool at {pool.url} was altered after it was published: {named}{more}; drop it and "
            f"publish it again (engram-offload pool drop {fp}; pool publish TABLE)")
        for extent in range(altered):
            flip_in_pool(pool.url, playout.keys[extent], 8)  # flipped back
    with RemoteTier(header, pool=pool.url, verify_extents="all") as whole:
        assert whole.retry_backoff_s == 0.05 and whole.down_s == 10.0 and whole.retries == 2
        assert repr(whole) == f"RemoteTier({pool.url!r}, table={fp}, rows={header.layout.num_rows:,})"
    flip_in_pool(pool.url, playout.keys[1], 8)
    with RemoteTier(header, pool=pool.url, verify_extents="none", retries=0) as unchecked:  # opens: no extent read
        with pytest.raises(TierError, match=f"extent {playout.keys[1]} failed its checksum"):
            read(unchecked, [int(playout.starts[1])])
    with PoolClient(pool.url) as client:
        for extent in (2, 3):
            client.call("SET", playout.keys[extent], b"short")
    with pytest.raises(PoolError) as caught:
        RemoteTier(header, pool=pool.url)
    wrong = "; ".join(f"extent {playout.keys[e]} holds 5 bytes, expected {int(playout.counts[e]) * playout.stride:,}"
                      for e in (2, 3))
    assert str(caught.value) == (f"table {fp} in the pool at {pool.url} is not completely published: {wrong}; run "
                                 f"engram-offload pool publish TABLE --pool {pool.url}")


def test_a_fallback_tier_given_stays_open_and_one_opened_from_a_path_is_closed(tables, redis_single):
    path, expected = tables[("int8", 64)]
    publish_table(path, redis_single.url, extent_rows=EXTENT_ROWS, progress=False)
    header = read_header(path)
    with open_tier("mmap", header) as given:
        with RemoteTier(header, pool=redis_single.url, fallback=given):
            pass
        assert not given.closed and np.array_equal(read(given, [4]), expected[[4]])
        with RemoteTier(header, pool=redis_single.url, fallback=path) as owner:
            opened = owner._fallback
        assert opened.closed


class FailingNode:
    """A node connection that fails at send or at read, or answers ``replies``."""

    def __init__(self, send: Exception | None = None, read: Exception | None = None, replies=None) -> None:
        self.send_error, self.read_error, self.replies = send, read, replies

    def send(self, data: bytes) -> None:
        if self.send_error is not None:
            raise self.send_error

    def read_replies(self, n: int) -> list:
        if self.read_error is not None:
            raise self.read_error
        return list(self.replies)


def test_each_nodes_failure_is_told_apart_and_timeouts_mark_it_down(tables, redis_single):
    import hiredis

    from engram_offload.tiers.remote import _Job

    path, _ = tables[("int8", 64)]
    publish_table(path, redis_single.url, extent_rows=EXTENT_ROWS, progress=False)
    with RemoteTier(read_header(path), pool=redis_single.url, down_s=600) as tier:
        stride, forgotten = tier.stride, []
        wrapped = ConnectionError("refused")
        wrapped.__cause__ = TimeoutError("connect timed out")
        nodes = {"a:1": FailingNode(send=TimeoutError("send timed out")), "b:1": FailingNode(send=wrapped),
                 "c:1": FailingNode(read=TimeoutError()), "d:1": FailingNode(read=ConnectionResetError("reset")),
                 "e:1": FailingNode(replies=[b"r" * stride]), "f:1": FailingNode(replies=[hiredis.ReplyError("ERR no")]),
                 "g:1": FailingNode(replies=[b"r" * stride]), "h:1": FailingNode(replies=[None])}
        tier._connection, tier._forget = nodes.__getitem__, forgotten.append
        jobs = [_Job(address, np.arange(1), b"<request>", stride * (2 if address == "g:1" else 1), None,
                     np.array([b"<key>", b"<range>"], object)) for address in nodes]
        done, failures = tier._fetch(jobs)
        assert [(job.address, replies, blob) for job, replies, blob in done] == [("e:1", [b"r" * stride],
                                                                                  b"r" * stride)]
        why = dict((job.address, reason) for job, reason in failures)
        assert why == {
            "a:1": "cannot send: send timed out", "b:1": "cannot send: refused",
            "c:1": "no reply (timed out after 2 s)", "d:1": "no reply (reset)",
            "g:1": f"{stride} bytes for {2 * stride}", "f:1": "error reply 'ERR no'",
            "h:1": "got nothing for a range of whole rows: the extent is missing or foreign (the node lost its data? "
                   "publish the table again)"}
        assert forgotten == ["a:1", "b:1", "c:1", "d:1"]  # their streams are in an unknown state
        assert [tier._is_down(address) for address in nodes] == [True, True, True, False, False, False, False, False]
        assert tier.stats()["timeouts"] == 3
        done, failures = tier._fetch(jobs[:1] + jobs[4:5])  # a node marked down is not asked again
        assert [job.address for job, _, _ in done] == ["e:1"]
        assert [(job.address, reason) for job, reason in failures] == [
            ("a:1", "marked down for 600 s after it timed out")]
        assert tier.stats()["down_skips"] == 1 and forgotten == ["a:1", "b:1", "c:1", "d:1"]


# ---------------------------------------------------------------------- another local user's forgery
def forge(url: str, fp: str, what: str) -> int:
    """Run as another local uid: rewrite table ``fp`` with rows of 0x5A bytes, with the
    package's own functions and a key of its own (it cannot read the operator's): every
    extent with valid-looking MACs, and (``what="everything"``) the manifest and the complete
    marker to match. Returns the extents rewritten."""
    os.environ[KEY_ENV] = "/nonexistent/pool.key"  # the operator's file is closed to this uid anyway
    key = PoolKey(None, os.urandom(32))
    with PoolClient(url) as client:
        playout = read_pool_table(client, fp)
        rb = playout.header.layout.row_bytes
        for e, (name, start, count) in enumerate(zip(playout.keys, playout.starts.tolist(), playout.counts.tolist())):
            data = rows_with_sums(np.full((count, rb), 0x5A, np.uint8), fp, np.arange(start, start + count), key)
            client.call("SET", name, data.tobytes())
            if what == "everything":
                client.call("HSET", playout.manifest_key, e, xxhash.xxh3_64_hexdigest(data.tobytes()))
        if what == "everything":
            manifest = _hgetall(client, playout.manifest_key)
            client.call("SET", playout.complete_key, _complete_record(playout, manifest, key))
    return playout.num_extents


@needs_root
@pytest.mark.parametrize("access", ["no password", "password leaked"])
@pytest.mark.parametrize("what", ["everything", "extents"])
def test_another_users_forgery_is_refused_in_one_line_and_no_wrong_row_is_served(tables, fresh_pool, access, what):
    """A second uid rewrites the table in the pool, with or without the manifest and complete
    marker: the operator's opens (the default, verify_extents="all", a fallback) refuse it in
    one line, and tiers opened before the forgery serve the fallback's rows or raise."""
    pool = fresh_pool(1)
    path, expected = tables[("int8", 64)]
    header, fp = read_header(path), fingerprint(read_header(path))
    url = pool.url
    if access == "password leaked":
        with PoolClient(pool.url) as client:  # the operator's clients take the key file's password
            client.call("CONFIG", "SET", "requirepass", load_key(create=True).password)
        url = pool.url.replace("redis://", f"redis://:{load_key().password}@")  # what the attacker learnt
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    n = header.layout.num_rows
    with RemoteTier(header, pool=pool.url, verify_extents="none") as bare, \
            RemoteTier(header, pool=pool.url, fallback=path) as guarded:
        assert in_child(forge, url, fp, what, uid=NOBODY) == ("ok", bare.pool_layout.num_extents)
        with pytest.raises(TierError, match="failed its checksum, and again when read once more"):
            read(bare, np.arange(n))
        assert np.array_equal(read(guarded, np.arange(n)), expected)  # every row from the fallback
        assert guarded.stats()["fallback_rows"] == n
    why = "its complete marker does not hold under the pool key" if what == "everything" else \
        "was altered after it was published"
    for options in ({}, {"verify_extents": "all"}, {"fallback": path}):
        with pytest.raises(PoolError) as caught:
            RemoteTier(header, pool=pool.url, **options)
        assert why in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(PoolError, match=why):
        open_pool_table(f"{pool.url}/{fp}")
    [status] = pool_status(pool.url)["tables"]
    assert not status["complete"] if what == "everything" else status["complete"]  # status reads no extent
    if what == "extents":  # manifest and marker as published: a publish finds the table complete
        assert publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)["sent"] == 0
        drop_table(pool.url, fp)
    assert publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)["sent"] > 0
    with RemoteTier(header, pool=pool.url, verify_extents="all") as remote:  # published again: served
        assert np.array_equal(read(remote, np.arange(n)), expected)


@needs_root
def test_without_the_password_another_user_cannot_write_at_all(tables, fresh_pool):
    pool = fresh_pool(1)
    path, expected = tables[("int8", 64)]
    with PoolClient(pool.url) as client:
        client.call("CONFIG", "SET", "requirepass", load_key(create=True).password)
    publish_table(path, pool.url, extent_rows=EXTENT_ROWS, progress=False)
    kind, said = in_child(forge, pool.url, fingerprint(read_header(path)), "everything", uid=NOBODY)
    assert kind == "error" and "NOAUTH" in said and "\n" not in said
    with RemoteTier(read_header(path), pool=pool.url, verify_extents="all") as remote:
        assert np.array_equal(read(remote, np.arange(remote.num_rows)), expected)
