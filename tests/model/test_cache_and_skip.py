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
