"""``plan``: where an Engram table should live on a given GPU, and at which TP degree."""

from __future__ import annotations

import argparse
import io
import json
import shutil
from dataclasses import replace
from typing import Any

from ..planner import DEFAULT_ASSUMPTIONS, OBJECTIVES, custom_model, get_gpu, get_model, make_plan
from ..planner.hardware import GPUS, GpuSpec
from ..planner.models import MODELS
from ..planner.mrc import load_trace
from ..planner.placement import PlacementResult, Workload
from ..planner.plan import Plan, curve_for
from ..planner.ranks import MachineDram, machine_dram
from ..planner.server import SERVER_KEYS, SERVER_PRESETS, ServerFigure, load_server_file, server_for
from ..units import (
    format_bytes,
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    size_arg,
    unit_interval,
)
from .core import load_hf_config
from .options import add_cache_bytes, add_json, gpu_arg, model_preset_arg, removed_option

GiB = 2**30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan where an Engram table lives (HBM, DRAM, NVMe, remote) and at which TP",
        description="Evaluate every placement of an Engram table at every tensor-parallel degree "
        "on a GPU type and recommend one. Facts and assumptions: docs/planner.md.",
    )
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--preset", type=model_preset_arg,
                   help=f"a named model: {', '.join(MODELS)} (default none: give this or --config)")
    removed_option(p, "--model", "--preset")
    m.add_argument("--config", metavar="PATH",
                   help="a Hugging Face config.json with engram_* fields, a custom model (default none)")
    p.add_argument("--gpu", required=True, type=gpu_arg, help=f"one of: {', '.join(GPUS)} (required; no default)")
    p.add_argument("--gpus", type=positive_int, default=8, help="GPUs available; TP degrees tried are powers of two up to it (default 8)")
    p.add_argument("--context", type=positive_int, default=32768, help="tokens of context per sequence (default 32768)")
    p.add_argument("--batch", type=positive_int, default=None, help="sequences per replica (default: the best under the interactivity floor)")
    p.add_argument("--trace", help="row ids to size the NVMe DRAM cache: .npy int64 or a text file of integers "
                   "(default: no trace, the built-in curve)")
    p.add_argument("--zipf", type=positive_float, default=None,
                   help="Zipf exponent of row popularity when no trace (default: no Zipf, real text's measured "
                   "curve, docs/planner.md)")
    p.add_argument("--target-hit-rate", type=fraction, default=0.9,
                   help="DRAM cache hit rate the nvme placement's cache is sized for (default 0.9)")
    add_cache_bytes(p, None, percent=False, shown="none: sized by --target-hit-rate",
                    what="the nvme placement's DRAM row cache per replica, instead of --target-hit-rate; the cache "
                    "table lists it beside other sizes")
    p.add_argument("--min-interactivity", type=positive_float, default=50.0, help="decode tokens/s per user to meet (default 50)")
    p.add_argument("--objective", choices=list(OBJECTIVES), default="tokens-per-gpu", help="what to rank by (default tokens-per-gpu)")
    p.add_argument("--price", type=non_negative_float, default=None, help="dollars per GPU-hour (default: the GPU preset's)")
    p.add_argument("--schedule", choices=["in-graph", "cpu-wait"], default=DEFAULT_ASSUMPTIONS.schedule,
                   help="where a host-read placement (nvme, remote) waits for its rows, as the vLLM plugin runs it: "
                   "in-graph (FULL CUDA graphs, the GPU waiting before each Engram layer: drivers with stream memory "
                   "operations; default) or cpu-wait (eager or piecewise graphs: every layer's rows waited for before "
                   "the first Engram layer, plus --eager-us a step)")
    p.add_argument("--eager-us", type=non_negative_float, default=DEFAULT_ASSUMPTIONS.eager_us,
                   help="what eager or piecewise graphs cost a step against FULL graphs under --schedule cpu-wait "
                   f"(default {DEFAULT_ASSUMPTIONS.eager_us:g}: a modeled constant, docs/planner.md)")
    add_json(p)
    p.add_argument("--wide", action="store_true", help="every column of the table (default: the ones that fit 100 columns)")
    s = p.add_argument_group("the server around the GPUs (default: the GPU preset's reference server, a DGX; "
                             "the output names every figure given and assumed)")
    s.add_argument("--server", default="dgx",
                   help=f"a preset ({'; '.join(f'{k}: {v}' for k, v in SERVER_PRESETS.items())}) or a JSON file of "
                   f"the figures below (keys {', '.join(SERVER_KEYS)}; 'preset' too); flags override it (default dgx)")
    s.add_argument("--gpus-per-server", type=positive_int, default=None, help="GPUs in one server (default: the preset's)")
    s.add_argument("--host-dram", type=size_arg, default=None,
                   help="host DRAM of one server, a size (e.g. 1T, 1TiB, 768G; binary units; default: the preset's, "
                   "2 TB for a DGX)")
    s.add_argument("--nvme-drives", type=non_negative_int, default=None, help="NVMe data drives in one server (default: the --server preset's)")
    s.add_argument("--nvme-iops", type=positive_float, default=None,
                   help="each drive's 4 KiB random reads/s (e.g. fio --bs=4k --iodepth=128; default: the preset's)")
    s.add_argument("--nvme-bytes-per-s", type=positive_float, default=None,
                   help="each drive's read bandwidth, bytes/s (e.g. 6.9e9; default: the preset's)")
    s.add_argument("--nvme-capacity", type=size_arg, default=None,
                   help="each drive's capacity, a size (binary units: a 3.84 TB drive is 3.49T; default: the preset's)")
    s.add_argument("--nvme-latency-us", type=positive_float, default=None,
                   help="a 4 KiB read's latency at queue depth 1, us (default: the preset's, 80)")
    s.add_argument("--pcie", type=int, choices=(4, 5, 6), default=None,
                   help="the GPUs' host link: PCIe generation, x16 (default: the preset's)")
    s.add_argument("--host-cores", type=positive_int, default=None,
                   help="host CPU cores in one server; each GPU's fetch path keeps 1 + --host-fetch-cores busy, and "
                   "fewer cores than that slow it (default: the preset's)")
    s.add_argument("--dram-price", type=non_negative_float, default=DEFAULT_ASSUMPTIONS.dram_price_per_gib,
                   help=f"dollars per GiB of server DRAM (default {DEFAULT_ASSUMPTIONS.dram_price_per_gib:g}: an "
                   "assumed list price)")
    s.add_argument("--nvme-price", type=non_negative_float, default=DEFAULT_ASSUMPTIONS.nvme_price_per_tb,
                   help=f"dollars per TB of NVMe (default {DEFAULT_ASSUMPTIONS.nvme_price_per_tb:g}: an assumed "
                   "list price)")
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
    c.add_argument("--total-params", type=positive_float, help="backbone parameters, without the Engram table (e.g. 552e9; default: from config.json)")
    c.add_argument("--active-params", type=positive_float, help="active parameters per token in decode (default: from config.json)")
    c.add_argument("--active-params-prefill", type=positive_float, help="active parameters per token in prefill (default: --active-params)")
    c.add_argument("--precision", default="fp8", help="weight precision: fp32, bf16, fp16, fp8, fp4, int8 (default fp8)")
    c.add_argument("--expert-precision", help="routed-expert precision if different (e.g. fp4; default: --precision)")
    c.add_argument("--routed-fraction", type=unit_interval, help="share of parameters in routed experts (default 0.95 for MoE)")
    c.add_argument("--kv-bytes-per-token", type=positive_float, help="KV-cache bytes per token, all layers (default: from config.json)")
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
        model = get_model(args.preset)
    gpu, server = server_from_args(get_gpu(args.gpu).with_price(args.price), args)
    trace = load_trace(args.trace) if args.trace else None
    curve, label = curve_for(model, trace, args.zipf)
    workload = Workload(context=args.context, batch=args.batch, gpus=args.gpus,
                        min_interactivity=args.min_interactivity, cache_bytes=args.cache_bytes,
                        target_hit_rate=args.target_hit_rate, curve=curve, curve_label=label)
    assumptions = replace(DEFAULT_ASSUMPTIONS, remote_latency_us=args.pool_rtt_us, remote_bw=args.pool_gbps * 1e9 / 8,
                          host_hash_us_per_step=args.host_hash_us_per_step,
                          host_hash_us_per_row=args.host_hash_us_per_row, host_us_per_hit=args.host_us_per_hit,
                          dram_rows_by_gpu=not args.host_serves_dram,
                          host_us_per_miss=args.host_us_per_miss, host_fetch_cores=args.host_fetch_cores,
                          dram_price_per_gib=args.dram_price, nvme_price_per_tb=args.nvme_price,
                          schedule=args.schedule, eager_us=args.eager_us)
    return make_plan(model, gpu, workload, args.objective, assumptions, server)


