"""The serving loop hands every Engram layer exactly the rows of the tokens it computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table
from engram_offload.bench.backbone import EngramBackbone
from engram_offload.bench.corpus import Corpus
from engram_offload.bench.engine import ServingEngine, StepShape
from engram_offload.bench.metrics import summarize_run
from engram_offload.bench.workload import RequestStream, WorkloadShape
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.hashing import NgramHasher
from engram_offload.errors import TierError
from engram_offload.serving.prefetch import Prefetcher, PrefetchError

VOCAB = 500


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    config = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=(300, 500),
                          row_format="fp8_e4m3_ue8m0", hidden_size=32, hc_mult=2)
    path = write_table(tmp_path_factory.mktemp("engine") / "t.tbl", config, torch.randn(config.num_rows, 32))
    hasher = NgramHasher(config, np.arange(VOCAB, dtype=np.int64) % 400)
    return path, config, hasher


def corpus(seed=0) -> Corpus:
    rng = np.random.default_rng(seed)
    return Corpus("random", tuple(rng.integers(0, VOCAB, size=n) for n in (300, 200, 500, 250)), "test")


class RecordingEngine(ServingEngine):
    """Records (request tokens, position, piece length) of every scheduled piece."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []

    def _schedule(self, active):
        chosen, pieces = super()._schedule(active)
        self.log.append([(r.tokens, r.fed, p.size) for r, p in zip(chosen, pieces)])
        return chosen, pieces


class RowsModel:
    """A ``StepModel`` that asks for each Engram layer's rows and keeps them."""

    def __init__(self, layers):
        self.layers = layers
        self.seen = []

    def run_step(self, shape, rows_for):
        self.seen.append({layer: rows_for(layer).clone() for layer in self.layers})


def expected_rows(store, hasher, log_entry, layer_index):
    parts = []
    for tokens, fed, n in log_entry:
        ids = hasher.table_ids(hasher.hash_all(torch.from_numpy(tokens).view(1, -1)))[0]  # [T, L, C]
        parts.append(store.gather(ids[fed:fed + n, layer_index]))  # [n, C, d]
    return torch.cat(parts)


@pytest.mark.parametrize("lookahead", [None, 0, 7])
@pytest.mark.parametrize("tier,cache", [("memory", 0), ("direct", 4096)])
def test_every_step_gets_the_rows_of_its_tokens(table, lookahead, tier, cache):
    path, config, hasher = table
    shape = WorkloadShape("agent", prompt=40, answer=6, turns=2, tool=20)
    with open_table(path, "mmap") as plain, open_table(path, tier, cache_bytes=cache) as store, \
            Prefetcher(store, hasher) as pf:
        model = RowsModel(config.layer_ids)
        engine = RecordingEngine(model, pf, concurrency=3, max_step_tokens=16, lookahead_tokens=lookahead,
                                 window_tokens=5)
        run = engine.run(RequestStream(corpus(), shape, seed=2), seconds=60, max_steps=100)
        assert run.steps == 100 and len(model.seen) == 100
        assert run.prefill_tokens > 0 and run.decode_tokens > 0 and run.finished >= 1
        for entry, seen in zip(engine.log, model.seen):
            assert sum(n for _, _, n in entry) <= 16
            for li, layer in enumerate(config.layer_ids):
                want = expected_rows(plain, hasher, entry, li)
                assert torch.equal(seen[layer].reshape(want.shape), want)
        if cache:
            assert all(level.pinned() == 0 for level in store.levels)  # windows and steps released
        fetched = run.step_fetched_prefill  # prefill tokens each step began to fetch
        assert len(fetched) == run.steps
        if lookahead == 0:  # nothing ahead: each step fetches its own prefill
            assert fetched == [p for _, p, _ in run.step_tokens]
        else:  # every prefill token computed was fetched by its step or one before
            assert sum(fetched) >= run.prefill_tokens and fetched[0] >= run.step_tokens[0][1]


