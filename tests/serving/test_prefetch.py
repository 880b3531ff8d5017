"""Prefetcher: rows equal a direct gather, failures surface at rows(), cancel, pins per step."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.hashing import NgramHasher
from engram_offload.errors import TierError
from engram_offload.serving.prefetch import Prefetcher, PrefetchError, StepCancelled
from engram_offload.serving.sharding import shard_columns, shard_rows

CONFIG = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=32,
                      prime_starts=(300, 500), row_format="fp8_e4m3_ue8m0")
VOCAB = 1000


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    x = torch.randn(CONFIG.num_rows, CONFIG.head_dim)
    return write_table(tmp_path_factory.mktemp("prefetch") / "t.tbl", CONFIG, x)


@pytest.fixture
def hasher():
    token_map = np.arange(VOCAB, dtype=np.int64) % 700
    return NgramHasher(CONFIG, token_map)


def part_owner(ids: np.ndarray, steps: dict) -> tuple[str, int]:
    """The name (of ``steps``: name -> Step) and part number of the step part whose distinct
    ids a fetch read; ("?", -1) for none."""
    for name, step in steps.items():
        for k, (lo, hi, _) in enumerate(step.parts):
            if np.array_equal(step.dedup.unique[lo:hi], ids):
                return name, k
    return "?", -1


def expected_rows(store, hasher, tokens: np.ndarray, layer_pos: int) -> torch.Tensor:
    ids = hasher.table_ids(hasher.hash_all(tokens))[:, :, layer_pos]  # [B, T, C]
    return store.gather(ids, torch.float32)


def test_prefill_then_decode_rows_match_gathers(table, hasher):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(3, 9))
    with open_table(table, "mmap") as plain, open_table(table, "mmap", cache_bytes=100 * CONFIG.row_bytes) as store, \
            Prefetcher(store, hasher) as pf:
        step = pf.begin_step([10, 11, 12], [tokens[0, :5], tokens[1, :5], tokens[2, :5]])
        for pos, layer in enumerate(CONFIG.layer_ids):
            got = pf.rows(layer)  # [3*5, C, d]
            want = expected_rows(plain, hasher, tokens, pos)[:, :5].reshape(15, CONFIG.cols_per_layer, -1)
            assert torch.equal(got, want)
        pf.end_step(step)
        for t in range(5, 9):  # decode: one token per sequence
            pf.begin_step([10, 11, 12], tokens[:, t])
            for pos, layer in enumerate(CONFIG.layer_ids):
                want = expected_rows(plain, hasher, tokens, pos)[:, t]
                assert torch.equal(pf.rows(layer), want)
            pf.end_step()
        s = store.stats()["store"]
        assert s["rows_requested"] == 9 * 3 * CONFIG.rows_per_token and s["rows_unique"] < s["rows_requested"]
        assert pf.stats()["steps"] == 5


def test_rows_kept_past_their_step_stay_as_they_were(table, hasher):
    """The decoded rows' arrays are used again for later steps only once nobody holds them."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, VOCAB, size=(4, 12))
    with open_table(table, "mmap") as plain, open_table(table, "mmap", cache_bytes=100 * CONFIG.row_bytes) as store, \
            Prefetcher(store, hasher, split_min_rows=1) as pf:
        pf._decoded.min_bytes = 0  # this table's steps are small: recycle every array
        kept, copies = [], []
        for t in range(12):
            pf.begin_step([0, 1, 2, 3], tokens[:, t])
            rows = [pf.rows(layer) for layer in CONFIG.layer_ids]
            if t % 3 == 0:  # some steps' rows kept, the others let go
                kept.append(rows)
                copies.append([r.clone() for r in rows])
            pf.end_step()
        for t, (rows, copy) in zip(range(0, 12, 3), zip(kept, copies)):
            for pos, (got, was) in enumerate(zip(rows, copy)):
                assert torch.equal(got, was)
                assert torch.equal(got, expected_rows(plain, hasher, tokens, pos)[:, t])
        if pf._decoded.made:  # the C decoder's arrays (not without it): those let go of were used again
            assert pf._decoded.reused > 0


def test_failure_surfaces_at_rows_and_the_worker_keeps_going(table, hasher):
    with open_table(table, "mmap", cache_bytes=100 * CONFIG.row_bytes) as store, Prefetcher(store, hasher) as pf:
        real = store.tier.read_rows
        calls = {"n": 0}

        def flaky(ids, out):
            calls["n"] += 1
            if calls["n"] == 1:
                raise TierError("disk went away")
            return real(ids, out)

        store.tier.read_rows = flaky
        pf.begin_step([1], [[5, 6, 7]])
        with pytest.raises(PrefetchError, match="disk went away") as info:
            pf.rows(CONFIG.layer_ids[0])
        assert isinstance(info.value.__cause__, TierError)
        pf.end_step()
        pf.begin_step([2], [[5, 6, 7]])  # the worker is still alive and serves the next step
        assert pf.rows(CONFIG.layer_ids[1]).shape == (3, CONFIG.cols_per_layer, CONFIG.head_dim)
        pf.end_step()
        assert pf.stats()["failures"] == 1
        assert all(level.pinned() == 0 for level in store.levels)


def test_rows_are_pinned_until_end_step(table, hasher):
    with open_table(table, "mmap", cache_bytes=4000 * CONFIG.row_bytes) as store, Prefetcher(store, hasher) as pf:
        step = pf.begin_step([1, 2], [[1, 2, 3], [4, 5]])
        pf.rows(CONFIG.layer_ids[0])
        dram = store.levels[0]
        assert dram.pinned() == step.dedup.unique.size
        pf.end_step(step)
        assert dram.pinned() == 0


