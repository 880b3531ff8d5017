"""``first_layer_first``: a queued first-layer part goes before another step's later layer."""

from __future__ import annotations

import threading

import numpy as np
import torch
from test_prefetch import CONFIG, VOCAB, part_owner, table  # noqa: F401  (table: the Prefetcher tests' fixture)

from engram_offload import open_table
from engram_offload.engram.hashing import NgramHasher
from engram_offload.serving.prefetch import Prefetcher


def held_workers(store, pf: Prefetcher, tokens: np.ndarray):
    """Both workers held inside a fetch (the general one in ``ahead``'s first part, the urgent-only
    one in ``a``'s); returns the two steps, the gates that let them go, and every fetch's ids."""
    gates, entered = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
    calls: list[np.ndarray] = []
    lock = threading.Lock()
    real = store.fetch

    def recording(ids, **kwargs):
        with lock:
            n = len(calls)
            calls.append(np.asarray(ids).copy())
        if n < 2:
            entered[n].set()
            assert gates[n].wait(10)
        return real(ids, **kwargs)

    store.fetch = recording
    ahead = pf.begin_step([1], [tokens[0]], urgent=False)
    assert entered[0].wait(10)
    a = pf.begin_step([2], [tokens[1]])
    assert entered[1].wait(10)
    return ahead, a, gates, calls


def _order(table, first_layer_first: bool | None, tier: str = "mmap") -> list[str]:
    """Both workers held in a read (``held_workers``); ``b`` is queued; the general worker's
    picks once let go."""
    tokens = np.random.default_rng(4).integers(0, VOCAB, size=(3, 6))
    hasher = NgramHasher(CONFIG, np.arange(VOCAB, dtype=np.int64) % 700)
    spec = tier if tier != "layered" else "1=memory/3=mmap"
    with open_table(table, spec) as store, \
            Prefetcher(store, hasher, split_min_rows=1, first_layer_first=first_layer_first) as pf:
        ahead, a, gates, calls = held_workers(store, pf, tokens)
        b = pf.begin_step([3], [tokens[2]])
        gates[0].set()
        assert b.wait_done(10) and ahead.wait_done(10)
        gates[1].set()
        for step in (a, b, ahead):
            pf.end_step(step)
            assert step.error is None and len(step.parts) == 2

        owners = [part_owner(c, {"ahead": ahead, "a": a, "b": b}) for c in calls]
        return [f"{name}{k}" if k >= 0 else name for name, k in owners]


def test_the_first_layers_part_of_a_later_step_goes_first(table):
    assert _order(table, True) == ["ahead0", "a0", "b0", "a1", "b1", "ahead1"]


def test_by_default_steps_are_served_in_order_on_one_tier(table):
    assert _order(table, None) == ["ahead0", "a0", "a1", "b0", "b1", "ahead1"]


def test_by_default_on_for_layers_on_different_tiers(table):
    assert _order(table, None, "layered") == ["ahead0", "a0", "b0", "a1", "b1", "ahead1"]


def test_a_small_step_over_layers_on_different_tiers_is_still_fetched_layer_by_layer(table):
    hasher = NgramHasher(CONFIG, np.arange(VOCAB, dtype=np.int64) % 700)
    with open_table(table, "1=memory/3=direct") as layered, open_table(table, "1=mmap/3=mmap") as same, \
            open_table(table, "mmap") as plain:
        one = Prefetcher(layered, hasher)
        two = Prefetcher(same, NgramHasher(CONFIG, np.arange(VOCAB, dtype=np.int64) % 700))
        try:
            assert one.split_min_rows == 1 and two.split_min_rows == 512 and not two.first_layer_first
            step = one.begin_step([1], np.array([7]))  # one token: far fewer rows than 512
            assert len(step.parts) == 2  # layer 1's rows never wait for layer 3's
            want = plain.gather(hasher.table_ids(hasher.hash_all(np.array([[7]])))[0, 0, 0], torch.float32)
            assert torch.equal(one.rows(1, step)[0], want)
            one.end_step(step)
        finally:
            one.close()
            two.close()
