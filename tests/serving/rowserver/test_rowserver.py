"""The row server: exact rows through shared buffers, one cache for every rank, dead ranks' pins."""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time

import numpy as np
import pytest
import torch

from engram_offload.engram.hashing import NgramHasher
from engram_offload.errors import EngramError, TierError
from engram_offload.serving.dedup import dedup
from engram_offload.serving.prefetch import Prefetcher
from engram_offload.serving.rowserver import RowClient, RowServer, start_row_server
from engram_offload.serving.sharding import shard_columns
from engram_offload.serving.store import open_table
from engram_offload.table import make_random_table

from row_servers import serving
from tiny_tables import tiny_config

CACHE_ROWS = 400


@pytest.fixture
def server(table, socket_dir):
    """A row server over the direct tier with a 400-row cache, serving from a thread of this
    process (so that its code counts for mutation testing; ``start_row_server`` and the server
    process are tested on their own below and in the trust tests); its socket path."""
    sock = socket_dir / "rows.sock"
    with serving(table[0], sock, cache_rows=CACHE_ROWS, max_rows=100):
        yield sock


def zipf_steps(num_rows: int, steps: int = 240, per_step: int = 96, seed: int = 2) -> list[np.ndarray]:
    """Skewed row ids, a step at a time: a few hot rows, a long tail."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_rows)
    return [order[np.minimum(rng.zipf(1.3, per_step) - 1, num_rows - 1)] for _ in range(steps)]


def wait_for(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_rows_are_exact_through_the_shared_buffer(table, server):
    path, expected = table
    with RowClient(server) as client, open_table(path, "memory") as local:
        ids = np.random.default_rng(1).integers(0, client.num_rows, (7, 50))  # 350 ids: 4 round trips
        assert torch.equal(client.read_raw(ids), torch.from_numpy(expected[ids.reshape(-1)]))
        assert torch.equal(client.gather(ids), local.gather(ids))
        assert client.gather(ids).shape == (7, 50, client.config.head_dim)
        assert client.config == local.config and client.num_rows == local.num_rows
        unique = dedup(ids).unique
        with client.fetch(unique, hold=True) as lease:
            assert torch.equal(lease.raw, torch.from_numpy(expected[unique]))
            held = client.stats()["server"]
            assert held["leases_held"] >= 1 and sum(held["pinned_slots"]) > 0
        after = client.stats()
        assert after["server"]["leases_held"] == 0 and sum(after["server"]["pinned_slots"]) == 0
        assert after["store"]["rows_unique"] > 0 and after["client"]["round_trips"] > 0


def test_errors_come_back_as_the_stores(server):
    with RowClient(server) as client:
        with pytest.raises(IndexError, match="out of range"):
            client.read_raw([0, client.num_rows])
        with pytest.raises(ValueError, match="sorted distinct"):
            client.fetch(np.array([5, 3]))
        assert client.read_raw([1]).shape == (1, client.row_bytes)  # the connection goes on


def test_one_server_per_socket_and_a_dead_servers_socket_is_replaced(table, socket_dir):
    path, expected = table
    sock = socket_dir / "rows.sock"
    first = start_row_server(path, sock)
    try:
        with open_table(path, "direct") as store, pytest.raises(EngramError, match="already serves"):
            RowServer(store, sock)
        client = RowClient(sock)
        first.send_signal(signal.SIGKILL)
        first.wait()
        with pytest.raises(TierError, match="closed the connection"):
            client.read_raw([3])
        client.close()
        assert sock.exists()  # the dead server's socket file
        second = start_row_server(path, sock)
        with RowClient(sock) as client:
            assert torch.equal(client.read_raw([3]), torch.from_numpy(expected[[3]]))
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
    finally:
        first.kill()


# ---------------------------------------------------------------------- ranks in processes
def _replay_rank(rank: int, ranks: int, sock: str, steps: list[np.ndarray], expected: np.ndarray, barrier) -> None:
    """Replay steps rank, rank + ranks, ... in lockstep with the other ranks; check every row."""
    with RowClient(sock) as client:
        for first in range(0, len(steps), ranks):
            barrier.wait()
            if first + rank < len(steps):
                d = dedup(steps[first + rank])
                with client.fetch(d.unique, hold=True, requested=d.requested) as lease:
                    assert np.array_equal(lease.raw.numpy(), expected[d.unique])


@pytest.mark.slow
def test_four_ranks_share_one_caches_hit_rate(table, server):
    path, expected = table
    steps = zipf_steps(len(expected))
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    ranks = [ctx.Process(target=_replay_rank, args=(r, 4, str(server), steps, expected, barrier)) for r in range(4)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=300)
    assert [rank.exitcode for rank in ranks] == [0, 0, 0, 0]
    with RowClient(server) as client:
        shared = client.stats()
    rb = shared["levels"][0]["capacity_bytes"] // shared["levels"][0]["capacity_rows"]
    with open_table(path, "direct", cache_bytes=CACHE_ROWS * rb) as single:
        for ids in steps:
            d = dedup(ids)
            single.fetch(d.unique, hold=True, requested=d.requested).release()
        alone = single.stats()["store"]
    assert shared["store"]["rows_unique"] == alone["rows_unique"]
    assert 0.2 < alone["hit_rate"] < 0.95  # the cache is smaller than the rows the trace touches
    assert abs(shared["store"]["hit_rate"] - alone["hit_rate"]) < 0.02
    assert shared["server"]["leases_held"] == 0 and sum(shared["server"]["pinned_slots"]) == 0


def _hold_and_hang(sock: str, ids: np.ndarray, conn) -> None:
    """Pin ``ids`` in the server's cache, say so, and wait to be killed."""
    client = RowClient(sock)
    lease = client.fetch(ids, hold=True)
    conn.send(lease.ids.size)
    time.sleep(300)


