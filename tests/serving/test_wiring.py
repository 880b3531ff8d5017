"""benchmarks/wiring.py's forward_with_prefetch: the same output as synchronous gathers; pins
released; errors surface."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engram_offload import open_table, write_table
from engram_offload.bench.backbone import EngramBackbone
from engram_offload.engram.config import EngramConfig
from engram_offload.engram.hashing import NgramHasher
from engram_offload.errors import TierError
from engram_offload.serving.prefetch import Prefetcher, PrefetchError

VOCAB = 500
_spec = importlib.util.spec_from_file_location("wiring", Path(__file__).resolve().parents[2] / "benchmarks" / "wiring.py")
wiring = sys.modules["wiring"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wiring)
forward_with_prefetch, forward_with_store = wiring.forward_with_prefetch, wiring.forward_with_store


@pytest.fixture(scope="module", params=["v4.1", "demo"])
def setup(request, tmp_path_factory):
    fmt = "fp8_e4m3_ue8m0" if request.param == "v4.1" else "fp32"
    config = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=32, prime_starts=(300, 500),
                          row_format=fmt, hidden_size=64, hc_mult=2, variant=request.param)
    path = write_table(tmp_path_factory.mktemp("wiring") / "t.tbl", config, torch.randn(config.num_rows, 32))
    torch.manual_seed(0)
    model = EngramBackbone(config, num_layers=4, vocab_size=VOCAB, heads=4).eval()
    hasher = NgramHasher(config, np.arange(VOCAB, dtype=np.int64) % 400)
    return path, model, hasher


def test_prefetched_forward_equals_synchronous_forward(setup):
    path, model, hasher = setup
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, VOCAB, size=(2, 6)))
    with open_table(path, "mmap") as plain, open_table(path, "direct", cache_bytes=1 << 16) as store, \
            Prefetcher(store, hasher) as pf, torch.no_grad():
        want = forward_with_store(model, plain, hasher, tokens)
        got = forward_with_prefetch(model, pf, [0, 1], [tokens[0], tokens[1]])
        assert torch.allclose(got.output, want, atol=1e-5)
        assert got.step.done() and got.step.error is None
        assert all(level.pinned() == 0 for level in store.levels)
        assert store.stats()["store"]["rows_requested"] == got.step.dedup.requested


def test_the_stall_is_the_wait_for_late_rows_and_nothing_else(setup):
    path, model, hasher = setup
    with open_table(path, "mmap") as store, Prefetcher(store, hasher) as pf, torch.no_grad():
        read, asked = store.tier.read_rows, threading.Event()

        def late(ids, out):  # the rows come 0.2 s after the first Engram layer asks for them
            asked.wait(10)
            time.sleep(0.2)
            return read(ids, out)

        waits = []  # how long each Engram layer's rows_for call took, as the model saw it

        def asking_model(input_ids, rows_for):
            def rows(layer_id):
                t0 = time.perf_counter()
                asked.set()
                got = rows_for(layer_id)
                waits.append(time.perf_counter() - t0)
                return got
            return model(input_ids, rows)

        store.tier.read_rows = late
        got = forward_with_prefetch(asking_model, pf, [0], [[1, 2, 3]])
        # a small step is one part: the first Engram layer waits for all of it, the second not at all
        assert got.step.stalls == 1
        assert 0.2 <= got.stall_seconds <= waits[0]  # within the first layer's own wait
        assert got.stall_seconds >= 0.9 * sum(waits)  # and nearly all of the model's waiting
        ready = pf.begin_step([1], [[4, 5, 6]])
        assert ready.wait_done(5)
        for layer in hasher.config.layer_ids:
            pf.rows(layer, ready)
        assert ready.stall_seconds == 0.0 and ready.stalls == 0  # rows already there: no stall
        pf.end_step(ready)
        assert pf.stats()["stall_seconds"] == got.stall_seconds


def test_a_failed_fetch_fails_the_forward_pass(setup):
    path, model, hasher = setup
    with open_table(path, "mmap", cache_bytes=1 << 16) as store, Prefetcher(store, hasher) as pf, torch.no_grad():
        def broken(ids, out):
            raise TierError("no such device")

        store.tier.read_rows = broken
        with pytest.raises(PrefetchError, match="no such device"):
            forward_with_prefetch(model, pf, [0], [[1, 2, 3]])
        assert pf.stats()["open_steps"] == 0


def test_ragged_pieces_are_refused(setup):
    path, model, hasher = setup
    with open_table(path, "mmap") as store, Prefetcher(store, hasher) as pf:
        with pytest.raises(ValueError, match="one length"):
            forward_with_prefetch(model, pf, [0, 1], [[1, 2], [3]])
