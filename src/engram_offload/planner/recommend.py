"""Rank feasible placements by an objective and say why, in plain words."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .assumptions import DEFAULT_ASSUMPTIONS, Assumptions
from .hardware import GpuSpec
from .models import ModelSpec
from .placement import PLACEMENTS, PlacementResult, Workload, host_reads, smallest_feasible_tp

__all__ = ["OBJECTIVES", "Recommendation", "recommend"]

OBJECTIVES = {
    "tokens-per-gpu": "decode tokens/s per GPU at the interactivity floor",
    "tokens-per-dollar": "decode tokens per dollar at the interactivity floor",
}
GiB = 2**30
TIE = 0.95  # scores within 5% of the best count as a tie


@dataclass
class Recommendation:
    objective: str
    choice: PlacementResult | None
    ranking: list[PlacementResult]
    reasons: list[str] = field(default_factory=list)
    smallest_tp: dict[str, int | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        c = self.choice
        return {
            "objective": self.objective,
            "placement": c.name if c else None,
            "tp": c.tp if c else None,
            "batch": c.batch if c else None,
            "tokens_per_s_per_gpu": c.tokens_per_s_per_gpu if c else None,
            "tokens_per_dollar": c.tokens_per_dollar if c else None,
            "interactivity": c.interactivity if c else None,
            "ranking": [{"name": r.name, "tp": r.tp, "score": _score(r, self.objective)}
                        for r in self.ranking],
            "smallest_tp": self.smallest_tp,
            "reasons": self.reasons,
        }


def _score(r: PlacementResult, objective: str) -> float:
    return r.tokens_per_dollar if objective == "tokens-per-dollar" else r.tokens_per_s_per_gpu


def _fmt_bytes(b: float) -> str:
    if b >= GiB:
        return f"{b / GiB:.1f} GiB"
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 1024:.1f} KiB"


def recommend(model: ModelSpec, gpu: GpuSpec, results: list[PlacementResult], workload: Workload,
              objective: str = "tokens-per-gpu", assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> Recommendation:
    """Pick the best feasible placement that meets the interactivity floor (or, if none
    does, the feasible one closest to it) and explain the choice; the results' stalls are
    those of ``assumptions.schedule``, which the reasons name for a host-read placement."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose one of: {', '.join(OBJECTIVES)}")
    smallest = {name: smallest_feasible_tp(results, name) for name in PLACEMENTS}
    feasible = [r for r in results if r.fits]
    order = {name: i for i, name in enumerate(("hbm", "dram", "remote", "nvme"))}

    def key(r: PlacementResult) -> tuple:
        score = _score(r, objective) if r.meets_interactivity else r.interactivity
        return (not r.meets_interactivity, -score, r.predicted_stall_us > 0, r.tp, _order(order, r))

    ranking = sorted(feasible, key=key)
    if ranking and ranking[0].meets_interactivity:
        # The roofline is no better than about +-5%: among placements that close to the best,
        # prefer no stall, then fewer GPUs per replica (less communication, smaller failure
        # domain), then the simpler tier.
        top = _score(ranking[0], objective)
        close = [r for r in ranking if r.meets_interactivity and _score(r, objective) >= TIE * top]
        close.sort(key=lambda r: (r.predicted_stall_us > 0, r.tp, _order(order, r), -_score(r, objective)))
        ranking = close + [r for r in ranking if r not in close]
    rec = Recommendation(objective=objective, choice=ranking[0] if ranking else None,
                         ranking=ranking, smallest_tp=smallest)
    rec.reasons = _reasons(model, gpu, results, workload, rec, assumptions)
    return rec


def _order(order: dict[str, int], r: PlacementResult) -> int:
    """A placement's rank among equals: whole-table placements by ``order`` (simplest
    first), a per-layer placement after them all (two tiers to run)."""
    return order.get(r.name, len(order))


