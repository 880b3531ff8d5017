"""The benchmark's outputs: a markdown table, the comparisons and the frontier plot."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..atomic import atomic_path

__all__ = ["MIN_STEPS", "MIN_USERS", "STALL_LIMIT", "comparisons", "comparisons_table", "enough_samples",
           "frontier_plot", "markdown_table", "stall_limits", "stall_limits_table", "thin_points"]

STALL_LIMIT = 0.05  # the stall share of step time a deployment tolerates
# A point's figures are read as a result only from this many measured steps and users (users
# whose output rate was measured): fewer, and a run is a handful of steps whose ratios move by
# whole factors from one run to the next. Such points are marked "few" in the table, drawn
# hollow on the plot and left out of the ratios.
MIN_STEPS = 50
MIN_USERS = 8


def enough_samples(run: dict[str, Any], min_steps: int = MIN_STEPS, min_users: int = MIN_USERS) -> bool:
    """Whether ``run`` measured at least ``min_steps`` steps and ``min_users`` users (a run
    without these counts, such as one made up by hand, is not judged)."""
    steps, users = run.get("steps"), run.get("users_measured")
    return (steps is None or steps >= min_steps) and (users is None or users >= min_users)


def thin_points(runs: list[dict[str, Any]], min_steps: int = MIN_STEPS, min_users: int = MIN_USERS) -> list[str]:
    """``tier cache xC`` of every run with too few steps or users, in order."""
    return [f"{r['tier']} {r['cache_state']} x{r['concurrency']}" for r in runs
            if not enough_samples(r, min_steps, min_users)]

COLUMNS = [
    ("tier", "tier", "{}"),
    ("cache_state", "cache", "{}"),
    ("concurrency", "conc.", "{}"),
    ("throughput_tok_s", "tok/s", "{:,.0f}"),
    ("output_tok_s", "out tok/s", "{:,.0f}"),
    ("interactivity_tok_s_per_user", "tok/s/user", "{:.1f}"),
    ("p90_itl_ms", "P90 ITL ms", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:,.0f}"),
    ("stall_fraction", "stall", "{:.1%}"),
    ("predicted_stall_fraction", "planner stall", "{:.1%}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("device_bytes_per_token", "disk B/tok", "{:,.0f}"),
    ("budget_enforced", "budget", "{}"),
    ("steps", "steps", "{:,}"),
    ("users_measured", "users", "{:,}"),
]


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def markdown_table(runs: list[dict[str, Any]], min_steps: int = MIN_STEPS, min_users: int = MIN_USERS) -> str:
    """One row per run, the columns a reader compares first; a last column says "few" where the
    run measured fewer than ``min_steps`` steps or ``min_users`` users."""
    head = "| " + " | ".join(title for _, title, _ in COLUMNS) + " | sample |"
    rule = "|" + "|".join("---:" if fmt != "{}" else "---" for _, _, fmt in COLUMNS) + "|---|"
    rows = ["| " + " | ".join(_cell(r.get(key), fmt) for key, _, fmt in COLUMNS)
            + f" | {'ok' if enough_samples(r, min_steps, min_users) else 'few'} |" for r in runs]
    thin = any(not enough_samples(r, min_steps, min_users) for r in runs)
    note = (f"\nsample: 'few' = under {min_steps} steps or {min_users} users measured; such points are "
            "drawn hollow and left out of the ratios" if thin else "")
    return "\n".join([head, rule, *rows]) + note


def comparisons(runs: list[dict[str, Any]], baseline: str = "memory", min_steps: int = MIN_STEPS,
                min_users: int = MIN_USERS) -> list[dict[str, Any]]:
    """Each non-baseline run against the baseline tier (and ``direct`` against ``mmap``) at the
    same cache state and concurrency: throughput and P90 ITL ratios. Points with too few steps
    or users (``enough_samples``) on either side are left out."""
    index = {(r["tier"], r["cache_state"], r["concurrency"]): r for r in runs}
    out = []
    for r in runs:
        for ref in (baseline, "mmap"):
            if r["tier"] == ref or (ref == "mmap" and r["tier"] != "direct"):
                continue
            base = index.get((ref, r["cache_state"], r["concurrency"]))
            if base is None or not base["throughput_tok_s"] or not (
                    enough_samples(r, min_steps, min_users) and enough_samples(base, min_steps, min_users)):
                continue
            itl_ratio = (r["p90_itl_ms"] / base["p90_itl_ms"]
                         if r.get("p90_itl_ms") and base.get("p90_itl_ms") else None)
            out.append({"tier": r["tier"], "vs": ref, "cache_state": r["cache_state"],
                        "concurrency": r["concurrency"],
                        "throughput_ratio": r["throughput_tok_s"] / base["throughput_tok_s"],
                        "p90_itl_ratio": itl_ratio})
    return out


def comparisons_table(rows: list[dict[str, Any]]) -> str:
    head = "| tier | vs | cache | conc. | throughput ratio | P90 ITL ratio |\n|---|---|---|---:|---:|---:|"
    body = [f"| {c['tier']} | {c['vs']} | {c['cache_state']} | {c['concurrency']} | "
            f"{c['throughput_ratio']:.2f}x | {_cell(c['p90_itl_ratio'], '{:.2f}x')} |" for c in rows]
    return "\n".join([head, *body])


def stall_limits(runs: list[dict[str, Any]], limit: float = STALL_LIMIT) -> list[dict[str, Any]]:
    """Per tier and cache state, the largest concurrency whose measured stall is under
    ``limit`` of step time, with every lower concurrency measured also under it (None: not
    even the lowest)."""
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        lines.setdefault((r["tier"], r["cache_state"]), []).append(r)
    out = []
    for (tier, state), points in lines.items():
        best = None
        for p in sorted(points, key=lambda r: r["concurrency"]):
            if p["stall_fraction"] >= limit:
                break
            best = p["concurrency"]
        out.append({"tier": tier, "cache_state": state, "stall_limit": limit, "max_concurrency": best,
                    "concurrencies": sorted(p["concurrency"] for p in points)})
    return out


def stall_limits_table(rows: list[dict[str, Any]]) -> str:
    limit = rows[0]["stall_limit"] if rows else STALL_LIMIT
    head = f"| tier | cache | largest concurrency, stall < {limit:.0%} |\n|---|---|---:|"
    body = [f"| {r['tier']} | {r['cache_state']} | {r['max_concurrency'] or 'none'} |" for r in rows]
    return "\n".join([head, *body])


def frontier_plot(runs: list[dict[str, Any]], path: str | os.PathLike[str], title: str = "",
                  min_steps: int = MIN_STEPS, min_users: int = MIN_USERS) -> Path:
    """Throughput (tok/s) against interactivity (tok/s/user): one line per tier and cache
    state, a point per concurrency (labelled with it). Points with too few steps or users
    are hollow; a tier and state that finished no user's output is named in the corner
    instead of being left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    styles = {"cold": ":", "warm": "-", "mixed": "--"}
    markers = {"memory": "o", "pinned": "D", "direct": "s", "mmap": "^", "remote": "v", "shared": "P"}
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    unplotted: list[str] = []
    for r in runs:
        if r.get("interactivity_tok_s_per_user") is None:
            unplotted.append(f"{r['tier']} {r['cache_state']} x{r['concurrency']}")
            continue
        lines.setdefault((r["tier"], r["cache_state"]), []).append(r)
    for (tier, state), points in sorted(lines.items()):
        points.sort(key=lambda r: r["concurrency"])
        xs = [p["interactivity_tok_s_per_user"] for p in points]
        ys = [p["throughput_tok_s"] for p in points]
        (line,) = ax.plot(xs, ys, linestyle=styles.get(state, "-"), label=f"{tier}, {state}")
        marker = markers.get(tier, "o")
        for p, x, y in zip(points, xs, ys):
            full = enough_samples(p, min_steps, min_users)
            ax.plot([x], [y], linestyle="none", marker=marker, color=line.get_color(),
                    markerfacecolor=line.get_color() if full else "none")
            ax.annotate(f"{p['concurrency']}" + ("" if full else " (few)"), (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    notes = []
    if any(not enough_samples(p, min_steps, min_users) for points in lines.values() for p in points):
        notes.append(f"hollow: under {min_steps} steps or {min_users} users measured")
    if unplotted:
        notes.append("no user's output finished: " + ", ".join(unplotted))
    if notes:
        ax.text(0.01, 0.01, "\n".join(notes), transform=ax.transAxes, fontsize=7, va="bottom", ha="left")
    ax.set_xlabel("interactivity (output tok/s per user, median)")
    ax.set_ylabel("throughput (tok/s, input + output)")
    ax.set_yscale("log")
    ax.set_title(title or "Throughput vs interactivity (labels: concurrency)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp)
    finally:
        plt.close(fig)
    return path


def ranks_table(runs: list[dict[str, Any]], table_bytes: int, budget: int | None) -> str:
    """Per-rank figures of runs served by several ranks, and the machine's DRAM they used
    (summed PSS of the ranks and the row server) beside the table's size and the budget."""
    gib = 2**30
    lines = [f"table {table_bytes / gib:.2f} GiB, budget " + (f"{budget / gib:.2f} GiB" if budget is not None else "none"),
             "", "| tier | state | conc | rank | tok/s | rows/s | stall | hit rate | PSS GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for r in run.get("per_rank", []):
            lines.append(f"| {run['tier']} | {run['cache_state']} | {run['concurrency']} | {r['rank']} | "
                         f"{_cell(r['throughput_tok_s'], '{:,.0f}')} | {_cell(r['rows_per_s'], '{:,.0f}')} | "
                         f"{_cell(r['stall_fraction'], '{:.1%}')} | {_cell(r['hit_rate'], '{:.1%}')} | "
                         f"{r['pss_bytes'] / gib:.2f} |")
        if "dram_used_bytes" in run:
            lines.append(f"| {run['tier']} | {run['cache_state']} | {run['concurrency']} | all {run['ranks']} | "
                         f"{_cell(run['throughput_tok_s'], '{:,.0f}')} | | | | "
                         f"{run['dram_used_bytes'] / gib:.2f} (with the row server's "
                         f"{run['server_pss_bytes'] / gib:.2f}) |")
    return "\n".join(lines)