def test_cancel_before_the_fetch_runs(table, hasher):
    with open_table(table, "mmap", cache_bytes=100 * CONFIG.row_bytes) as store, Prefetcher(store, hasher) as pf:
        gate = threading.Event()
        real = store.tier.read_rows

        def slow(ids, out):
            gate.wait(5)
            return real(ids, out)

        store.tier.read_rows = slow
        first = pf.begin_step([1], [[1, 2]])
        second = pf.begin_step([2], [[3, 4]])
        pf.cancel(second)
        gate.set()
        pf.rows(CONFIG.layer_ids[0], first)
        with pytest.raises(StepCancelled):
            pf.rows(CONFIG.layer_ids[0], second)
        pf.end_step(first)
        assert all(level.pinned() == 0 for level in store.levels)


def test_plain_store_and_layout_mismatch(table, hasher):
    with open_table(table, "memory") as store, Prefetcher(store, hasher) as pf:
        pf.begin_step([0], [[9, 8, 7, 6]])
        assert pf.rows(CONFIG.layer_ids[1]).shape == (4, CONFIG.cols_per_layer, CONFIG.head_dim)
        with pytest.raises(KeyError, match="not an Engram layer"):
            pf.rows(2)
        pf.end_step()
        other = NgramHasher(CONFIG.replace(prime_starts=(400, 600)), np.arange(VOCAB) % 700)
        with pytest.raises(ValueError, match=r"^the store's table and the hasher's config have different layouts: "
                                             r"build the hasher with NgramHasher\(store\.config, token_map\)$"):
            Prefetcher(store, other)


def _gate_second_layer(store, gate: threading.Event, fail: bool = False):
    """Make the tier block (or fail) on reads of any row of the second Engram layer."""
    real = store.tier.read_rows
    second_base = CONFIG.layer_row_bases[1]

    def gated(ids, out):
        if (np.asarray(ids) >= second_base).any():
            if fail:
                raise TierError("second layer unreadable")
            gate.wait(10)
        return real(ids, out)

    store.tier.read_rows = gated


def test_first_layer_rows_arrive_before_the_second_layers(table, hasher):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, size=(2, 6))
    gate = threading.Event()
    with open_table(table, "mmap") as plain, open_table(table, "mmap", cache_bytes=500 * CONFIG.row_bytes) as store, \
            Prefetcher(store, hasher, split_min_rows=0) as pf:
        _gate_second_layer(store, gate)
        step = pf.begin_step([1, 2], [tokens[0], tokens[1]])
        assert [li for _, _, li in step.parts] == [(0,), (1,)]
        first = pf.rows(CONFIG.layer_ids[0], timeout=5)  # the second layer's read is still blocked
        assert torch.equal(first, expected_rows(plain, hasher, tokens, 0).reshape(12, CONFIG.cols_per_layer, -1))
        assert not step.done()
        with pytest.raises(TimeoutError):
            pf.rows(CONFIG.layer_ids[1], timeout=0.05)
        gate.set()
        second = pf.rows(CONFIG.layer_ids[1], timeout=5)
        assert torch.equal(second, expected_rows(plain, hasher, tokens, 1).reshape(12, CONFIG.cols_per_layer, -1))
        assert store.levels[0].pinned() == step.dedup.unique.size
        pf.end_step(step)
        assert store.levels[0].pinned() == 0
        assert store.stats()["store"]["rows_requested"] == step.dedup.requested


def test_layers_are_fetched_in_parts_and_each_gets_exactly_its_rows(table, hasher):
    """Asking the last Engram layer first changes nothing: each layer's part is read on its
    own, and every layer's rows are that layer's (in token order). (The two workers may take
    the two parts at once, so which read starts first is not fixed.)"""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, VOCAB, size=(3, 7))
    with open_table(table, "mmap") as plain, open_table(table, "mmap", cache_bytes=500 * CONFIG.row_bytes) as store, \
            Prefetcher(store, hasher, split_min_rows=0) as pf:
        read, calls = store.tier.read_rows, []

        def recording(ids, out):
            calls.append(ids.copy())
            return read(ids, out)

        store.tier.read_rows = recording
        step = pf.begin_step([1, 2, 3], list(tokens))
        got = {layer: pf.rows(layer, timeout=5) for layer in reversed(CONFIG.layer_ids)}
        for pos, layer in enumerate(CONFIG.layer_ids):
            want = expected_rows(plain, hasher, tokens, pos).reshape(21, CONFIG.cols_per_layer, -1)
            assert torch.equal(got[layer], want)
        bases = CONFIG.layer_row_bases
        assert len(calls) == 2
        first, second = sorted(calls, key=lambda ids: ids.min())
        assert first.max() < bases[1] <= second.min()  # one read per layer's part
        assert step.first_part_seconds <= step.fetch_seconds
        pf.end_step(step)


def test_a_failed_second_layer_keeps_the_first_layers_rows(table, hasher):
    with open_table(table, "mmap", cache_bytes=500 * CONFIG.row_bytes) as store, \
            Prefetcher(store, hasher, split_min_rows=0) as pf:
        _gate_second_layer(store, threading.Event(), fail=True)
        step = pf.begin_step([1], [[5, 6, 7, 8]])
        assert pf.rows(CONFIG.layer_ids[0], timeout=5).shape == (4, CONFIG.cols_per_layer, CONFIG.head_dim)
        with pytest.raises(PrefetchError, match="second layer unreadable") as info:
            pf.rows(CONFIG.layer_ids[1], timeout=5)
        assert isinstance(info.value.__cause__, TierError)
        pf.end_step(step)
        assert pf.stats()["failures"] == 1
        assert store.levels[0].pinned() == 0


