"""``plan``: where an Engram table should live on a given GPU, and at which TP degree."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace

from ..planner import DEFAULT_ASSUMPTIONS, OBJECTIVES, custom_model, get_gpu, get_model, make_plan
from ..planner.hardware import GPUS
from ..planner.models import MODELS
from ..planner.mrc import load_trace
from ..planner.placement import Workload
from ..planner.plan import Plan, curve_for
from ..planner.ranks import MachineDram, machine_dram
from ..units import fraction, non_negative_float, positive_float, positive_int, unit_interval
from .core import load_hf_config

GiB = 2**30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan where an Engram table lives (HBM, DRAM, NVMe, remote) and at which TP",
        description="Evaluate every placement of an Engram table at every tensor-parallel degree "
        "on a GPU type and recommend one. Facts and assumptions: docs/planner.md.",
    )
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model", help=f"a preset: {', '.join(MODELS)}")
    m.add_argument("--config", help="a Hugging Face config.json with engram_* fields (custom model)")
    p.add_argument("--gpu", required=True, help=f"one of: {', '.join(GPUS)}")
    p.add_argument("--gpus", type=positive_int, default=8, help="GPUs available; TP degrees tried are powers of two up to it (default 8)")
    p.add_argument("--context", type=positive_int, default=32768, help="tokens of context per sequence (default 32768)")
    p.add_argument("--batch", type=positive_int, default=None, help="sequences per replica (default: the best under the interactivity floor)")
    p.add_argument("--trace", help="row ids to size the NVMe DRAM cache: .npy int64 or a text file of integers")
    p.add_argument("--zipf", type=positive_float, default=None,
                   help="Zipf exponent of row popularity when no trace (default: no Zipf, real text's measured "
                   "curve, docs/planner.md)")
    p.add_argument("--target-hit-rate", type=fraction, default=0.9, help="DRAM cache hit rate for the nvme placement (default 0.9)")
    p.add_argument("--min-interactivity", type=positive_float, default=50.0, help="decode tokens/s per user to meet (default 50)")
    p.add_argument("--objective", choices=list(OBJECTIVES), default="tokens-per-gpu", help="what to rank by (default tokens-per-gpu)")
    p.add_argument("--price", type=non_negative_float, default=None, help="dollars per GPU-hour (overrides the preset)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    d = p.add_argument_group("ranks on one machine (host DRAM per machine)")
    d.add_argument("--dp", type=positive_int, default=1, help="data-parallel replicas on one machine (default 1)")
    d.add_argument("--shared-host-copy", action=argparse.BooleanOptionalAction, default=None,
                   help="the replicas share one host copy of the table (tier=shared; default: yes when --dp > 1)")
    d.add_argument("--row-server", action=argparse.BooleanOptionalAction, default=None,
                   help="one row server a machine holds the DRAM row cache for every replica (default: yes when "
                   "--dp > 1)")
    r = p.add_argument_group("pooled tier (the remote placement)")
    r.add_argument("--pool-rtt-us", type=non_negative_float, default=DEFAULT_ASSUMPTIONS.remote_latency_us,
                   help="one round trip to the pool, per step (default "
                   f"{DEFAULT_ASSUMPTIONS.remote_latency_us:g}: one 264-byte GETRANGE measured on loopback)")
    r.add_argument("--pool-gbps", type=positive_float, default=DEFAULT_ASSUMPTIONS.remote_bw * 8 / 1e9,
                   help="the pool's row bandwidth per GPU, Gb/s (default "
                   f"{DEFAULT_ASSUMPTIONS.remote_bw * 8 / 1e9:.2f}: 808k rows/s of 264 B, measured on loopback with "
                   "one client and one Redis master; rows/s grows with the number of masters)")
    h = p.add_argument_group("host fetch path (CPU per step; defaults measured with bench-tier, docs/planner.md)")
    h.add_argument("--host-hash-us-per-step", type=non_negative_float,
                   default=DEFAULT_ASSUMPTIONS.host_hash_us_per_step,
                   help="CPU us to begin a step (hashing's fixed part; default "
                   f"{DEFAULT_ASSUMPTIONS.host_hash_us_per_step:g})")
    h.add_argument("--host-hash-us-per-row", type=non_negative_float, default=DEFAULT_ASSUMPTIONS.host_hash_us_per_row,
                   help="CPU us to hash and deduplicate one row id, every column (default "
                   f"{DEFAULT_ASSUMPTIONS.host_hash_us_per_row:g})")
    h.add_argument("--host-us-per-hit", type=non_negative_float, default=DEFAULT_ASSUMPTIONS.host_us_per_hit,
                   help="CPU us per row the host serves from its DRAM row cache (default "
                   f"{DEFAULT_ASSUMPTIONS.host_us_per_hit:g}; a table wholly in pinned DRAM is read by the GPU "
                   "over unified addressing, no host CPU a row, unless --host-serves-dram)")
    h.add_argument("--host-serves-dram", action="store_true",
                   help="the host serves the rows of a table in DRAM (no GPU reads over unified addressing)")
    h.add_argument("--host-us-per-miss", type=non_negative_float, default=DEFAULT_ASSUMPTIONS.host_us_per_miss,
                   help=f"CPU us per row read from NVMe (default {DEFAULT_ASSUMPTIONS.host_us_per_miss:g})")
    h.add_argument("--host-fetch-cores", type=positive_float, default=DEFAULT_ASSUMPTIONS.host_fetch_cores,
                   help="cores each GPU's fetch path keeps busy (default "
                   f"{DEFAULT_ASSUMPTIONS.host_fetch_cores:g}: the prefetcher's one worker)")
    c = p.add_argument_group("custom model (with --config)")
    c.add_argument("--total-params", type=positive_float, help="backbone parameters, without the Engram table (e.g. 552e9)")
    c.add_argument("--active-params", type=positive_float, help="active parameters per token in decode")
    c.add_argument("--active-params-prefill", type=positive_float, help="active parameters per token in prefill (default: --active-params)")
    c.add_argument("--precision", default="fp8", help="weight precision: fp32, bf16, fp16, fp8, fp4, int8 (default fp8)")
    c.add_argument("--expert-precision", help="routed-expert precision if different (e.g. fp4)")
    c.add_argument("--routed-fraction", type=unit_interval, help="share of parameters in routed experts (default 0.95 for MoE)")
    c.add_argument("--kv-bytes-per-token", type=positive_float, help="KV-cache bytes per token, all layers")
    c.add_argument("--layers", type=positive_int, help="layer count (default: num_hidden_layers of config.json)")
    p.set_defaults(func=cmd_plan)


def plan_from_args(args: argparse.Namespace) -> Plan:
    if args.config:
        load_hf_config(args.config)  # a damaged or absurd config.json fails here, in one line
        model = custom_model(
            args.config, total_params=args.total_params, active_params_decode=args.active_params,
            active_params_prefill=args.active_params_prefill, precision=args.precision,
            expert_precision=args.expert_precision, routed_fraction=args.routed_fraction,
            kv_bytes_per_token=args.kv_bytes_per_token, num_layers=args.layers,
        )
    else:
        model = get_model(args.model)
    gpu = get_gpu(args.gpu).with_price(args.price)
    trace = load_trace(args.trace) if args.trace else None
    curve, label = curve_for(model, trace, args.zipf)
    workload = Workload(context=args.context, batch=args.batch, gpus=args.gpus,
                        min_interactivity=args.min_interactivity,
                        target_hit_rate=args.target_hit_rate, curve=curve, curve_label=label)
    assumptions = replace(DEFAULT_ASSUMPTIONS, remote_latency_us=args.pool_rtt_us, remote_bw=args.pool_gbps * 1e9 / 8,
                          host_hash_us_per_step=args.host_hash_us_per_step,
                          host_hash_us_per_row=args.host_hash_us_per_row, host_us_per_hit=args.host_us_per_hit,
                          dram_rows_by_gpu=not args.host_serves_dram,
                          host_us_per_miss=args.host_us_per_miss, host_fetch_cores=args.host_fetch_cores)
    return make_plan(model, gpu, workload, args.objective, assumptions)


def dram_per_machine(plan: Plan, args: argparse.Namespace) -> list[MachineDram]:
    """Host DRAM per machine of every placement at ``--dp`` replicas."""
    shared = args.dp > 1 if args.shared_host_copy is None else args.shared_host_copy
    server = args.dp > 1 if args.row_server is None else args.row_server
    return [machine_dram(r, args.dp, shared, server) for r in plan.placements]


def cmd_plan(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    machine = dram_per_machine(plan, args)
    if args.json:
        print(json.dumps({**plan.to_dict(), "dram_per_machine": [m.to_dict() for m in machine]}, indent=2))
        return 0
    print_plan(plan, machine)
    return 0


def print_plan(plan: Plan, machine: list[MachineDram] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, shutil.get_terminal_size((160, 24)).columns), highlight=False)
    e, w, g = plan.model.engram, plan.workload, plan.gpu
    console.print(
        f"[bold]{plan.model.name}[/] on {w.gpus} x {g.name}: table {e.table_bytes / GiB:.1f} GiB, "
        f"{e.bytes_per_token / 1024:.1f} KiB per token, weights {plan.model.weight_bytes / GiB:.1f} GiB, "
        f"context {w.context:,}, floor {w.min_interactivity:g} tok/s/user"
    )
    t = Table(show_lines=False)
    for col in ("placement", "TP", "fits", "KV GiB/GPU", "seqs", "KiB/tok/GPU", "batch",
                "fetch us", "window us", "stall us", "tok/s/user", "tok/s/GPU", "cache", "DRAM GiB/machine"):
        t.add_column(col, justify="left" if col in ("placement", "fits", "cache") else "right")
    why: list[str] = []
    for i, r in enumerate(plan.placements):
        cache = ""
        if r.name == "nvme" and r.cache_hit_rate is not None:
            cache = f"{r.cache_bytes_per_gpu / GiB:.1f} GiB, {r.cache_hit_rate:.0%} hit"
        ok = r.fits and r.batch > 0
        def dash(text: str, ok: bool = ok) -> str:
            return text if ok else "-"

        t.add_row(
            r.name, str(r.tp), "yes" if r.fits else "[red]no[/]",
            f"{r.hbm_free_bytes / GiB:.1f}", f"{r.max_concurrent_seqs:,}",
            f"{r.bytes_per_token_per_gpu / 1024:.1f}", dash(str(r.batch)),
            dash(f"{r.transfer_us:.0f}"), dash(f"{r.window_us:.0f}"),
            dash(f"{r.predicted_stall_us:.0f}"), dash(f"{r.interactivity:.0f}"),
            dash(f"{r.tokens_per_s_per_gpu:,.0f}"), cache,
            dash(f"{machine[i].total_bytes / GiB:.1f}") if machine else "-",
        )
        why.extend(f"{r.name} TP={r.tp}: {reason}" for reason in r.why_not)
    console.print(t)
    if machine:
        m = machine[0]
        console.print(f"  [dim]DRAM per machine at --dp {m.dp}: host copy x {1 if m.shared_host_copy else m.dp} "
                      f"({'shared' if m.shared_host_copy else 'one a replica'}) + row cache x "
                      f"{1 if m.row_server else m.dp} ({'one row server' if m.row_server else 'one a replica'}) "
                      f"+ step buffers x {m.dp}[/]")
    for line in why:
        console.print(f"  [dim]{line}[/]")
    rec = plan.recommendation
    if rec.choice is not None:
        console.print(f"[bold]Recommendation ({OBJECTIVES[rec.objective]}):[/] "
                      f"table in {rec.choice.name.upper()}, TP={rec.choice.tp}, batch {rec.choice.batch}")
    else:
        console.print("[bold]Recommendation:[/] none fits")
    for reason in rec.reasons:
        console.print(f"  - {reason}")