def test_a_rank_killed_holding_pins_leaves_none_behind(table, server):
    _, expected = table
    ids = np.arange(0, 600, 3)  # 200 rows: half the cache
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    rank = ctx.Process(target=_hold_and_hang, args=(str(server), ids, child))
    rank.start()
    try:
        assert parent.recv() == ids.size
        with RowClient(server) as other:
            held = other.stats()["server"]
            assert held["leases_held"] == 2 and sum(held["pinned_slots"]) == ids.size  # 2 round trips
            rank.kill()  # SIGKILL mid-step: the lease is never released by its owner
            rank.join()
            assert wait_for(lambda: other.stats()["server"]["leases_held"] == 0)
            assert sum(other.stats()["server"]["pinned_slots"]) == 0
            everything = np.arange(len(expected))  # more rows than the cache: every slot can be reused
            for _ in range(2):
                assert np.array_equal(other.read_raw(everything).numpy(), expected)
    finally:
        rank.kill()


def test_a_server_of_another_table_is_refused(table, server, tmp_path):
    path, _ = table
    other = make_random_table(tmp_path / "other.table", tiny_config("fp8_e4m3_ue8m0", 64), seed=9)
    with RowClient(server, table=path) as client:
        assert client.table == str(path)
    with pytest.raises(TierError, match="serves .*t.table, not .*other.table"):
        RowClient(server, table=other)


# ---------------------------------------------------------------------- behind open_table, under a Prefetcher
def test_open_table_with_a_row_server_is_a_row_store_for_the_prefetcher(table, server):
    """A Prefetcher over the server's RowClient hands out the rows of one over a local store,
    keeps the step's rows pinned in the server's cache until end_step, then lets them go."""
    path, _ = table
    config = tiny_config("fp8_e4m3_ue8m0", 64)
    token_map = np.arange(1000, dtype=np.int64) % 700
    tokens = np.random.default_rng(3).integers(0, 1000, (2, 10))
    steps = [[tokens[0, :6], tokens[1, :4]], *[[tokens[0, t: t + 1], tokens[1, t: t + 1]] for t in range(6, 10)]]
    with open_table(path, "direct", row_server=server) as client, open_table(path, "mmap") as local, \
            Prefetcher(client, NgramHasher(config, token_map), split_min_rows=1) as remote, \
            Prefetcher(local, NgramHasher(config, token_map)) as here:
        assert isinstance(client, RowClient) and client.tier == "direct"
        for pieces in steps:
            step = remote.begin_step([7, 8], pieces)
            here.begin_step([7, 8], pieces)
            for layer in config.layer_ids:
                assert torch.equal(remote.rows(layer, timeout=10), here.rows(layer, timeout=10))
            assert step.wait_done(10)
            held = client.stats()["server"]
            assert held["leases_held"] == len(step.parts) and sum(held["pinned_slots"]) == step.dedup.unique.size
            remote.end_step(step)
            here.end_step()
            released = client.stats()["server"]
            assert released["leases_held"] == 0 and sum(released["pinned_slots"]) == 0


def test_a_row_client_with_columns_fetches_only_its_shard(table, server):
    path, _ = table
    config = tiny_config("fp8_e4m3_ue8m0", 64)
    token_map = np.arange(1000, dtype=np.int64) % 700
    tokens = np.random.default_rng(4).integers(0, 1000, (2, 6))
    columns = shard_columns(config, 1, 2)
    with open_table(path, "direct", row_server=server, columns=columns) as client, \
            open_table(path, "mmap") as local, \
            Prefetcher(client, NgramHasher(config, token_map)) as remote, \
            Prefetcher(local, NgramHasher(config, token_map)) as here:
        assert remote.columns == columns
        remote.begin_step([1, 2], list(tokens))
        here.begin_step([1, 2], list(tokens))
        for layer in config.layer_ids:
            assert torch.equal(remote.rows(layer, timeout=10), here.rows(layer, timeout=10)[:, columns[0]: columns[1]])
        remote.end_step()
        here.end_step()
        before = client.stats()["client"]["round_trips"]
        with pytest.raises(IndexError, match=r"columns \[2, 4\)"):
            client.read_raw([0])  # the first head of layer 1: column 0, not this rank's
        assert client.stats()["client"]["round_trips"] == before + 1  # refused without asking the server


