"""Rows of draft tokens fetched a step early: hits when right, reads (never rows) when wrong."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prefetch import part_owner

from engram_offload import open_table, write_table
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.hashing import NgramHasher
from engram_offload.serving.prefetch import Prefetcher

CONFIG = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=32,
                      prime_starts=(300, 500), row_format="fp8_e4m3_ue8m0")
VOCAB = 1000
SEQS = [5, 6, 7]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    x = torch.randn(CONFIG.num_rows, CONFIG.head_dim)
    return write_table(tmp_path_factory.mktemp("drafts") / "t.tbl", CONFIG, x)


def _hasher() -> NgramHasher:
    return NgramHasher(CONFIG, np.arange(VOCAB, dtype=np.int64) % 700)


def _expected(plain, hasher, tokens: np.ndarray, t: int, pos: int) -> torch.Tensor:
    ids = hasher.table_ids(hasher.hash_all(tokens))[:, t, pos]  # [S, C]
    return plain.gather(ids, torch.float32)


def _tier_rows(store) -> int:
    return store.stats()["levels"][-1]["rows"]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), kinds=st.lists(st.sampled_from(["right", "wrong", "none", "long", "some"]),
                                                      min_size=6, max_size=6))
def test_drafts_right_or_wrong_never_change_a_steps_rows(table, seed, kinds):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(len(SEQS), 10))
    hasher = _hasher()
    with open_table(table, "direct", cache_bytes=300 * CONFIG.row_bytes) as store, \
            open_table(table, "mmap") as plain, Prefetcher(store, hasher) as pf:
        pf.end_step(pf.begin_step(SEQS, [tokens[i, :3] for i in range(len(SEQS))]))
        for t, kind in zip(range(3, 9), kinds):
            nxt = tokens[:, t + 1: t + 3]  # the true next two tokens of each sequence
            drafts = {"right": list(nxt), "wrong": list(rng.integers(0, VOCAB, size=(len(SEQS), 2))),
                      "none": None, "long": list(rng.integers(0, VOCAB, size=(len(SEQS), 5))),
                      "some": [nxt[0], None, np.empty(0, np.int64)]}[kind]
            step = pf.begin_step(SEQS, tokens[:, t], drafts=drafts)
            if kind in ("right", "long"):
                pf.wait_drafts(timeout=30)  # a fetched draft, then the next step (hits or not)
            for pos, layer in enumerate(CONFIG.layer_ids):
                assert torch.equal(pf.rows(layer, step), _expected(plain, hasher, tokens, t, pos))
            pf.end_step(step)


@contextmanager
def _after_prefill(table, seed: int):
    """Tokens of the sequences, the hasher, a cached ``direct`` store, a plain ``mmap`` one and
    a Prefetcher whose sequences have prefilled their first 3 tokens."""
    tokens = np.random.default_rng(seed).integers(0, VOCAB, size=(len(SEQS), 8))
    hasher = _hasher()
    with open_table(table, "direct", cache_bytes=CONFIG.num_rows * CONFIG.row_bytes) as store, \
            open_table(table, "mmap") as plain, Prefetcher(store, hasher) as pf:
        pf.end_step(pf.begin_step(SEQS, [tokens[i, :3] for i in range(len(SEQS))]))
        yield tokens, hasher, store, plain, pf


def test_right_drafts_make_the_next_steps_rows_hits(table):
    with _after_prefill(table, 1) as (tokens, hasher, store, plain, pf):
        for t in range(3, 7):  # steps 3 and 5 draft the true next token; 4 and 6 are measured
            before = _tier_rows(store)
            drafts = list(tokens[:, t + 1: t + 2]) if t % 2 else None
            step = pf.begin_step(SEQS, tokens[:, t], drafts=drafts)
            for pos, layer in enumerate(CONFIG.layer_ids):
                assert torch.equal(pf.rows(layer, step), _expected(plain, hasher, tokens, t, pos))
            pf.end_step(step)
            if drafts is None:
                assert _tier_rows(store) == before  # every row of the drafted step was already fetched
            assert pf.wait_drafts(timeout=30)
        s = pf.draft_stats()
        assert s["draft_steps"] == 2 and s["next_steps"] == 2
        assert s["share_fetched"] == 1.0 and s["draft_rows_unused"] == 0 and s["unused_per_fetched"] == 0


def test_wrong_drafts_cost_reads_and_no_hits(table):
    with _after_prefill(table, 2) as (tokens, hasher, store, plain, pf):
        before = _tier_rows(store)
        pf.end_step(pf.begin_step(SEQS, tokens[:, 3], drafts=[[999], [998], [997]]))  # tokens not in the sequences
        assert pf.wait_drafts(timeout=30)
        step = pf.begin_step(SEQS, tokens[:, 4])
        for pos, layer in enumerate(CONFIG.layer_ids):
            assert torch.equal(pf.rows(layer, step), _expected(plain, hasher, tokens, 4, pos))
        pf.end_step(step)
        s = pf.draft_stats()
        assert s["next_rows_fetched"] < s["next_rows"] and s["draft_rows_unused"] > 0
        assert _tier_rows(store) - before >= s["draft_rows_unused"]  # the wrong drafts' rows were read


def test_drafts_are_given_one_per_sequence(table):
    with open_table(table, "mmap") as store, Prefetcher(store, _hasher()) as pf:
        with pytest.raises(ValueError, match="2 drafts for 3 sequences"):
            pf.begin_step(SEQS, np.array([1, 2, 3]), drafts=[[1], [2]])
        assert pf.draft_stats()["draft_steps"] == 0 and pf.wait_drafts(0)


def test_drafts_are_fetched_before_windows_fetched_further_ahead(table):
    """The general worker is held in the first part of a window fetched ahead; a second
    window and a decode step with drafts are queued; let go, it reads the drafts first."""
    import threading

    tokens = np.random.default_rng(3).integers(0, VOCAB, size=(4, 6))
    hasher = _hasher()
    with open_table(table, "mmap") as store, Prefetcher(store, hasher, split_min_rows=1) as pf:
        gate, entered = threading.Event(), threading.Event()
        read = store.tier.read_rows
        calls: list[np.ndarray] = []
        lock = threading.Lock()

        def recording(ids, out):
            with lock:
                first = not calls
                calls.append(ids.copy())
            if first:
                entered.set()
                assert gate.wait(10)
            return read(ids, out)

        store.tier.read_rows = recording
        ahead = pf.begin_step([1], [tokens[0]], urgent=False)  # the general worker blocks in its part 0
        assert entered.wait(10)
        later = pf.begin_step([4], [tokens[3]], urgent=False)
        now = pf.begin_step([2, 3], tokens[1:3, 0], drafts=[[5], [6]])  # served by the urgent-only worker
        draft = pf._drafts.last
        assert draft is not None and now.wait_done(10)
        gate.set()
        assert pf.wait_drafts(10) and ahead.wait_done(10) and later.wait_done(10)

        order = [part_owner(c, {"ahead": ahead, "later": later, "now": now, "draft": draft})[0] for c in calls]
        assert order[0] == "ahead" and order.count("draft") == 1
        rest = [o for o in order[1:] if o != "now"]
        assert rest == ["draft", "ahead", "later", "later"]
        for step in (now, ahead, later):
            pf.end_step(step)