def server_from_args(gpu: GpuSpec, args: argparse.Namespace) -> tuple[GpuSpec, list[ServerFigure]]:
    """``gpu`` in the server of ``--server`` (a preset or a JSON file) and the server flags."""
    preset, file = (args.server, None) if args.server in SERVER_PRESETS else ("dgx", load_server_file(args.server))
    given = {key: getattr(args, key) for key in SERVER_KEYS}
    return server_for(gpu, preset, file, given)


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
    print_plan(plan, machine, wide=args.wide)
    return 0


NARROW = 100  # columns of the default output


def _cache_cell(r: PlacementResult) -> str:
    if r.name != "nvme" or r.cache_hit_rate is None:
        return ""
    return f"{format_bytes(r.cache_bytes_per_gpu * r.tp)}, {r.cache_hit_rate:.0%}"


def print_plan(plan: Plan, machine: list[MachineDram] | None = None, wide: bool = False) -> None:
    """The plan as text: the server, the table of placements (``wide``: every column, else
    what fits 100 columns), the DRAM cache sizes in front of NVMe, memory prices, the choice."""
    from rich.console import Console

    width = max(200, shutil.get_terminal_size((200, 24)).columns) if wide else NARROW
    console = Console(width=width, highlight=False, soft_wrap=False, record=True, file=io.StringIO())
    _print_plan(console, plan, machine, wide)
    # the recorded text, each line without the padding rich adds to the width
    print("\n".join(line.rstrip() for line in console.export_text(styles=False).splitlines()))