def test_cancel_while_the_second_layer_is_in_flight(table, hasher):
    gate = threading.Event()
    with open_table(table, "mmap", cache_bytes=500 * CONFIG.row_bytes) as store, \
            Prefetcher(store, hasher, split_min_rows=0) as pf:
        _gate_second_layer(store, gate)
        step = pf.begin_step([1], [[5, 6, 7, 8]])
        pf.rows(CONFIG.layer_ids[0], timeout=5)
        pf.cancel(step)
        gate.set()
        with pytest.raises(StepCancelled):
            pf.rows(CONFIG.layer_ids[1], step, timeout=5)
        assert step.wait_done(5)
        assert step.done() and store.levels[0].pinned() == 0
        nxt = pf.begin_step([2], [[1, 2, 3]])  # the worker carries on
        assert pf.rows(CONFIG.layer_ids[1], nxt, timeout=5).shape == (3, CONFIG.cols_per_layer, CONFIG.head_dim)
        pf.end_step(nxt)
        assert store.levels[0].pinned() == 0


def test_small_steps_are_fetched_in_one_piece(table, hasher):
    with open_table(table, "mmap", cache_bytes=500 * CONFIG.row_bytes) as store, Prefetcher(store, hasher) as pf:
        step = pf.begin_step([1], [[5, 6, 7]])
        assert len(step.parts) == 1
        pf.rows(CONFIG.layer_ids[1])
        pf.end_step(step)
        assert store.stats()["store"]["fetches"] == 1