@pytest.mark.parametrize("lookahead", [None, 0])
def test_a_turn_after_a_short_answer_hashes_from_where_the_answer_ended(table, lookahead):
    """A short answer (one decode step): the next turn's input follows it, and its rows are those of the
    whole sequence's n-grams (the answer is not fed to the sequence's history twice)."""
    path, config, hasher = table
    shape = WorkloadShape("agent", prompt=12, answer=2, turns=3, tool=9)
    with open_table(path, "mmap") as plain, open_table(path, "memory") as store, Prefetcher(store, hasher) as pf:
        model = RowsModel(config.layer_ids)
        engine = RecordingEngine(model, pf, concurrency=2, max_step_tokens=8, lookahead_tokens=lookahead,
                                 window_tokens=4)
        run = engine.run(RequestStream(corpus(), shape, seed=5), seconds=60, max_steps=40)
        assert run.finished >= 1
        for entry, seen in zip(engine.log, model.seen):
            for li, layer in enumerate(config.layer_ids):
                want = expected_rows(plain, hasher, entry, li)
                assert torch.equal(seen[layer].reshape(want.shape), want)
        assert sum(run.step_fetched_prefill) <= run.prefill_tokens + engine.lookahead_tokens


class RecordingModeled:
    """The modeled backbone, keeping the rows it is handed at each Engram layer."""

    def __init__(self, modeled):
        self.modeled = modeled
        self.seen = []

    def run_step(self, shape, rows_for):
        got = {}

        def recording(layer):
            got[layer] = rows_for(layer).clone()
            return got[layer]

        self.modeled.run_step(shape, recording)
        self.seen.append(got)


@pytest.mark.parametrize("tier,cache", [("memory", 0), ("direct", 4096)])
def test_the_modeled_backbone_gets_the_rows_of_every_steps_tokens(table, tier, cache):
    from dataclasses import replace

    from engram_offload.bench.modeled import ModeledBackbone
    from engram_offload.planner import get_gpu, get_model

    path, config, hasher = table
    spec = replace(get_model("deepseek-v4.1-flash"), engram=config)
    shape = WorkloadShape("agent", prompt=40, answer=6, turns=2, tool=20)
    with open_table(path, "mmap") as plain, open_table(path, tier, cache_bytes=cache) as store, \
            Prefetcher(store, hasher) as pf:
        model = RecordingModeled(ModeledBackbone(spec, get_gpu("b300"), 8, config.layer_ids))
        engine = RecordingEngine(model, pf, concurrency=3, max_step_tokens=16, window_tokens=5)
        run = engine.run(RequestStream(corpus(), shape, seed=2), seconds=60, max_steps=60)
        assert run.steps == 60 and len(model.seen) == 60 and len(run.step_tokens) == 60
        for entry, seen, (decode, prefill, _) in zip(engine.log, model.seen, run.step_tokens):
            assert decode + prefill == sum(n for _, _, n in entry)
            assert list(seen) == list(config.layer_ids)
            for li, layer in enumerate(config.layer_ids):
                want = expected_rows(plain, hasher, entry, li)
                assert torch.equal(seen[layer].reshape(want.shape), want)
        assert sum(run.step_seconds) >= sum(sum(model.modeled.segments_us(
            StepShape((), d, p, kv))) for d, p, kv in run.step_tokens) * 1e-6


