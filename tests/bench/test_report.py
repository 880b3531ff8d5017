"""Benchmark outputs: the frontier plot, the comparison of tiers."""

from __future__ import annotations

import pytest

from engram_offload.bench.report import (
    MIN_STEPS,
    MIN_USERS,
    comparisons,
    enough_samples,
    frontier_plot,
    markdown_table,
    thin_points,
)


def run(tier, state, c, tput, itl, inter):
    return {"tier": tier, "cache_state": state, "concurrency": c, "throughput_tok_s": tput, "p90_itl_ms": itl,
            "interactivity_tok_s_per_user": inter, "hit_rate": None, "budget_enforced": tier != "memory"}


RUNS = [run("memory", "warm", 8, 100.0, 10.0, 50.0), run("direct", "warm", 8, 90.0, 12.0, 45.0),
        run("mmap", "warm", 8, 45.0, 20.0, 30.0), run("memory", "warm", 32, 200.0, 20.0, 20.0)]


def test_comparisons_pair_runs_at_equal_state_and_concurrency():
    got = {(c["tier"], c["vs"]): c for c in comparisons(RUNS)}
    assert got[("direct", "memory")]["throughput_ratio"] == pytest.approx(0.9)
    assert got[("direct", "memory")]["p90_itl_ratio"] == pytest.approx(1.2)
    assert got[("direct", "mmap")]["throughput_ratio"] == pytest.approx(2.0)
    assert ("mmap", "mmap") not in got and len(got) == 3  # memory x32 has no partner
    table = markdown_table(RUNS)
    assert table.count("\n") == len(RUNS) + 1 and "| direct | warm | 8 |" in table


def test_the_frontier_is_a_png(tmp_path):
    path = frontier_plot(RUNS, tmp_path / "f.png")
    assert path.read_bytes()[:4] == b"\x89PNG" and [p.name for p in tmp_path.iterdir()] == ["f.png"]


def test_the_stall_limit_is_the_largest_concurrency_under_it_with_all_below_under_it_too():
    from engram_offload.bench.report import stall_limits, stall_limits_table

    def point(tier, c, stall):
        return {"tier": tier, "cache_state": "cold", "concurrency": c, "stall_fraction": stall}

    runs = [point("memory", 128, 0.02), point("memory", 8, 0.01), point("memory", 32, 0.049),
            point("direct", 8, 0.03), point("direct", 32, 0.08), point("direct", 128, 0.04),
            point("mmap", 8, 0.5), point("mmap", 32, 0.6)]
    got = {r["tier"]: r["max_concurrency"] for r in stall_limits(runs)}
    assert got == {"memory": 128, "direct": 8, "mmap": None}
    table = stall_limits_table(stall_limits(runs))
    assert "| mmap | cold | none |" in table and "| memory | cold | 128 |" in table


def counted(r, steps, users):
    return {**r, "steps": steps, "users_measured": users}


def test_points_with_too_few_steps_or_users_are_marked_and_left_out_of_the_ratios():
    runs = [counted(RUNS[0], 500, 17), counted(RUNS[1], 300, MIN_USERS), counted(RUNS[2], 75, MIN_USERS - 1),
            counted(RUNS[3], MIN_STEPS - 1, 32)]
    assert [enough_samples(r) for r in runs] == [True, True, False, False]
    got = {(c["tier"], c["vs"]) for c in comparisons(runs)}
    assert got == {("direct", "memory")}  # mmap's point has too few users: neither ratio with it
    table = markdown_table(runs).splitlines()
    assert [line.rsplit("|", 2)[-2].strip() for line in table[2:6]] == ["ok", "ok", "few", "few"]
    assert f"under {MIN_STEPS} steps or {MIN_USERS} users" in table[-1]
    assert thin_points(runs) == ["mmap warm x8", "memory warm x32"]
    assert "few" not in markdown_table(runs[:2])


def test_the_plot_keeps_thin_points_and_names_tiers_with_none(tmp_path):
    runs = [counted(RUNS[0], 500, 17), counted(RUNS[2], 75, 1),
            {**counted(run("mmap", "cold", 8, 0.0, None, None), 12, 0)}]
    path = frontier_plot(runs, tmp_path / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