def test_urgent_steps_overtake_steps_fetched_ahead(table, hasher):
    """A background (ahead-of-need) fetch yields to urgent steps between its parts.

    Both workers are held in a read (the general one in ``ahead``'s first part, the
    urgent-only one in ``busy``'s), so the general worker alone serves what is queued
    when it is let go, and the order of its reads is the order it picks parts in."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, VOCAB, size=(3, 6))
    with open_table(table, "mmap") as plain, open_table(table, "mmap") as store, \
            Prefetcher(store, hasher, split_min_rows=1) as pf:
        gates = [threading.Event(), threading.Event()]
        entered = [threading.Event(), threading.Event()]
        read = store.tier.read_rows
        calls = []
        lock = threading.Lock()

        def recording(ids, out):
            with lock:
                n = len(calls)
                calls.append(ids.copy())
            if n < 2:  # the first read of each worker waits for its gate
                entered[n].set()
                assert gates[n].wait(10)
            return read(ids, out)

        store.tier.read_rows = recording
        ahead = pf.begin_step([1], [tokens[0]], urgent=False)  # the general worker blocks in its part 0
        assert entered[0].wait(10)
        busy = pf.begin_step([3], [tokens[2]])  # the urgent-only worker blocks in its part 0
        assert entered[1].wait(10)
        later = pf.begin_step([1], [tokens[0, :3]], urgent=False)
        now = pf.begin_step([2], [tokens[1]])
        gates[0].set()  # the general worker: busy's part 1, now, then ahead's part 1 and later
        assert later.wait_done(10) and ahead.wait_done(10) and now.wait_done(10)
        gates[1].set()
        for pos, layer in enumerate(CONFIG.layer_ids):
            want = expected_rows(plain, hasher, tokens[1:2], pos)[0]
            assert torch.equal(pf.rows(layer, now), want)
        for step in (now, ahead, later, busy):
            pf.end_step(step)
            assert step.error is None and len(step.parts) == 2

        steps = {"ahead": ahead, "later": later, "now": now, "busy": busy}
        assert [part_owner(c, steps)[0] for c in calls] == ["ahead", "busy", "busy", "now", "now", "ahead", "later",
                                                              "later"]


def test_an_idle_general_worker_serves_urgent_steps_alone(table, hasher):
    """A new step wakes one worker: the general one when it waits (the urgent-only one is
    woken only when the general one is busy), so steady steps cost one thread switch."""
    tokens = np.random.default_rng(8).integers(0, VOCAB, size=(6, 4))
    with open_table(table, "mmap") as store, Prefetcher(store, hasher, split_min_rows=1) as pf:
        served = []
        fetch = store.fetch

        def recording(ids, **kwargs):
            served.append(threading.current_thread().name)
            return fetch(ids, **kwargs)

        store.fetch = recording
        for i, piece in enumerate(tokens):
            deadline = time.monotonic() + 10
            while not pf._idle[False]:  # the general worker waits for work
                assert time.monotonic() < deadline
                time.sleep(0.001)
            step = pf.begin_step([i], [piece])
            assert step.wait_done(10) and len(step.parts) == 2
            pf.end_step(step)
        assert served == ["engram-prefetch-0"] * 12


def test_prefetch_errors_live_in_the_error_module():
    from engram_offload import errors
    from engram_offload.serving import prefetch

    assert prefetch.PrefetchError is errors.PrefetchError and prefetch.StepCancelled is errors.StepCancelled
    assert issubclass(errors.StepCancelled, errors.PrefetchError) and issubclass(errors.PrefetchError, errors.EngramError)
    assert all(name in errors.__doc__ for name in errors.__all__)  # the tree lists every exception


# ---------------------------------------------------------------------- rows delivered to a device
DEVICE_STORES = [
    pytest.param("direct", {"cache_bytes": 300 * CONFIG.row_bytes, "fast_cache_bytes": 100 * CONFIG.row_bytes},
                 id="direct+hbm+dram"),
    pytest.param("memory", {"fast_cache_bytes": 100 * CONFIG.row_bytes}, id="memory over uva+hbm"),
    pytest.param("mmap", {}, id="mmap staged"),
]


@pytest.mark.parametrize("tier,options", DEVICE_STORES)
@pytest.mark.parametrize("split_min_rows", [0, 10_000], ids=["per layer", "one part"])
def test_device_prefetch_hands_each_layer_its_rows_after_their_event(table, hasher, tier, options, split_min_rows):
    """A CPU 'device' with the tracing DeviceSync: every layer's rows equal the host path's,
    are read on the caller's stream only after the fetch stream's event, sit at the same
    address step after step, and the buffers are rewritten only after they were read."""
    from tracing_sync import TracingSync

    rng = np.random.default_rng(11)
    tokens = rng.integers(0, VOCAB, size=(3, 18))
    sync = TracingSync()
    with open_table(table, "mmap") as host_store, Prefetcher(host_store, hasher) as host, \
            open_table(table, tier, device="cpu", sync=sync, staging_bytes=64 * CONFIG.row_bytes, **options) as store, \
            Prefetcher(store, NgramHasher(CONFIG, hasher.token_map), split_min_rows=split_min_rows) as pf:
        addresses = set()
        # prefill windows of 18, 6 (more tokens than columns) and 18 tokens (as many as the buffers
        # hold), then decode steps: the buffers never move
        for piece in (slice(0, 6), slice(6, 8), slice(8, 14), *[slice(t, t + 1) for t in range(14, 18)]):
            pieces = [tokens[i, piece] for i in range(3)]
            want_step, step = host.begin_step([1, 2, 3], pieces), pf.begin_step([1, 2, 3], pieces)
            for layer in reversed(CONFIG.layer_ids):
                got = pf.rows(layer, step, timeout=10)
                assert torch.equal(got, host.rows(layer, want_step, timeout=10)), (piece, layer)
            addresses.add(step.layer_outputs[0].data_ptr())
            host.end_step(want_step)
            pf.end_step(step)
        assert len(addresses) == 1  # fixed addresses: a graph captured around the layers stays valid
        assert store.stats()["store"]["fetches"] == 7 * len(step.parts)
        assert [lv.pinned() for lv in store.levels] == [0] * len(store.levels)


def test_a_layer_reading_before_its_event_is_caught(table, hasher):
    from engram_offload.gpu import OrderingError

    from tracing_sync import TracingSync

    sync = TracingSync()
    with open_table(table, "mmap", device="cpu", sync=sync) as store, Prefetcher(store, hasher) as pf:
        step = pf.begin_step([1], [[5, 6, 7]])
        assert step.wait_done(10)
        step._events[0] = None  # a step that lost its part's event
        with pytest.raises(OrderingError, match="prefetch_rows"):
            pf.rows(CONFIG.layer_ids[0], step)
        pf.end_step(step)


def test_a_device_prefetcher_needs_the_store_to_deliver_to_its_device(table, hasher):
    with open_table(table, "mmap") as store:
        with pytest.raises(ValueError, match=r"^the store delivers rows to cpu, not meta: open the table with "
                                             r"open_table\(\.\.\., device='meta'\) so rows reach the device "
                                             r"through pinned staging, never a pageable copy$"):
            Prefetcher(store, hasher, device="meta")


# ---------------------------------------------------------------------- column shards (tensor parallelism)
def shard_table(tmp_path, n_heads: int, max_ngram_size: int):
    """A table of ``(max_ngram_size - 1) * n_heads`` columns a layer, and its config."""
    config = EngramConfig(layer_ids=(1, 3), max_ngram_size=max_ngram_size, n_heads=n_heads, head_dim=32,
                          prime_starts=(200,) * (max_ngram_size - 1), row_format="bf16")
    return write_table(tmp_path / "c.tbl", config, torch.randn(config.num_rows, config.head_dim)), config


def sharded_steps(rng: np.random.Generator, sequences: int = 3, tokens: int = 12) -> list[list[np.ndarray]]:
    """Pieces of each step: a prefill of uneven lengths, then decode tokens."""
    ids = rng.integers(0, VOCAB, size=(sequences, tokens))
    return [[ids[0, :5], ids[1, :3], ids[2, :6]], [ids[0, 5:8], ids[1, 3:4], ids[2, 6:7]],
            *[[ids[i, t: t + 1] for i in range(sequences)] for t in range(8, tokens)]]


SHARD_STORES = [
    pytest.param("store", "mmap", {"cache_bytes": 200 * 64}, id="mmap+cache with columns"),
    pytest.param("store", "direct", {"engine": "threads"}, id="direct with columns"),
    pytest.param("prefetcher", "memory", {}, id="memory, columns on the Prefetcher"),
    pytest.param("device", "mmap", {}, id="device mmap with columns"),
]


@pytest.mark.parametrize("where, tier, options", SHARD_STORES)
@pytest.mark.parametrize("n_heads, max_ngram_size, world", [(7, 2, 2), (7, 2, 4), (3, 3, 4)],
                         ids=["C7 tp2: 4+3", "C7 tp4: 2+2+2+1", "C6 tp4: 2+2+2+0"])
def test_each_ranks_rows_are_its_column_slice_of_the_unsharded_rows(tmp_path, where, tier, options, n_heads,
                                                                    max_ngram_size, world):
    from tracing_sync import TracingSync

    path, config = shard_table(tmp_path, n_heads, max_ngram_size)
    token_map = np.arange(VOCAB, dtype=np.int64) % 700
    steps = sharded_steps(np.random.default_rng(world))
    seqs = [1, 2, 3]
    with open_table(path, "mmap") as whole, Prefetcher(whole, NgramHasher(config, token_map)) as reference:
        want = []  # per step, per layer: [T, C, d]
        for pieces in steps:
            reference.begin_step(seqs, pieces)
            want.append([reference.rows(layer, timeout=10) for layer in config.layer_ids])
            reference.end_step()
        for rank in range(world):
            columns = shard_columns(config, rank, world)
            on_store = columns if where != "prefetcher" else None
            device = {"device": "cpu", "sync": TracingSync()} if where == "device" else {}
            with open_table(path, tier, columns=on_store, **device, **options) as store, \
                    Prefetcher(store, NgramHasher(config, token_map), split_min_rows=1,
                               columns=None if on_store else columns) as pf:
                assert pf.columns == columns
                for pieces, rows in zip(steps, want):
                    step = pf.begin_step(seqs, pieces)
                    for layer, full in reversed(list(zip(config.layer_ids, rows))):
                        got = pf.rows(layer, timeout=10)  # [T, c1 - c0, d]
                        assert got.shape == (full.shape[0], columns[1] - columns[0], config.head_dim)
                        assert torch.equal(got, full[:, columns[0]: columns[1]]), (rank, layer)
                    pf.end_step(step)
                    assert step.dedup.unique.size == 0 or shard_rows(config, columns).contains(step.dedup.unique).all()
                assert [lv.pinned() for lv in store.levels] == [0] * len(store.levels)


def test_the_prefetcher_takes_the_stores_columns_and_refuses_others(table, hasher):
    columns = shard_columns(CONFIG, 0, 2)
    with open_table(table, "mmap", columns=columns) as store:
        for given in (None, columns):
            with Prefetcher(store, hasher, columns=given) as pf:
                assert pf.columns == columns
        with pytest.raises(ValueError, match="serves columns"):
            Prefetcher(store, hasher, columns=shard_columns(CONFIG, 1, 2))
    with open_table(table, "mmap") as store:
        with pytest.raises(ValueError, match="columns must satisfy"):
            Prefetcher(store, hasher, columns=(0, CONFIG.cols_per_layer + 1))


# ---------------------------------------------------------------------- steps: numbers, state, timings, errors
def _gate_layers(store, gates: list[threading.Event], fail_first: bool = False):
    """Make every tier read of a layer's rows wait for that layer's gate (or, with
    ``fail_first``, fail reads of the first layer's rows)."""
    real = store.tier.read_rows
    second_base = CONFIG.layer_row_bases[1]
    reads: list[int] = []

    def gated(ids, out):
        layer = int((np.asarray(ids) >= second_base).any())
        reads.append(layer)
        if fail_first and layer == 0:
            raise TierError("first layer unreadable")
        assert gates[layer].wait(10)
        return real(ids, out)

    store.tier.read_rows = gated
    return reads


def _open_later(gate: threading.Event, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, gate.set)
    timer.start()
    return timer


def test_a_step_counts_its_stalls_and_times_its_parts(table, hasher):
    gates = [threading.Event(), threading.Event()]
    with open_table(table, "mmap") as store, Prefetcher(store, hasher, split_min_rows=0) as pf:
        _gate_layers(store, gates)
        start = time.perf_counter()
        step = pf.begin_step([10, 11], [[5, 6, 7], [8, 9]])
        assert (step.number, step.seq_ids, step.lengths) == (1, (10, 11), (3, 2))
        assert (step.stalls, step.stall_seconds, step.fetch_seconds, step.first_part_seconds) == (0, 0.0, 0.0, 0.0)
        assert not step.wait_done(0.05)  # the timeout is honoured
        waits = []
        for layer, gate in zip(CONFIG.layer_ids, gates):
            _open_later(gate, 0.2)
            t0 = time.perf_counter()
            pf.rows(layer, timeout=10)
            waits.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
        assert step.stalls == 2 and 0.3 < step.stall_seconds <= sum(waits)
        assert step.wait_done(10)
        assert 0 < step.first_part_seconds < step.fetch_seconds <= elapsed
        assert step.first_part_seconds < elapsed - waits[1]  # the first part arrived before the second's gate opened
        pf.rows(CONFIG.layer_ids[0])  # delivered: no stall
        assert step.stalls == 2
        assert pf.stats() == {"steps": 0, "failures": 0, "stall_seconds": 0.0, "open_steps": 1}
        pf.end_step(step)
        assert pf.stats() == {"steps": 1, "failures": 0, "stall_seconds": step.stall_seconds, "open_steps": 0}
        nxt = pf.begin_step([10], [[1]])
        assert nxt.number == 2 and nxt.stalls == 0
        pf.rows(CONFIG.layer_ids[1], timeout=10)
        pf.end_step(nxt)
        assert pf.stats()["stall_seconds"] == step.stall_seconds + nxt.stall_seconds


def test_a_steps_repr_tells_its_state(table, hasher):
    gates = [threading.Event(), threading.Event()]
    with open_table(table, "mmap") as store, Prefetcher(store, hasher) as pf:
        _gate_layers(store, gates)
        step = pf.begin_step([1], [[5, 6, 7]])
        head = f"Step(1, tokens=3, unique={step.dedup.unique.size}/{step.dedup.requested}, parts=1, "
        assert repr(step) == head + "fetching)"
        for gate in gates:
            gate.set()
        step.wait_done(10)
        assert repr(step) == head + "ready)"
        pf.end_step(step)
        cancelled = pf.begin_step([2], [[5, 6, 7]])
        pf.cancel(cancelled)
        assert repr(cancelled).endswith(", cancelled)")
        store.tier.read_rows = lambda ids, out: (_ for _ in ()).throw(TierError("gone"))
        failed = pf.begin_step([3], [[5, 6, 7]])
        failed.wait_done(10)
        assert repr(failed).endswith(", failed)")
        pf.end_step(failed)


def test_errors_name_the_step_the_layer_and_the_cause(table, hasher):
    gates = [threading.Event(), threading.Event()]
    with open_table(table, "mmap") as store, Prefetcher(store, hasher) as pf:
        _gate_layers(store, gates)
        step = pf.begin_step([1], [[5, 6, 7]])
        with pytest.raises(TimeoutError, match=r"^rows of layer 3 of step 1 not delivered after 0\.05 s: TableStore\(.*\) did not return them"):
            pf.rows(3, timeout=0.05)
        for gate in gates:
            gate.set()
        pf.end_step(step)
        store.tier.read_rows = lambda ids, out: (_ for _ in ()).throw(TierError("disk went away"))
        failed = pf.begin_step([2], [[5, 6, 7, 8]])
        unique = failed.dedup.unique.size
        with pytest.raises(PrefetchError, match=rf"^fetching the rows of step 2 \({unique} rows\) failed: "
                                                r"TierError: disk went away$"):
            pf.rows(1, timeout=10)
        pf.end_step(failed)
        cancelled = pf.begin_step([3], [[5]])
        pf.cancel(cancelled)
        with pytest.raises(StepCancelled, match=r"^step 3 was cancelled; begin a new step$"):
            pf.rows(1, cancelled, timeout=10)


def test_begin_step_refuses_a_closed_or_broken_prefetcher_and_odd_pieces(table, hasher):
    with open_table(table, "mmap") as store:
        with Prefetcher(store, hasher) as pf:
            with pytest.raises(ValueError, match=r"^2 pieces for 1 sequences$"):
                pf.begin_step([1], [[5], [6]])
            pf._stop_workers()  # the workers stop, as if they had died
            for worker in pf._workers:
                worker.join(10)
            with pytest.raises(PrefetchError, match=r"^the prefetch worker has stopped; create a new Prefetcher$"):
                pf.begin_step([1], [[5]])
        with pytest.raises(ValueError, match=r"^this prefetcher is closed: create a new one$"):
            pf.begin_step([1], [[5]])


def test_a_failed_first_layer_fails_the_later_ones_without_reading_them(table, hasher):
    """A step fetched ahead is served by one worker, part after part: after the first part
    fails, the second is skipped with the same error."""
    gates = [threading.Event(), threading.Event()]
    with open_table(table, "mmap") as store, Prefetcher(store, hasher, split_min_rows=0) as pf:
        reads = _gate_layers(store, gates, fail_first=True)
        gates[1].set()
        step = pf.begin_step([1], [[5, 6, 7, 8]], urgent=False)
        assert step.wait_done(10)
        assert reads == [0] and isinstance(step.error, TierError)
        for layer in CONFIG.layer_ids:
            with pytest.raises(PrefetchError, match="first layer unreadable") as info:
                pf.rows(layer, timeout=10)
            assert info.value.__cause__ is step.error
        pf.end_step(step)
        assert pf.stats()["failures"] == 1


def test_rows_already_returned_stay_usable_after_a_cancel(table, hasher):
    from tracing_sync import TracingSync

    for device in ({}, {"device": "cpu", "sync": TracingSync()}):
        with open_table(table, "mmap", **device) as store, Prefetcher(store, hasher) as pf:
            step = pf.begin_step([1], [[5, 6, 7]])
            first = pf.rows(CONFIG.layer_ids[0], timeout=10)
            pf.cancel(step)
            assert pf.rows(CONFIG.layer_ids[0], step) is first
            with pytest.raises(StepCancelled):
                pf.rows(CONFIG.layer_ids[1], step)


def test_cancel_takes_the_step_it_is_given_and_ends_none(table, hasher):
    with open_table(table, "mmap") as plain, open_table(table, "mmap") as store, Prefetcher(store, hasher) as pf:
        first = pf.begin_step([1], [[5, 6, 7]])
        second = pf.begin_step([2], [[8, 9]])
        pf.cancel(first)
        assert first.cancelled and not second.cancelled and pf.current is second
        assert pf.stats()["open_steps"] == 1
        want = expected_rows(plain, hasher, np.array([[8, 9]]), 1)[0]
        assert torch.equal(pf.rows(CONFIG.layer_ids[1], timeout=10), want)
        pf.end_step()
        assert pf.stats()["steps"] == 1 and pf.stats()["open_steps"] == 0


def test_dead_tokens_reach_the_hasher_in_prefill_and_decode(table, hasher):
    rng = np.random.default_rng(12)
    tokens = rng.integers(0, VOCAB, size=(2, 6))
    dead = np.zeros((2, 6), bool)
    dead[0, 2] = dead[1, 4] = dead[0, 5] = True
    with open_table(table, "mmap") as plain, open_table(table, "mmap") as store, Prefetcher(store, hasher) as pf:
        ids = hasher.table_ids(hasher.hash_all(tokens, dead))  # [B, T, L, C]
        for piece in (slice(0, 4), slice(4, 5), slice(5, 6)):  # a prefill, then decode steps
            pf.begin_step([1, 2], [tokens[0, piece], tokens[1, piece]], [dead[0, piece], dead[1, piece]])
            for pos, layer in enumerate(CONFIG.layer_ids):
                want = plain.gather(ids[:, piece, pos], torch.float32).reshape(-1, CONFIG.cols_per_layer, CONFIG.head_dim)
                assert torch.equal(pf.rows(layer, timeout=10), want), (piece, layer)
            pf.end_step()


def test_a_released_sequence_starts_afresh(table, hasher):
    tokens = np.array([[11, 12, 13, 14, 15]])
    with open_table(table, "mmap") as plain, open_table(table, "mmap") as store, Prefetcher(store, hasher) as pf:
        pf.begin_step([7], [tokens[0, :3]])
        pf.end_step()
        pf.release_sequence(7)
        pf.begin_step([7], [tokens[0, 3:]])  # no lookback to 11..13
        for pos, layer in enumerate(CONFIG.layer_ids):
            want = expected_rows(plain, hasher, tokens[:, 3:], pos)[0]
            assert torch.equal(pf.rows(layer, timeout=10), want)
        pf.end_step()


def test_a_step_of_exactly_split_min_rows_is_split(table, hasher):
    pieces = [[5, 6, 7, 8]]
    with open_table(table, "mmap") as store:
        with Prefetcher(store, hasher) as pf:
            unique = pf.begin_step([1], pieces).dedup.unique.size
        for split_min_rows, parts in ((unique, 2), (unique + 1, 1)):
            with Prefetcher(store, hasher, split_min_rows=split_min_rows) as pf:
                assert len(pf.begin_step([1], pieces).parts) == parts


@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_rows_come_in_the_dtype_asked_for(table, hasher, device):
    from tracing_sync import TracingSync

    tokens = np.array([[5, 6, 7, 8]])
    options = {"device": "cpu", "sync": TracingSync()} if device else {}
    with open_table(table, "mmap") as plain, open_table(table, "mmap", **options) as store, \
            Prefetcher(store, hasher, dtype=torch.bfloat16, split_min_rows=0) as pf:
        pf.begin_step([1], list(tokens))
        for pos, layer in enumerate(CONFIG.layer_ids):
            ids = hasher.table_ids(hasher.hash_all(tokens))[:, :, pos]  # [1, T, C]
            got = pf.rows(layer, timeout=10)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, plain.gather(ids, torch.bfloat16)[0])
        pf.end_step()