def test_a_real_backbone_runs_and_figures_add_up(table):
    path, config, hasher = table
    torch.manual_seed(0)
    model = EngramBackbone(config, num_layers=4, vocab_size=VOCAB, heads=4).eval()
    with open_table(path, "memory") as store, Prefetcher(store, hasher) as pf:
        engine = ServingEngine(model, pf, concurrency=2, max_step_tokens=32)
        run = engine.run(RequestStream(corpus(1), WorkloadShape("chat", prompt=30, answer=5)), seconds=60, max_steps=30)
    f = summarize_run(run)
    assert f["tokens"] == f["prefill_tokens"] + f["decode_tokens"] == run.tokens
    assert f["prefill_tokens_fetched"] == sum(run.step_fetched_prefill) >= f["prefill_tokens"]
    assert f["requests_finished"] >= 2 and f["output_tokens"] >= 5 * f["requests_finished"]
    assert f["throughput_tok_s"] > 0 and 0 <= f["stall_fraction"] < 1
    assert f["interactivity_tok_s_per_user"] > 0 and f["p90_itl_ms"] >= f["p50_itl_ms"] > 0
    assert f["rows_per_token"] == len(config.layer_ids) * config.cols_per_layer


def test_a_failed_fetch_stops_the_run_with_its_cause(table):
    path, config, hasher = table
    with open_table(path, "mmap") as store, Prefetcher(store, hasher) as pf:
        def broken(ids, out):
            raise TierError("the disk went away")

        store.tier.read_rows = broken
        engine = ServingEngine(RowsModel(config.layer_ids), pf, concurrency=2, max_step_tokens=8)
        with pytest.raises(PrefetchError, match="disk went away"):
            engine.run(RequestStream(corpus(), WorkloadShape("chat", prompt=10, answer=4)), seconds=60, max_steps=5)


def test_concurrency_must_fit_the_step_budget(table):
    path, config, hasher = table
    with open_table(path, "memory") as store, Prefetcher(store, hasher) as pf:
        with pytest.raises(ValueError, match="max_step_tokens"):
            ServingEngine(None, pf, concurrency=8, max_step_tokens=4)


def test_a_turn_waits_for_its_rows_while_others_decode(table):
    """A prefill whose rows are still being fetched is left out of the step while others
    decode; once its window is in, it runs as far as the fetched rows go; alone, it runs at once."""
    from engram_offload.bench.engine import Window
    from engram_offload.bench.workload import Request

    class PendingStep:
        def __init__(self):
            self.ready = False

        def done(self):
            return self.ready

    path, config, hasher = table
    with open_table(path, "memory") as store, Prefetcher(store, hasher) as pf:
        engine = ServingEngine(None, pf, concurrency=2, max_step_tokens=16, window_tokens=4)
        decoding = Request(1, np.arange(40), [(10, 40)], fed=12)
        waiting = Request(2, np.arange(40), [(20, 40)])
        pending = PendingStep()
        engine._windows[2] = [Window(0, 4, pending)]
        engine._hashed[2] = 4
        chosen, pieces = engine._schedule([decoding, waiting])
        assert [r.number for r in chosen] == [1] and pieces[0].tolist() == [12]
        pending.ready = True
        chosen, pieces = engine._schedule([decoding, waiting])
        assert [r.number for r in chosen] == [1, 2] and pieces[1].tolist() == [0, 1, 2, 3]
        pending.ready = False
        chosen, pieces = engine._schedule([waiting])
        assert [r.number for r in chosen] == [2] and pieces[0].size == 16


def test_repeats_combine_into_medians():
    from engram_offload.bench.sweep import combine_repeats

    runs = [{"tier": "direct", "concurrency": 8, "throughput_tok_s": t, "hit_rate": h, "p90_itl_ms": 5.0, "budget_enforced": True,
             "output_tok_s": 1, "interactivity_tok_s_per_user": None, "stall_fraction": 0.1}
            for t, h in ((10.0, 0.5), (30.0, 0.7), (20.0, 0.6))]
    one = combine_repeats(runs)
    assert one["throughput_tok_s"] == 20.0 and one["hit_rate"] == 0.6 and one["repeats"] == 3
    assert one["concurrency"] == 8 and isinstance(one["concurrency"], int)
    assert one["budget_enforced"] is True and one["interactivity_tok_s_per_user"] is None
    assert one["per_repeat"]["throughput_tok_s"] == [10.0, 30.0, 20.0]
    assert combine_repeats(runs[:1])["repeats"] == 1
