"""Gate-aware caching and the (off by default) read-skip predictor, on the trained model's reads."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.cache.gate_policy import GATE_UNITS, GateLFUPolicy
from engram_offload.cache.policy import LFUPolicy, LRUPolicy
from engram_offload.model.cache_sim import compare_policies, simulate
from engram_offload.model.lm import ProbedEngramLayer
from engram_offload.model.skip import skip_eval


def test_gate_policy_evicts_the_least_gate_mass():
    p = GateLFUPolicy(4)
    p.insert(np.arange(4))
    p.credit(np.arange(4), np.array([0.9, 0.1, 0.5, 0.2]))
    p.touch(np.array([1]))  # a hit alone is worth nothing until its gate is credited
    assert set(p.victims(2, np.ones(4, bool)).tolist()) == {1, 3}
    p.credit(np.array([1]), np.array([1.0]))
    assert p.count[1] == round(0.1 * GATE_UNITS) + GATE_UNITS
    assert set(p.victims(1, np.ones(4, bool)).tolist()) == {3}


def test_simulate_counts_hits_and_gate_share():
    ids = np.array([1, 2, 1, 2, 3, 1], np.int64)
    gates = np.array([0.5, 0.1, 0.5, 0.1, 0.9, 0.5], np.float32)
    result = simulate(ids, gates, 10, LRUPolicy(2), step_reads=2)
    # steps: {1,2} miss; {1,2} hit; {3,1}: 3 misses (evicts 2), 1 hits
    assert result["hit_rate"] == pytest.approx(3 / 6)
    assert result["gate_share"] == pytest.approx((0.5 + 0.1 + 0.5) / gates.sum())


class _Recorded(GateLFUPolicy):
    """A gate policy that logs every call the simulation makes (slots as lists)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.calls: list[tuple] = []

    def touch(self, slots):
        self.calls.append(("touch", slots.tolist()))
        super().touch(slots)

    def insert(self, slots, frequency=None):
        self.calls.append(("insert", slots.tolist()))
        super().insert(slots, frequency)

    def remove(self, slots):
        self.calls.append(("remove", slots.tolist()))
        super().remove(slots)

    def victims(self, count, evictable):
        got = super().victims(count, evictable)
        self.calls.append(("victims", count, evictable.tolist(), got.tolist()))
        return got

    def credit(self, slots, gate_mass):
        self.calls.append(("credit", slots.tolist(), np.round(gate_mass, 6).tolist()))
        super().credit(slots, gate_mass)


def test_simulate_drives_the_policy_as_the_row_cache_does():
    """Steps of 3 reads into 2 slots: each step's distinct rows looked up once, a hit's slot never
    a victim in its step, more misses than slots fill what fits, the mean gate credited per slot."""
    ids = np.array([5, 5, 7, 7, 9, 9, 11, 12, 13, 12], np.int64)
    gates = np.array([0.2, 0.4, 0.6, 0.5, 0.1, 0.3, 0.7, 0.8, 0.9, 0.25], np.float32)
    policy = _Recorded(2)
    result = simulate(ids, gates, 20, policy, step_reads=3)
    assert policy.calls == [
        ("insert", [0, 1]), ("credit", [0, 1], [0.3, 0.6]),  # 5 and 7 miss; 5's two reads: mean gate
        ("touch", [1]),  # 7 hits
        ("victims", 1, [True, False], [0]), ("remove", [0]),  # 9 misses: 5 goes, 7 (hit) may not
        ("insert", [0]), ("credit", [0], [0.2]), ("credit", [1], [0.5]),
        ("victims", 2, [True, True], [0, 1]), ("remove", [0, 1]),  # three misses, two slots
        ("insert", [1, 0]), ("credit", [1, 0], [0.7, 0.8]),
        ("touch", [0]), ("credit", [0], [0.25]),  # the short last step: 12 hits
    ]
    assert result["hit_rate"] == pytest.approx(2 / 10)
    assert result["gate_share"] == pytest.approx((0.5 + 0.25) / float(gates.sum()), rel=1e-6)


def test_simulate_evicts_only_filled_slots_and_forgets_an_evicted_row():
    """Three slots, one still free when two rows miss: one victim among the two filled slots (the
    free one is no victim); the evicted row read again is a miss."""
    ids = np.array([0, 2, 3, 4, 0, 0], np.int64)  # row 0 is a row like any other
    gates = np.array([0.1, 0.9, 0.8, 0.7, 0.2, 0.4], np.float32)
    policy = _Recorded(3)
    result = simulate(ids, gates, 8, policy, step_reads=2)
    assert policy.calls == [
        ("insert", [0, 1]), ("credit", [0, 1], [0.1, 0.9]),
        ("victims", 1, [True, True, False], [0]), ("remove", [0]),  # row 0 (least gate) goes
        ("insert", [0, 2]), ("credit", [0, 2], [0.8, 0.7]),
        ("victims", 1, [True, True, True], [2]), ("remove", [2]),  # row 0 again: a miss
        ("insert", [2]), ("credit", [2], [0.3]),
    ]
    assert result == {"hit_rate": 0.0, "gate_share": 0.0}


def test_simulate_of_no_reads_or_no_gate_is_zero():
    assert simulate(np.zeros(0, np.int64), np.zeros(0, np.float32), 4, LRUPolicy(2), 3) == \
        {"hit_rate": 0.0, "gate_share": 0.0}
    ids = np.array([1, 1, 1, 2], np.int64)
    assert simulate(ids, np.zeros(4, np.float32), 4, LRUPolicy(1), 2) == {"hit_rate": 0.25, "gate_share": 0.0}