def test_device_output_sets_are_named_apart_and_come_back_after_a_cancel(table, hasher):
    """Two steps in flight hold two output sets, each under its own name in the sync's trace;
    sets cancelled mid-fetch return to the pool once their fetch ends, and are taken again."""
    from tracing_sync import TracingSync

    gate = threading.Event()
    with open_table(table, "mmap", device="cpu", sync=TracingSync()) as store, Prefetcher(store, hasher) as pf:
        fetch = store.fetch

        def gated(*args, **kwargs):  # the workers wait before the fetch (never inside the sync's lock)
            assert gate.wait(10)
            return fetch(*args, **kwargs)

        store.fetch = gated
        first = pf.begin_step([1], [[5, 6, 7]])
        second = pf.begin_step([2], [[8, 9, 10]])
        assert [first.outputs.name, second.outputs.name] == ["prefetch_rows1", "prefetch_rows2"]
        assert first.layer_outputs[0].data_ptr() != second.layer_outputs[0].data_ptr()
        pf.cancel(first)  # still fetching: its set goes back only when the fetch ends
        pf.cancel(second)
        gate.set()
        assert first.wait_done(10) and second.wait_done(10)
        again = [pf.begin_step([3], [[1, 2, 3]]), pf.begin_step([4], [[4, 5]])]  # both sets came back
        assert {id(s.outputs) for s in again} == {id(first.outputs), id(second.outputs)}
        for step in again:
            pf.rows(CONFIG.layer_ids[0], step, timeout=10)
            pf.end_step(step)
        assert pf.stats()["failures"] == 0, [s.error for s in (first, second, *again)]