def _print_plan(console: Any, plan: Plan, machine: list[MachineDram] | None, wide: bool) -> None:
    from rich import box
    from rich.table import Table

    e, w, g = plan.model.engram, plan.workload, plan.gpu
    console.print(
        f"[bold]{plan.model.name}[/] on {w.gpus} x {g.name}: table {format_bytes(e.table_bytes)}, "
        f"{format_bytes(e.bytes_per_token)} per token, weights {format_bytes(plan.model.weight_bytes)}, "
        f"context {w.context:,}, floor {w.min_interactivity:g} tok/s/user"
    )
    if plan.server:
        given = [f"{f.key} {f.text}" for f in plan.server if f.given]
        assumed = [f"{f.key} {f.text}" for f in plan.server if not f.given]
        source = next((f.source for f in plan.server if not f.given), "")
        console.print(f"Server ({g.server}, host link {g.host_link}): given: {', '.join(given) or 'nothing'}; "
                      + (f"{source}: {', '.join(assumed)}" if assumed else "nothing assumed"))
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    cols = ["placement", "TP", "fits", "KV GiB", "batch", "fetch us", "stall us", "tok/s/user", "tok/s/GPU", "cache, hit"]
    if wide:
        cols[4:4] = ["seqs", "KiB/tok/GPU"]
        cols += ["window us", "largest fetch term", "NVMe kIOPS", "memory $", "DRAM GiB/machine"]
    elif machine and machine[0].dp > 1:
        cols.append("DRAM GiB/machine")
    heads = {"KV GiB": "KV\nGiB", "fetch us": "fetch\nus", "stall us": "stall\nus", "tok/s/user": "tok/s\n/user",
             "tok/s/GPU": "tok/s\n/GPU", "cache, hit": "DRAM cache\nhit rate", "KiB/tok/GPU": "KiB/tok\n/GPU",
             "window us": "window\nus", "NVMe kIOPS": "NVMe\nkIOPS", "DRAM GiB/machine": "DRAM GiB\n/machine",
             "largest fetch term": "largest\nfetch term", "memory $": "memory\n$"}
    for col in cols:
        t.add_column(heads.get(col, col), no_wrap=True,
                     justify="left" if col in ("placement", "fits", "cache, hit", "largest fetch term") else "right")
    why: list[str] = []
    for i, r in enumerate(plan.placements):
        ok = r.fits and r.batch > 0

        def dash(text: str, ok: bool = ok) -> str:
            return text if ok else "-"

        cells = {"placement": r.name, "TP": str(r.tp), "fits": "yes" if r.fits else "[red]no[/]",
                 "KV GiB": f"{r.hbm_free_bytes / GiB:.1f}", "seqs": f"{r.max_concurrent_seqs:,}",
                 "KiB/tok/GPU": f"{r.bytes_per_token_per_gpu / 1024:.1f}", "batch": dash(str(r.batch)),
                 "fetch us": dash(f"{r.transfer_us:,.0f}"), "stall us": dash(f"{r.predicted_stall_us:,.0f}"),
                 "tok/s/user": dash(f"{r.interactivity:.0f}"), "tok/s/GPU": dash(f"{r.tokens_per_s_per_gpu:,.0f}"),
                 "cache, hit": _cache_cell(r), "window us": dash(f"{r.window_us:,.0f}"),
                 "largest fetch term": dash(_largest(r)),
                 "NVMe kIOPS": f"{r.nvme_iops_needed / 1e3:,.0f}" if r.name == "nvme" and ok else "",
                 "memory $": f"{plan.costs[i].dollars:,.0f}" if plan.costs and plan.costs[i].dollars else "",
                 "DRAM GiB/machine": dash(f"{machine[i].total_bytes / GiB:.1f}") if machine else "-"}
        t.add_row(*(cells[c] for c in cols))
        why.extend(f"{r.name} TP={r.tp}: {reason}" for reason in r.why_not)
        if r.cache_note and r.fits:
            why.append(f"{r.name} TP={r.tp}: {r.cache_note}")
    console.print(t)
    if machine and "DRAM GiB/machine" in cols:
        m = machine[0]
        console.print(f"  [dim]DRAM per machine at --dp {m.dp}: host copy x {1 if m.shared_host_copy else m.dp} "
                      f"({'shared' if m.shared_host_copy else 'one a replica'}) + row cache x "
                      f"{1 if m.row_server else m.dp} ({'one row server' if m.row_server else 'one a replica'}) "
                      f"+ step buffers x {m.dp}[/]")
    for line in why:
        console.print(f"  [dim]{line}[/]")
    _print_layered(console, plan)
    _print_cache_sweep(console, plan)
    _print_memory(console, plan)
    rec = plan.recommendation
    if rec.choice is not None:
        console.print(f"[bold]Recommendation ({OBJECTIVES[rec.objective]}):[/] "
                      f"table in {rec.choice.name.upper()}, TP={rec.choice.tp}, batch {rec.choice.batch}")
    else:
        console.print("[bold]Recommendation:[/] none fits")
    for reason in rec.reasons:
        console.print(f"  - {reason}")