def _reasons(model: ModelSpec, gpu: GpuSpec, results: list[PlacementResult], w: Workload,
             rec: Recommendation, a: Assumptions) -> list[str]:
    """Why this choice, in sentences: where the table fits, the choice's memory, its data
    movement, its figures, and how it compares with the alternatives."""
    c = rec.choice
    if c is None:
        return _nothing_fits(gpu, results, w)
    return [
        _where_the_table_fits(model, w, rec),
        _memory(c, w),
        *_data_movement(model, c, w, a),
        _figures(c, gpu, w),
        *_alternatives(c, w, rec),
    ]


def _nothing_fits(gpu: GpuSpec, results: list[PlacementResult], w: Workload) -> list[str]:
    out = [f"Nothing fits on {w.gpus} x {gpu.name} at {w.context:,} tokens of context."]
    worst = [r for r in results if r.name == "dram" and r.tp == max(x.tp for x in results)]
    if worst:
        out.extend(f"dram at TP={worst[0].tp}: {why}" for why in worst[0].why_not)
    out.append("Try more GPUs (--gpus), a shorter --context, or a GPU with more HBM.")
    return out


def _where_the_table_fits(model: ModelSpec, w: Workload, rec: Recommendation) -> str:
    table = model.engram.table_bytes
    s_hbm, s_dram = rec.smallest_tp["hbm"], rec.smallest_tp["dram"]
    if s_hbm is None:
        return f"The {table / GiB:.1f} GiB table does not fit in HBM at any TP up to {w.gpus}."
    if s_dram is not None and s_dram < s_hbm:
        return (
            f"With the {table / GiB:.1f} GiB table in HBM the smallest workable TP is {s_hbm}; "
            f"in host DRAM it is {s_dram}: moving the table frees "
            f"{table / s_dram / GiB:.1f} GiB of HBM per GPU at TP={s_dram}."
        )
    return f"Smallest workable TP: {s_hbm} with the table in HBM, {s_dram} in DRAM."


def _memory(c: PlacementResult, w: Workload) -> str:
    return (
        f"{c.name} at TP={c.tp}: weights {_fmt_bytes(c.weight_bytes_per_gpu)}"
        + (f" + table {_fmt_bytes(c.table_hbm_bytes_per_gpu)}" if c.table_hbm_bytes_per_gpu else "")
        + f" per GPU leave {_fmt_bytes(c.hbm_free_bytes)} for KV cache, "
        f"{c.max_concurrent_seqs:,} sequences of {w.context:,} tokens per replica."
    )


def _data_movement(model: ModelSpec, c: PlacementResult, w: Workload, a: Assumptions) -> list[str]:
    """An offloaded table's transfer per step, where it waits, the prefill wait, and the NVMe
    cache and IOPS."""
    out: list[str] = []
    names = [x["placement"] for x in c.layers] or [c.name]
    host = host_reads(names, a)
    cpu_wait = host and a.schedule == "cpu-wait"
    if c.name != "hbm":
        verdict = ("no stall" if c.predicted_stall_us == 0
                   else f"a {c.predicted_stall_us:.0f} us stall per step")
        waits = (f"the CPU waits for every layer's rows before Engram layer {model.first_engram_layer} (eager or "
                 f"piecewise graphs, {a.eager_us:,.0f} us a step more than FULL graphs)" if cpu_wait
                 else "each Engram layer waits only for its own rows")
        out.append(
            f"Each decode step moves {c.batch} x {c.bytes_per_token_per_gpu:,} B = "
            f"{_fmt_bytes(c.link_bytes_per_step)} per GPU over {c.link}; its fetch takes about "
            f"{c.transfer_us:,.0f} us{_fetch_terms(c)}; the layers before Engram layer "
            f"{model.first_engram_layer} take {c.window_us:,.0f} us, and {waits}: {verdict}."
        )
        if host:
            out.append("Host reads as the vLLM plugin runs them: from the step's own forward entry, nothing fetched "
                       "ahead; " + ("under eager or piecewise graphs (drivers without stream memory operations)."
                                    if cpu_wait else "the GPU waits inside FULL CUDA graphs (the in-graph schedule, "
                                    "drivers with stream memory operations; elsewhere plan --schedule cpu-wait)."))
        if c.prefill_stall_us > 0:
            out.append(
                f"A prefill chunk of {a.prefill_chunk_tokens:,} tokens waits {c.prefill_stall_us / 1000:.1f} ms for "
                "its rows: the plugin reads them at the chunk's own step, not a chunk ahead."
            )
    if c.layers:
        out.append("Per layer: " + "; ".join(
            f"layer {x['layer']} on {x['placement']} ("
            + (f"{_fmt_bytes(x['hbm_bytes_per_gpu'])} HBM" if x["placement"] == "hbm"
               else f"{_fmt_bytes(x['dram_bytes_per_gpu'])} DRAM")
            + f" per GPU, {x['stall_us']:,.0f} us stall)" for x in c.layers)
            + ": each layer's rows need only arrive before that layer runs, so a later layer's window is longer.")
    if c.name == "nvme" or any(x["placement"] == "nvme" for x in c.layers):
        out.append(
            f"A {_fmt_bytes(c.cache_bytes_per_gpu)} DRAM cache per GPU gives a "
            f"{(c.cache_hit_rate or 0):.0%} hit rate ({w.curve_label}); misses need "
            f"{c.nvme_iops_needed / 1e3:,.0f}k IOPS per server of {c.nvme_iops_available / 1e6:.1f}M."
        )
    return out


