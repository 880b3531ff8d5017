"""Hit-rate curves over every cache size up to the whole table: measured, then extrapolated (and said so)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from engram_offload.planner import DEFAULT_ASSUMPTIONS, get_gpu, get_model
from engram_offload.planner.mrc import ExtrapolatedMRC, mrc_from_trace, ramp_to_whole_table
from engram_offload.planner.placement import host_core_share
from engram_offload.planner.realtext import REAL_TEXT_DISTINCT, REAL_TEXT_FIRST_TOUCH, RealTextMRC

V41 = get_model("deepseek-v4.1-flash").engram
RPT = V41.rows_per_token


def test_real_text_covers_every_cache_size_without_a_cliff():
    curve, flat = RealTextMRC(RPT, V41.num_rows), RealTextMRC(RPT)
    touched = REAL_TEXT_DISTINCT * RPT
    assert curve.measured_rows == touched
    sizes = np.geomspace(1, V41.num_rows, 400)
    hits = [curve.hit_ratio(x) for x in sizes]
    assert hits == sorted(hits) and hits[-1] == 1.0
    assert max(np.diff(hits)) < 0.03  # no jump anywhere (the old curve jumped 0.65 -> 1.0 at the whole table)
    for x in (1e3, 1e6, 0.5 * touched, touched):  # the measured part is the flat curve's
        assert curve.hit_ratio(x) == flat.hit_ratio(x) and not curve.extrapolated(x)
    assert flat.hit_ratio(touched) == pytest.approx(1 - REAL_TEXT_FIRST_TOUCH)
    half = touched + (V41.num_rows - touched) / 2
    assert curve.extrapolated(half)
    assert curve.hit_ratio(half) == pytest.approx(1 - REAL_TEXT_FIRST_TOUCH / 2)
    for h in (0.5, 0.77, 0.8, 0.9, 0.99, 1.0):
        rows = curve.rows_for_hit_rate(h)
        assert rows is not None and rows <= V41.num_rows
        assert curve.hit_ratio(rows) >= h - 1e-9 and (rows <= 1 or curve.hit_ratio(rows * 0.999) < h)
    assert flat.rows_for_hit_rate(0.9) is None


def test_a_small_table_ramps_from_half_of_it():
    rows = 1_000_000  # fewer rows than the trace touched
    curve = RealTextMRC(RPT, rows)
    assert curve.measured_rows == rows / 2
    assert curve.hit_ratio(rows / 2) == RealTextMRC(RPT).hit_ratio(rows / 2)
    assert curve.hit_ratio(0.75 * rows) == pytest.approx((curve.hit_ratio(rows / 2) + 1) / 2)


def test_a_traces_curve_is_extrapolated_above_the_rows_it_touched():
    rng = np.random.default_rng(3)
    ids = rng.zipf(1.3, 50_000) % 20_000
    base = mrc_from_trace(ids)
    curve = ExtrapolatedMRC(base, base.distinct_ids, 100_000)
    top = base.hit_ratio(math.inf)  # every access but the first of each row
    for rows in (10, 100, 1000, base.distinct_ids):
        assert curve.hit_ratio(rows) == base.hit_ratio(rows)
    assert curve.hit_ratio(100_000) == 1.0
    mid = (base.distinct_ids + 100_000) / 2
    assert curve.hit_ratio(mid) == pytest.approx(ramp_to_whole_table(top, base.distinct_ids, 100_000, mid))
    assert curve.hit_ratio(mid) == pytest.approx((top + 1) / 2)
    for h in (0.2, top, (top + 1) / 2, 0.99, 1.0):
        rows = curve.rows_for_hit_rate(h)
        assert rows is not None and curve.hit_ratio(rows) >= h - 1e-9 > curve.hit_ratio(rows - 2) - 1e-9
    with pytest.raises(ValueError, match="measured_rows"):
        ExtrapolatedMRC(base, 200_000, 100_000)


def test_host_cores_shared_by_the_fetch_threads():
    b300 = get_gpu("b300")  # 128 cores, 8 GPUs x (hashing + one worker)
    assert host_core_share(b300, DEFAULT_ASSUMPTIONS) == 1.0
    assert host_core_share(replace(b300, host_cores=8), DEFAULT_ASSUMPTIONS) == 0.5
    assert host_core_share(replace(b300, host_cores=8), replace(DEFAULT_ASSUMPTIONS, host_fetch_cores=3)) == 0.25