def _largest(r: PlacementResult) -> str:
    if not r.fetch_terms:
        return ""
    name, us = max(r.fetch_terms.items(), key=lambda kv: kv[1])
    return f"{name} {us:,.0f} us"


def _print_layered(console: Any, plan: Plan) -> None:
    """Per-layer placements (each at its best TP that fits), beside the whole-table ones above."""
    from rich import box
    from rich.table import Table

    best: dict[str, PlacementResult] = {}
    for r in plan.layered:
        if r.fits and r.batch > 0 and (r.name not in best or r.tokens_per_s_per_gpu > best[r.name].tokens_per_s_per_gpu):
            best[r.name] = r
    if not best:
        return
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), title_justify="left",
              title="Each Engram layer on its own tier (the best TP of each; DRAM and HBM per GPU; then per layer)")
    for col in ("placement", "TP", "batch", "stall us", "tok/s/user", "tok/s/GPU", "DRAM GiB", "HBM GiB", "hit"):
        t.add_column(col, justify="left" if col == "placement" else "right", no_wrap=True)
    for r in sorted(best.values(), key=lambda r: -r.tokens_per_s_per_gpu):
        t.add_row(r.name, str(r.tp), str(r.batch), f"{r.predicted_stall_us:,.0f}", f"{r.interactivity:.0f}",
                  f"{r.tokens_per_s_per_gpu:,.0f}", f"{r.host_bytes_per_gpu / GiB:,.1f}",
                  f"{sum(x['hbm_bytes_per_gpu'] for x in r.layers) / GiB:,.1f}",
                  "-" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.0%}")
        for x in r.layers:
            t.add_row(f"  layer {x['layer']} on {x['placement']}", "", "", f"{x['stall_us']:,.0f}", "", "",
                      f"{x['dram_bytes_per_gpu'] / GiB:,.1f}", f"{x['hbm_bytes_per_gpu'] / GiB:,.1f}", "")
    console.print(t)


