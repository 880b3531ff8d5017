"""A caller whose layer's part no worker has taken, both workers busy, fetches it itself."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import torch
from test_prefetch import CONFIG, VOCAB, expected_rows, part_owner, table  # noqa: F401  (table: the Prefetcher tests' fixture)
from test_prefetch_first_layer import held_workers

from engram_offload import open_table
from engram_offload.engram.hashing import NgramHasher
from engram_offload.serving.prefetch import Prefetcher


def _parts_fetched(calls: list[np.ndarray], step) -> int:
    return sum(part_owner(ids, {"step": step})[0] == "step" for ids in calls)


@contextmanager
def _third_step_behind_held_workers(table, spec: str, seed: int):
    """A plain store, the hasher, the Prefetcher, the tokens, its held steps and gates, the
    fetches so far, and a third step ``b`` queued behind them."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB, size=(3, 6))
    hasher = NgramHasher(CONFIG, np.arange(VOCAB, dtype=np.int64) % 700)
    with open_table(table, "mmap") as plain, open_table(table, spec) as store, \
            Prefetcher(store, hasher, split_min_rows=1, wait_s=5) as pf:
        ahead, a, gates, calls = held_workers(store, pf, tokens)
        b = pf.begin_step([3], [tokens[2]])
        yield plain, hasher, pf, tokens, (ahead, a), gates, calls, b


def test_a_caller_fetches_its_own_parts_while_both_workers_are_busy(table):
    with _third_step_behind_held_workers(table, "1=memory/3=mmap", 6) as (plain, hasher, pf, tokens, (ahead, a),
                                                                          gates, calls, b):
        for pos, layer in enumerate(CONFIG.layer_ids):  # the workers stay held throughout
            assert torch.equal(pf.rows(layer, b), expected_rows(plain, hasher, tokens[2:3], pos)[0])
        assert b.done() and b.stalls == 2 and b.stall_seconds > 0
        assert not any(g.is_set() for g in gates) and _parts_fetched(calls, b) == 2
        pf.end_step(b)
        for g in gates:
            g.set()
        for step in (a, ahead):
            pf.end_step(step)
            assert step.error is None
        assert _parts_fetched(calls, b) == 2  # taken off the queue: no worker fetched them again


def test_a_caller_takes_the_parts_before_its_layer_in_order_and_leaves_the_rest(table):
    with _third_step_behind_held_workers(table, "mmap", 7) as (plain, hasher, pf, tokens, (ahead, a), gates, calls, b):
        first = CONFIG.layer_ids[0]
        assert torch.equal(pf.rows(first, b), expected_rows(plain, hasher, tokens[2:3], 0)[0])
        assert b._handed_out == 1 and not b.done()  # its second layer's part still queued for a worker
        gates[1].set()  # the urgent-only worker: a's second part, then b's
        assert b.wait_done(10)
        assert torch.equal(pf.rows(CONFIG.layer_ids[1], b), expected_rows(plain, hasher, tokens[2:3], 1)[0])
        assert b.stalls == 1 and _parts_fetched(calls, b) == 2
        gates[0].set()
        for step in (b, a, ahead):
            pf.end_step(step)
            assert step.error is None


def test_a_caller_waits_for_an_idle_worker_rather_than_fetch(table):
    tokens = np.random.default_rng(8).integers(0, VOCAB, size=(1, 6))
    hasher = NgramHasher(CONFIG, np.arange(VOCAB, dtype=np.int64) % 700)
    with open_table(table, "mmap") as store, Prefetcher(store, hasher, split_min_rows=1, wait_s=5) as pf:
        fetched_by: list[str] = []
        real = store.fetch

        def recording(ids, **kwargs):
            fetched_by.append(threading.current_thread().name)
            return real(ids, **kwargs)

        store.fetch = recording
        step = pf.begin_step([1], [tokens[0]])
        for layer in CONFIG.layer_ids:
            pf.rows(layer, step)
        pf.end_step(step)
        assert len(fetched_by) == 2 and all(name.startswith("engram-prefetch") for name in fetched_by)