def test_compare_policies_sizes_each_cache_as_a_share_of_the_table():
    ids = np.array([1, 2, 1, 2, 3, 1], np.int64)
    gates = np.array([0.5, 0.1, 0.5, 0.1, 0.9, 0.5], np.float32)
    rows = compare_policies(ids, gates, 10, 2, {"lru": LRUPolicy, "gate": GateLFUPolicy}, fractions=(0.01, 0.36))
    assert [(r["fraction"], r["capacity_rows"], r["policy"]) for r in rows] == [
        (0.01, 1, "lru"), (0.01, 1, "gate"), (0.36, 4, "lru"), (0.36, 4, "gate")]  # at least one row; 3.6 rounds up
    assert rows[1] == {"fraction": 0.01, "capacity_rows": 1, "policy": "gate",
                       **simulate(ids, gates, 10, GateLFUPolicy(1), 2)}
    assert [r["fraction"] for r in compare_policies(ids, gates, 10, 2, {"lru": LRUPolicy})] == [0.01, 0.05, 0.10, 0.20]


def test_an_unbounded_cache_hits_every_repeat(model, held_out_pieces):
    from engram_offload.model.scan import scan

    s = scan(model, held_out_pieces[:6])
    rows = compare_policies(s.trace_ids, s.trace_gates, model.config.num_rows, 64,
                            {"lru": LRUPolicy, "lfu": LFUPolicy, "gate": GateLFUPolicy}, fractions=(1.0,))
    distinct = np.unique(s.trace_ids).size
    for r in rows:
        # every read after a row's first step is a hit (first reads within a step all miss)
        assert r["hit_rate"] <= 1 - distinct / s.trace_ids.size + 1e-12
        assert r["hit_rate"] == rows[0]["hit_rate"]


def test_skip_is_off_by_default_and_saves_reads_when_asked(model, held_out_pieces):
    assert ProbedEngramLayer.gate_scale is None
    pieces = held_out_pieces[:24]
    base = skip_eval(model, pieces, 0.0, batch=4)
    everything = skip_eval(model, pieces, 2.0, batch=4)  # every gate is below 2: skip each position seen before
    assert base["reads_saved"] == 0
    assert 0 < everything["reads_saved"] < 1
    assert everything["perplexity"] != base["perplexity"]
    random = skip_eval(model, pieces, 0.0, batch=4, random_rate=0.5)
    assert 0.4 < random["reads_saved"] < 0.6 and random["perplexity"] > base["perplexity"]
    assert all(e.gate_scale is None for e in model.engram_layers().values())


def test_cache_sim_command_writes_the_json_it_prints(tmp_path, capsys):
    import json

    from engram_offload.cli import main

    out = tmp_path / "sim.json"
    assert main(["cache-sim", "--max-tokens", "1500", "--json-out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    assert printed["reads"] > 0 and {r["policy"] for r in printed["results"]} == {"lru", "lfu-aging", "gate-lfu"}
    assert not list(tmp_path.glob("*.tmp"))  # written atomically: no temporary left behind


def test_skip_eval_reports_its_point_and_reads_rows_through_rows_for(model, held_out_pieces):
    from engram_offload.model.checkpoint_io import load_model, shipped_model_dir
    from engram_offload.model.evaluate import evaluate

    pieces = held_out_pieces[:20]
    full = evaluate(model, pieces)
    point = skip_eval(model, pieces, 0.0)
    assert point == {"threshold": 0.0, "random_rate": None, "reads_saved": 0.0, "perplexity": full.perplexity,
                     "nll": full.nll, "tokens": full.tokens}
    assert skip_eval(model, pieces, 2.0) == skip_eval(model, pieces, 2.0, batch=16)  # 16 windows a batch
    assert skip_eval(model, pieces, 2.0)["reads_saved"] != skip_eval(model, pieces, 2.0, batch=17)["reads_saved"]
    random = skip_eval(model, pieces, 0.0, random_rate=0.3)
    assert random == skip_eval(model, pieces, 0.0, random_rate=0.3, seed=0) != skip_eval(model, pieces, 0.0,
                                                                                          random_rate=0.3, seed=1)
    assert random["random_rate"] == 0.3
    bare = load_model(shipped_model_dir(), table=False)  # every row from rows_for
    layers = model.engram_layers()
    assert skip_eval(bare, pieces, 0.5, lambda layer, ids: layers[layer].lookup(ids), batch=4) == \
        skip_eval(model, pieces, 0.5, batch=4)


def test_skip_curve_starts_with_every_read_and_matches_each_point_with_random_skips(model, held_out_pieces):
    from engram_offload.model.skip import skip_curve

    pieces = held_out_pieces[:40]  # three batches: the later ones skip what the first read
    curve, baseline = skip_curve(model, pieces, [0.0001, 2.0])
    assert [p["threshold"] for p in curve] == [0.0, 0.0001, 2.0]
    assert curve[0] == skip_eval(model, pieces, 0.0) and curve[2] == skip_eval(model, pieces, 2.0)
    saved = [p["reads_saved"] for p in curve[1:] if p["reads_saved"] > 0]
    assert saved and [b["random_rate"] for b in baseline] == saved
    assert baseline[-1] == skip_eval(model, pieces, 0.0, random_rate=saved[-1])
    # a model without its table: the curve and its baseline read every row through rows_for
    from engram_offload.model.checkpoint_io import load_model, shipped_model_dir

    bare, layers = load_model(shipped_model_dir(), table=False), model.engram_layers()
    bare_curve, bare_baseline = skip_curve(bare, pieces, [2.0], lambda layer, ids: layers[layer].lookup(ids))
    assert bare_curve == [curve[0], curve[2]] and bare_baseline == [baseline[-1]]