def test_open_table_with_a_row_server_refuses_local_options(table, server):
    path, _ = table
    with pytest.raises(ValueError, match="drop cache_bytes"):
        open_table(path, "direct", row_server=server, cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="engine"):
        open_table(path, "direct", row_server=server, engine="threads")
    with pytest.raises(ValueError, match="on the direct tier, not mmap"):
        open_table(path, "mmap", row_server=server)


def test_a_closed_connection_releases_its_leases_itself(table, socket_dir):
    """A client that closes while holding leases: its connection's end releases them, before
    the connection stops counting, even while something else still references the lease
    objects (here the store's caller keeps each one), so no destructor is needed to unpin
    the rows. The other connection's pins stay."""
    path, expected = table
    sock = socket_dir / "rows.sock"
    store = open_table(path, "direct", cache_bytes=CACHE_ROWS * tiny_config("fp8_e4m3_ue8m0", 64).row_bytes)
    taken = []  # every server-side lease: referenced here as long as the test runs
    fetch = store.fetch

    def keep(ids, **options):
        taken.append(fetch(ids, **options))
        return taken[-1]

    store.fetch = keep  # type: ignore[method-assign]
    server = RowServer(store, sock, max_rows=100)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with RowClient(sock) as other:
            closing = RowClient(sock)
            held = closing.fetch(np.arange(0, 300, 2), hold=True)  # 150 rows: 2 round trips, 2 leases
            kept = other.fetch(np.arange(1, 41, 2), hold=True)  # 20 rows of the other connection
            assert np.array_equal(held.raw.numpy(), expected[np.arange(0, 300, 2)])
            stats = other.stats()["server"]
            assert stats["leases_held"] == 3 and sum(stats["pinned_slots"]) == 170
            closing.close()  # the lease is not released by its owner: the connection's end does it
            assert wait_for(lambda: other.stats()["server"]["connections"] == 1)
            stats = other.stats()["server"]
            assert stats["leases_held"] == 1 and sum(stats["pinned_slots"]) == 20, stats
            kept.release()
            assert sum(other.stats()["server"]["pinned_slots"]) == 0
            del held
    finally:
        server.close()
        thread.join(timeout=30)


def test_a_fetch_in_pieces_counts_each_lookup_once(table, server):
    """A fetch of more distinct ids than the server's ``max_rows`` (100) goes in pieces; the
    store counts the lookups the whole fetch stands for once, not once per piece."""
    _, expected = table
    ids = np.arange(0, 750, 3)  # 250 distinct ids: pieces of 100, 100, 50
    with RowClient(server) as client:
        before = client.stats()["store"]
        with client.fetch(ids, hold=True, requested=700) as lease:
            assert np.array_equal(lease.raw.numpy(), expected[ids])
        after = client.stats()["store"]
        assert after["rows_requested"] - before["rows_requested"] == 700
        assert after["rows_unique"] - before["rows_unique"] == 250
        assert after["fetches"] - before["fetches"] == 3
        raw = client.read_raw(np.concatenate([ids, ids[:30]]))  # 280 lookups of 250 rows, deduplicated here
        assert np.array_equal(raw.numpy(), expected[np.concatenate([ids, ids[:30]])])
        again = client.stats()["store"]
        assert again["rows_requested"] - after["rows_requested"] == 280
        assert again["rows_unique"] - after["rows_unique"] == 250
        client.fetch(ids, hold=False).release()  # requested: the ids themselves
        assert client.stats()["store"]["rows_requested"] - again["rows_requested"] == 250
        with pytest.raises(ValueError, match="a fetch of 250 ids stands for 250 to .*, not 249"):
            client.fetch(ids, hold=False, requested=249)  # fewer lookups than rows, found before any piece


def test_a_held_fetch_the_cache_serves_whole_is_copied_once_into_the_buffer(table, socket_dir):
    """The server asks its store to leave held rows in the cache (one copy, from there into the
    shared buffer) and copies the lease's rows otherwise; the client gets the table's rows
    either way."""
    path, expected = table
    with serving(path, socket_dir / "rows.sock") as server, RowClient(socket_dir / "rows.sock") as client:
        asked = []
        fetch = server.store.fetch
        server.store.fetch = lambda ids, **kw: asked.append((kw["in_place"], fetch(ids, **kw))) or asked[-1][1]
        ids = np.array([5, 17, 40, 41, 99], np.int64)
        for hold in (True, True, False):  # a miss-filled held fetch, then an all-hit one; then not held
            with client.fetch(ids, hold=hold) as lease:
                assert torch.equal(lease.raw, torch.from_numpy(expected[ids]))
        assert [(want, got.in_place is not None) for want, got in asked] == [(True, False), (True, True), (False, False)]
        assert sum(client.stats()["server"]["pinned_slots"]) == 0