TERM_WORDS = {
    "host hashing": "hashing and deduplicating the step's row ids on one host thread (--host-hash-us-*)",
    "link": "the bytes over the link",
    "NVMe reads": "the NVMe reads of the cache's misses",
    "host fetch worker": "the host's fetch worker serving the rows (--host-us-per-hit/-miss, --host-fetch-cores)",
    "latency": "round trips and the NVMe step overhead",
}


def _fetch_terms(c: PlacementResult) -> str:
    """The fetch time's largest term named, and the others' sizes."""
    if not c.fetch_terms or c.transfer_us <= 0:
        return ""
    terms = sorted(c.fetch_terms.items(), key=lambda kv: -kv[1])
    name, us = terms[0]
    rest = ", ".join(f"{n} {t:,.0f}" for n, t in terms[1:] if t >= 1)
    return (f", {us:,.0f} us of it {TERM_WORDS.get(name, name)}" + (f" (then {rest} us)" if rest else ""))


def _figures(c: PlacementResult, gpu: GpuSpec, w: Workload) -> str:
    meets = "meets" if c.meets_interactivity else "misses"
    return (
        f"At batch {c.batch}: {c.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
        f"{c.interactivity:.0f} tokens/s per user ({meets} the {w.min_interactivity:g} floor), "
        f"{c.tokens_per_dollar / 1e6:.1f}M tokens per dollar at ${gpu.price_per_hour:.2f}/GPU-hour."
    )


def _alternatives(c: PlacementResult, w: Workload, rec: Recommendation) -> list[str]:
    """The best option across the HBM / offload line, the fewest GPUs, and a missed floor."""
    out: list[str] = []
    other = next((r for r in rec.ranking if r.meets_interactivity
                  and (r.name == "hbm") != (c.name == "hbm")), None)
    if other is not None and c.meets_interactivity and _score(other, rec.objective) > 0:
        ratio = _score(c, rec.objective) / _score(other, rec.objective)
        side = "all-HBM" if other.name == "hbm" else "offloaded"
        out.append(f"Against the best {side} option ({other.name} at TP={other.tp}, batch {other.batch}): "
                   f"{ratio:.2f}x on this objective.")
    small = min((r for r in rec.ranking if r.tp == min(x.tp for x in rec.ranking)),
                key=lambda r: r.predicted_stall_us, default=None)
    if small is not None and small.tp < c.tp:
        out.append(
            f"Fewest GPUs per replica: {small.name} at TP={small.tp} "
            f"({small.tokens_per_s_per_gpu:,.0f} tokens/s per GPU at {small.interactivity:.0f} tokens/s "
            "per user); the roofline does not charge TP's kernel and synchronisation overheads "
            "beyond all-reduce latency, so measured gains from a lower TP can exceed this estimate."
        )
    if not c.meets_interactivity:
        out.append(f"No feasible placement reaches {w.min_interactivity:g} tokens/s per user; "
                   "this is the closest. Lower --min-interactivity or add GPUs.")
    return out