def _print_cache_sweep(console: Any, plan: Plan) -> None:
    """The nvme placement at each DRAM cache size: the operator's 'I have this much DRAM'."""
    from rich import box
    from rich.table import Table

    if not plan.cache_sweep:
        return
    tp = plan.cache_sweep[0].tp
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
              title=f"NVMe behind a DRAM row cache of each size (TP={tp}, per replica; {plan.workload.curve_label})",
              title_justify="left")
    for col in ("DRAM cache", "hit", "batch", "stall us", "tok/s/user", "tok/s/GPU", "note"):
        t.add_column(col, justify="left" if col == "note" else "right", no_wrap=col != "note")
    given, e = plan.workload.cache_bytes, plan.model.engram
    for r in plan.cache_sweep:
        size = r.cache_bytes_per_gpu * r.tp
        ok = r.fits and r.batch > 0
        asked = given is not None and abs(size - min(given, e.table_bytes)) < e.row_bytes
        note = "; ".join([*(["--cache-bytes"] if asked else []), *r.why_not[:1], *([r.cache_note] if r.cache_note else [])])
        t.add_row(format_bytes(size), f"{(r.cache_hit_rate or 0):.0%}", str(r.batch) if ok else "-",
                  f"{r.predicted_stall_us:,.0f}" if ok else "-", f"{r.interactivity:.0f}" if ok else "-",
                  f"{r.tokens_per_s_per_gpu:,.0f}" if ok else "-", note)
    console.print(t)


def _print_memory(console: Any, plan: Plan) -> None:
    """What the host memory of the best dram and nvme options costs, and the plain verdict."""
    a, g = plan.assumptions, plan.gpu
    console.print(f"[bold]Memory[/] (assumed list prices: DRAM ${a.dram_price_per_gib:g}/GiB, NVMe "
                  f"${a.nvme_price_per_tb:g}/TB, paid off over {a.hardware_years:g} years; GPUs "
                  f"${g.price_per_hour:.2f}/GPU-hour; --dram-price, --nvme-price, --price):")
    for name in ("dram", "nvme"):
        pairs = [(r, c) for r, c in zip(plan.placements, plan.costs) if r.name == name and r.fits]
        if not pairs:
            continue
        r, c = max(pairs, key=lambda rc: rc[0].tokens_per_s_per_gpu)
        held = (f"{format_bytes(c.dram_bytes)} DRAM" + (f" + {format_bytes(c.nvme_bytes)} NVMe" if c.nvme_bytes else ""))
        console.print(f"  - {name} at TP={r.tp}: {held} = ${c.dollars:,.0f} once, {c.gpu_hours:,.0f} hours of its "
                      f"{r.tp} GPU(s); ${c.dollars_per_hour:.3f}/hour against ${c.gpu_dollars_per_hour:.2f}/hour of GPUs")
    if plan.verdict:
        console.print(f"  {plan.verdict}")