def test_without_a_step_in_flight_rows_is_refused_and_ending_is_a_no_op(table, hasher):
    history = hasher.new_history()
    with open_table(table, "mmap") as store, Prefetcher(store, hasher, history=history) as pf:
        assert pf.history is history and pf.split_min_rows == 512  # the defaults: 512 rows a part at least
        workers = [t for t in threading.enumerate() if t in pf._workers]
        assert sorted(t.name for t in workers) == ["engram-prefetch-0", "engram-prefetch-1"]
        assert all(t.daemon for t in workers)  # an unclosed prefetcher never keeps the process alive
        for _ in range(2):  # before the first step, and after one ended
            with pytest.raises(ValueError, match=r"^no step in flight: call begin_step\(seq_ids, pieces\) first$"):
                pf.rows(CONFIG.layer_ids[0])
            pf.end_step()
            pf.cancel()
            step = pf.begin_step([1], [[5, 6]])
            pf.end_step()
            assert pf.current is None and step.done()


def test_a_step_ended_twice_gives_its_output_set_back_once(table, hasher):
    from tracing_sync import TracingSync

    with open_table(table, "mmap", device="cpu", sync=TracingSync()) as store, Prefetcher(store, hasher) as pf:
        step = pf.begin_step([1], [[5, 6, 7]])
        pf.end_step(step)
        pf.end_step(step)  # already ended: nothing more to give back
        a = pf.begin_step([2], [[8, 9]])
        b = pf.begin_step([3], [[10, 11]])
        assert a.outputs is step.outputs and b.outputs is not a.outputs
        pf.end_step(a)
        pf.end_step(b)


