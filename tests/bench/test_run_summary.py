"""``summarize_run`` on runs whose users' rates are known: the headline figures are the right percentiles."""

from __future__ import annotations

import numpy as np
import pytest

from engram_offload.bench.engine import EngineRun
from engram_offload.bench.metrics import summarize_run
from engram_offload.bench.workload import Request


def user(number: int, tokens_per_second: float, tokens: int = 5) -> Request:
    """A finished request that decoded ``tokens`` tokens at a steady rate."""
    r = Request(number, np.zeros(8, np.int64), [(4, 8)])
    r.itl = [1.0 / tokens_per_second] * tokens
    return r


def test_p90_interactivity_is_what_the_slowest_tenth_of_users_get():
    rates = [float(x) for x in range(10, 110, 10)] + [1000.0]  # 11 users: 10..100 tok/s, and one outlier
    run = EngineRun(seconds=2.0, steps=4, tokens=8, decode_tokens=8, requests=[user(i, r) for i, r in enumerate(rates)])
    figures = summarize_run(run)
    assert figures["users_measured"] == 11
    assert figures["p90_interactivity_tok_s_per_user"] == pytest.approx(np.percentile(rates, 10)) == pytest.approx(20.0)
    assert figures["interactivity_tok_s_per_user"] == pytest.approx(60.0)
    assert figures["throughput_tok_s"] == pytest.approx(4.0)