# ---------------------------------------------------------------- a decode step given as one array
def decode_steps_rows(table, hasher, as_pieces, steps: np.ndarray, dead=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's table ids and first layer's rows, the tokens given by ``as_pieces``."""
    seen = []
    with open_table(table, "mmap") as store, Prefetcher(store, hasher) as pf:
        for tokens in steps:  # [S] a step
            step = pf.begin_step([7, 8, 9], as_pieces(tokens), dead)
            seen.append((step.table_ids.clone(), pf.rows(CONFIG.layer_ids[0], step).clone()))
            assert step.lengths == (1, 1, 1)
            pf.end_step(step)
    return seen


@pytest.mark.parametrize("form", ["numpy", "int32", "tensor"])
def test_one_array_of_decode_tokens_hashes_as_one_piece_each(table, hasher, form):
    steps = np.random.default_rng(4).integers(0, VOCAB, size=(5, 3))  # 5 steps of 3 sequences
    convert = {"numpy": lambda t: t, "int32": lambda t: t.astype(np.int32), "tensor": torch.from_numpy}[form]
    want = decode_steps_rows(table, hasher, lambda t: [t[i:i + 1] for i in range(t.size)], steps)
    got = decode_steps_rows(table, hasher, convert, steps)
    for (ids_w, rows_w), (ids_g, rows_g) in zip(want, got):
        assert torch.equal(ids_g, ids_w) and torch.equal(rows_g, rows_w)
    # the history carried over: the last step's ids are not those of its tokens alone
    fresh = decode_steps_rows(table, hasher, convert, steps[-1:])
    assert not torch.equal(fresh[0][0], got[-1][0])


def test_one_array_with_dead_masks_takes_the_pieces_path(table, hasher):
    steps = np.random.default_rng(6).integers(0, VOCAB, size=(3, 3))
    dead = [np.array([True]), None, np.array([False])]
    want = decode_steps_rows(table, hasher, lambda t: [t[i:i + 1] for i in range(t.size)], steps, dead)
    got = decode_steps_rows(table, hasher, lambda t: t, steps, dead)
    assert all(torch.equal(g[0], w[0]) for g, w in zip(got, want))


def test_one_array_must_hold_a_token_per_sequence_and_integers(table, hasher):
    with open_table(table, "mmap") as store, Prefetcher(store, hasher) as pf:
        with pytest.raises(ValueError, match="2 tokens for 3 sequences: give one each"):
            pf.begin_step([1, 2, 3], np.array([5, 6]))
        with pytest.raises(TypeError, match="must be integers, got an array of float64"):
            pf.begin_step([1, 2], np.array([5.0, 6.0]))
        with pytest.raises(ValueError, match="2 pieces for 3 sequences"):
            pf.begin_step([1, 2, 3], [np.array([5]), np.array([6])])


def test_a_steps_table_ids_are_a_contiguous_tensor_of_the_hashed_ids(table, hasher):
    """Step.table_ids: made only when asked for, from the hasher's flat ids (a transposed view)."""
    reference = NgramHasher(CONFIG, hasher.token_map)
    with open_table(table, "memory") as store, Prefetcher(store, hasher) as pf:
        step = pf.begin_step([0, 1], np.array([5, 9]))
        ids = step.table_ids
        assert isinstance(ids, torch.Tensor) and ids.is_contiguous()
        assert ids.shape == (2, len(CONFIG.layer_ids), CONFIG.cols_per_layer)
        want = reference.table_ids(reference.hash_decode(reference.new_history(), [0, 1], [5, 9]))
        assert torch.equal(ids, want)
        assert step.table_ids is ids  # made once
        pf.end_step(step)


def test_hit_rows_are_decoded_where_the_cache_holds_them(table, hasher):
    """Steps whose rows the cache holds every one of are decoded from its arena (a lease
    ``in_place``); the rows are the tier's, under a cache small enough that every step evicts
    rows of the ones before."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, VOCAB, size=(4, 10))
    with open_table(table, "mmap") as plain, open_table(table, "mmap", cache_bytes=150 * CONFIG.row_bytes) as store, \
            Prefetcher(store, hasher, split_min_rows=1) as pf:
        leases = []
        fetch = store.fetch
        store.fetch = lambda ids, **kw: leases.append((kw["in_place"], fetch(ids, **kw))) or leases[-1][1]
        for t in range(10):
            for first in (0, 4):  # two groups of sequences with the same tokens: the second's rows all hit
                pf.begin_step([first + k for k in range(4)], tokens[:, t])
                for pos, layer in enumerate(CONFIG.layer_ids):
                    assert torch.equal(pf.rows(layer), expected_rows(plain, hasher, tokens, pos)[:, t])
                pf.end_step()
        assert {asked for asked, _ in leases} == {True}
        left = [lease.in_place is not None for _, lease in leases]
        assert any(left) and not all(left)  # the first of each step's fetches missed
        assert store.levels[0].pinned() == 0


def test_a_sequence_with_no_new_tokens_this_step_is_an_empty_piece(table, hasher):
    with open_table(table, "mmap") as store, Prefetcher(store, hasher) as pf:
        for empty in ([], np.array([]), torch.tensor([])):  # [] reads as float64: no token ids to refuse
            step = pf.begin_step([1, 2], [[5, 6, 7], empty])
            assert step.lengths == (3, 0)
            assert pf.rows(CONFIG.layer_ids[0]).shape == (3, CONFIG.cols_per_layer, CONFIG.head_dim)
            pf.end_step()
