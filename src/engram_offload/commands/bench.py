"""``bench`` (the serving benchmark: every tier and cache state on the throughput-interactivity
plane) and the ``bench-tier`` command's arguments and body (random-row reads from one tier).

Numbers are checked as they are parsed (finite, in range): a bad one is a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from ..atomic import write_json_atomic
from ..bench.report import MIN_STEPS, MIN_USERS
from ..tiers.policy import DEFAULT_QUEUE_DEPTH
from ..units import (
    MAX_THREADS,
    format_bytes,
    fraction,
    int_in_range,
    non_negative_float,
    non_negative_int,
    parse_size,
    positive_float,
    positive_int,
    size_or_percent_arg,
)
from . import UsageError
from .core import MemoryNeed, check_memory_needs, check_thread_stacks
from .options import (
    add_cache_bytes,
    add_json,
    add_json_out,
    add_policy,
    gpu_arg,
    local_tier_arg,
    model_preset_arg,
    preset_arg,
    removed_option,
)

DEFAULT_PRESET = "deepseek-v4.1-flash"
DEFAULT_SCALE = 0.002  # 386 MiB: made in a few seconds, still far beyond the CPU caches
DROP_ALL_HELP = ("with a cold start, also empty the whole machine's page cache (/proc/sys/vm/drop_caches, "
                 "as root): every process's cached files, not only the table's")


def _budget_arg(text: str) -> str:
    """argparse type: ``none`` or a size or percentage of the table (checked now, read later)."""
    return text if text.strip().lower() == "none" else size_or_percent_arg(text)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="serving benchmark: throughput vs interactivity per tier and cache state",
        description="Serve real-text requests (continuous batching, a small real transformer or a "
        "modeled GPU's step time, rows prefetched each step) from each tier and cache state at each concurrency; print a markdown "
        "table, write JSON and a throughput-interactivity frontier plot. With no options: a small "
        "V4.1-Flash-layout table made once in the cache folder, the standard library as corpus, "
        "about 2 minutes.",
    )
    t = p.add_argument_group("table")
    t.add_argument("--table", help="an existing table file (default: make one in the cache folder)")
    t.add_argument("--preset", default=DEFAULT_PRESET, type=preset_arg, help=f"layout of the table to make (default {DEFAULT_PRESET})")
    t.add_argument("--scale", type=fraction, default=DEFAULT_SCALE,
                   help=f"fraction of the preset's table size to make (default {DEFAULT_SCALE})")
    t.add_argument("--seed", type=int, default=7, help="seed of the table's random rows and of the workload (default 7)")
    r = p.add_argument_group("runs")
    r.add_argument("--tiers", default="memory,direct,mmap",
                   help="comma list of memory, pinned, shared, direct, mmap, remote, or per-layer placements "
                   "such as 1=memory/14=direct (each Engram layer on its tier) (default memory,direct,mmap)")
    r.add_argument("--cache-states", default="cold,warm,mixed", help="comma list of cold, warm, mixed (default all)")
    r.add_argument("--drafts", default="none",
                   help="draft tokens whose rows each decode step fetches a step early: none (default), ngram[:K] "
                   "(prompt lookup: the K tokens after the last earlier match of the sequence's suffix) or model[:K] "
                   "(the trained model's next K tokens, standing in for an MTP head); K default 1")
    r.add_argument("--draft-model", metavar="DIR", default=None,
                   help="the model folder --drafts model[:K] predicts with (default: the shipped trained model)")
    r.add_argument("--concurrency", default="1,8,32", help="comma list of requests in flight (default 1,8,32)")
    r.add_argument("--seconds", type=positive_float, default=2.0, help="measured seconds per run (default 2)")
    r.add_argument("--min-steps", type=positive_int, default=MIN_STEPS,
                   help=f"steps a point must measure to be compared (default {MIN_STEPS}; fewer: marked 'few')")
    r.add_argument("--min-users", type=positive_int, default=MIN_USERS,
                   help=f"users whose output rate a point must measure to be compared (default {MIN_USERS})")
    r.add_argument("--repeats", type=positive_int, default=1, help="run every point this many times; medians reported (default 1)")
    r.add_argument("--warmup-seconds", type=non_negative_float, default=None, help="warm-up seconds for warm and mixed (default: --seconds)")
    r.add_argument("--drop-all-caches", action="store_true", help=DROP_ALL_HELP)
    r.add_argument("--ranks", type=positive_int, default=1,
                   help="rank processes serving each run (default 1): resident tiers share one copy of the table "
                   "(tier shared), direct goes through one row server; with --tp, groups of --tp ranks split the "
                   "columns (docs/ranks.md)")
    m = p.add_argument_group("memory")
    m.add_argument("--dram-budget", default="20%", type=_budget_arg, help="DRAM the store may hold: bytes, 2G, or %% of the table (default 20%%); 'none' for no budget")
    add_cache_bytes(m, None, what="the DRAM row cache of the direct and remote tiers", shown="the whole budget")
    m.add_argument("--fast-cache-bytes", default="0", type=size_or_percent_arg, metavar="SIZE",
                   help="a fast cache above it (GPU memory when there is one): bytes, 512M, 2G or %% of the table (default 0)")
    add_policy(m)
    q = p.add_argument_group("pool (the remote tier)")
    q.add_argument("--pool", default=None, metavar="URL",
                   help="the Redis pool the remote tier reads from, redis://host:port[,host:port...]; the table "
                   "is published to it before the remote runs (default: a loopback pool started for the run "
                   "and stopped at its end)")
    q.add_argument("--pool-nodes", type=positive_int, default=1, metavar="N",
                   help="servers of the loopback pool started here (default 1, one server's cost on a small "
                   "machine; pool serve's 3 make a Redis Cluster)")
    w = p.add_argument_group("workload")
    w.add_argument("--corpus", action="append", default=None, metavar="DIR",
                   help="measured corpus: stdlib, docs, zipf or a folder of text files; repeatable (default stdlib)")
    w.add_argument("--mixed-corpus", default=None, help="warm-up corpus of the mixed state (default: docs when installed, else zipf)")
    w.add_argument("--workload", default="agent", choices=["agent", "chat"], help="agentic coding sessions or single chat turns (default agent)")
    w.add_argument("--prompt-tokens", type=positive_int, default=512, help="first context of a request (default 512)")
    w.add_argument("--answer-tokens", type=positive_int, default=64, help="tokens decoded per turn (default 64)")
    w.add_argument("--turns", type=non_negative_int, default=3, help="agent turns after the first context (default 3)")
    w.add_argument("--tool-tokens", type=non_negative_int, default=256, help="tool output appended per agent turn (default 256)")
    w.add_argument("--corpus-tokens", type=positive_int, default=400_000, help="tokens read from each corpus (default 400000)")
    w.add_argument("--max-step-tokens", type=positive_int, default=256, help="token budget of a step (default 256)")
    w.add_argument("--lookahead-tokens", type=non_negative_int, default=None,
                   help="prefill tokens fetched ahead of their step (default: two steps' budget; 0: off)")
    b = p.add_argument_group("backbone")
    b.add_argument("--backbone", default="cpu", choices=["cpu", "modeled"],
                   help="cpu: a small real transformer computed on this machine's cores (default); modeled: "
                   "sleep a GPU's roofline step time (--gpu, --tp), leaving the cores to the fetch path")
    b.add_argument("--schedule", default="prefetch", choices=["prefetch", "in-graph", "cpu-wait"],
                   help="where the modeled step waits for its rows: prefetch (this benchmark's Prefetcher: prefill "
                   "rows fetched steps ahead, decode rows from forward entry, each layer waiting for its own; "
                   "default), in-graph (the vLLM plugin under FULL CUDA graphs: every row read from the step's "
                   "forward entry, the GPU waiting before each Engram layer for its rows) or cpu-wait (the plugin "
                   "under eager or piecewise graphs: every layer's rows waited for before the first Engram layer, "
                   "plus --eager-us a step)")
    b.add_argument("--eager-us", type=non_negative_float, default=None,
                   help="what eager or piecewise graphs cost a step against FULL graphs under --schedule cpu-wait, "
                   "for tiers with a host-read layer (default: a modeled 400 us, docs/planner.md)")
    b.add_argument("--gpu", default="b300", type=gpu_arg, help="the modeled backbone's GPU, as in 'plan' (default b300)")
    b.add_argument("--tp", type=positive_int, default=1,
                   help="the modeled backbone's tensor-parallel degree, and with --ranks the ranks that split "
                   "each layer's columns (default 1)")
    b.add_argument("--backbone-preset", dest="model", type=model_preset_arg, default=None,
                   help="the modeled backbone's named model, as plan's --preset (default: the table's layout)")
    removed_option(b, "--model", "--backbone-preset")
    b.add_argument("--nvme-iops", type=positive_float, default=None,
                   help="this machine's random reads/s at the direct tier's read size (e.g. fio --bs=512) for the "
                   "planner's predicted stall (default: the GPU server's drives)")
    b.add_argument("--nvme-bytes-per-s", type=positive_float, default=None,
                   help="and its read bandwidth (e.g. fio --bs=4k; default: --nvme-iops x 4 KiB)")
    b.add_argument("--nvme-latency-us", type=positive_float, default=None,
                   help="and a 4 KiB read's latency at queue depth 1 (fio --iodepth=1), which paces the mmap "
                   "tier's page faults in the prediction (default: the GPU server's drives, 80 us)")
    b.add_argument("--layers", type=positive_int, default=None, help="transformer layers (default: last Engram layer + 2)")
    b.add_argument("--hidden", type=positive_int, default=256, help="hidden size (default 256)")
    b.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    b.add_argument("--threads", type=int_in_range(1, MAX_THREADS), default=None,
                   help="torch threads for the backbone (default: cores - 1)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="engram-bench", help="folder for results.json and frontier.png (default ./engram-bench)")
    add_json_out(o, "OUT/results.json")
    removed_option(o, "--json", "--json-out")
    o.add_argument("--plot", default=None, metavar="PATH", help="frontier PNG path (default OUT/frontier.png)")
    o.add_argument("--force", action="store_true", help="replace the JSON and PNG files if they exist (default: refuse)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def _list(text: str, allowed: tuple[str, ...] | None, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise UsageError(f"--{what} is empty")
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise UsageError(f"--{what}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    return items


def _concurrency(text: str) -> list[int]:
    try:
        values = [int(x) for x in _list(text, None, "concurrency")]
    except ValueError as exc:
        raise UsageError(f"--concurrency needs integers like 1,8,32: {exc}") from None
    if any(v < 1 for v in values):
        raise UsageError("--concurrency values must be >= 1")
    return values


def _eager_us(args: argparse.Namespace) -> float:
    """``--eager-us`` (default the planner's), refused with flags the plugin's schedules cannot honour."""
    from ..planner.assumptions import DEFAULT_ASSUMPTIONS

    if args.schedule != "prefetch":
        if args.backbone != "modeled":
            raise UsageError(f"--schedule {args.schedule} needs --backbone modeled")
        if args.drafts != "none" or args.lookahead_tokens:
            raise UsageError(f"--schedule {args.schedule} reads each step's rows from its own forward entry: "
                             "drop --drafts and --lookahead-tokens (nothing is fetched ahead)")
    elif args.eager_us is not None:
        raise UsageError("--eager-us applies to --schedule cpu-wait only")
    return DEFAULT_ASSUMPTIONS.eager_us if args.eager_us is None else args.eager_us


def default_table(preset: str, scale: float, seed: int, progress: bool) -> Path:
    """The cached table for (preset, scale, seed), made on first use and made again when this
    version cannot read it (an older format, a damaged file: it is derived, never the user's)."""
    from ..engram.config import EngramConfig
    from ..engram.tokenizer import engram_cache_dir
    from ..errors import TableFormatError
    from ..table import make_random_table, read_header

    path = engram_cache_dir() / "tables" / f"{preset}-x{scale:g}-seed{seed}.table"
    if path.exists():
        try:
            read_header(path)
            return path
        except TableFormatError as exc:
            print(f"remaking the benchmark table: {exc}", file=sys.stderr)
    config = EngramConfig.from_name(preset).scaled(scale)
    print(f"making the benchmark table {path} ({format_bytes(config.num_rows * config.row_bytes)}, once)",
          file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    make_random_table(path, config, seed, progress=progress or None)
    return path


class _Progress:
    """A rich bar over the runs, the current run and phase in its description."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.task: Any = None
        self.label = ""

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self.bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=False)
            self.bar.__enter__()
            self.task = self.bar.add_task("runs", total=1)
        return self

    def run(self, label: str, done: int, total: int) -> None:
        self.label = label
        if self.bar is not None:
            self.bar.update(self.task, description=f"run {label}", completed=done, total=total)
        elif not self.enabled and label != "done":
            print(f"[{done + 1}/{total}] {label}", file=sys.stderr, flush=True)

    def step(self, phase: str, elapsed: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=f"run {self.label} ({phase} {elapsed:4.1f} s)")

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


@dataclass
class _Plan:
    """What ``bench`` will run: the table, the sweep's points, the settings of every run."""

    table: Path
    header: Any  # the table's TableHeader
    budget: int | None
    tiers: list[str]
    states: list[str]
    concurrency: list[int]
    settings: Any  # bench.runner.BenchSettings

    @property
    def table_bytes(self) -> int:
        return self.header.layout.num_rows * self.header.layout.row_bytes


def _plan(args: argparse.Namespace, show: bool) -> _Plan:
    """Check the options and find (or make) the table: everything ``bench`` needs to run."""
    from ..bench.runner import CACHE_STATES, CACHED_TIERS, BenchSettings, check_budget, check_tiers
    from ..bench.workload import WorkloadShape
    from ..table.format import read_header

    try:
        tiers = check_tiers(args.tiers)  # tier names or per-layer placements (1=memory/14=direct)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.ranks > 1:
        from ..bench.ranks import RANK_TIERS

        _list(args.tiers, RANK_TIERS, "tiers (with --ranks)")
        if args.ranks % args.tp:
            raise UsageError(f"--ranks ({args.ranks}) must be a multiple of --tp ({args.tp})")
    states = _list(args.cache_states, CACHE_STATES, "cache-states")
    concurrency = _concurrency(args.concurrency)
    table = Path(args.table) if args.table else default_table(args.preset, args.scale, args.seed, show)
    if not table.exists():
        raise FileNotFoundError(f"no table at {table}: make one with engram-offload make-table")
    header = read_header(table)
    table_bytes = header.layout.num_rows * header.layout.row_bytes
    budget = None if args.dram_budget.lower() == "none" else parse_size(args.dram_budget, table_bytes)
    cache_bytes = parse_size(args.cache_bytes, table_bytes) if args.cache_bytes else (budget or 0)
    for tier in CACHED_TIERS:
        if tier in tiers and cache_bytes == 0 and budget is None:
            print(f"note: {tier} runs without a row cache (no --dram-budget and no --cache-bytes)", file=sys.stderr)
    settings = BenchSettings(
        table=str(table), seconds=args.seconds,
        warmup_seconds=args.seconds if args.warmup_seconds is None else args.warmup_seconds,
        cache_bytes=cache_bytes, fast_cache_bytes=parse_size(args.fast_cache_bytes, table_bytes),
        policy=args.policy, dram_budget=budget,
        shape=WorkloadShape(args.workload, args.prompt_tokens, args.answer_tokens, args.turns, args.tool_tokens),
        max_step_tokens=args.max_step_tokens, lookahead_tokens=args.lookahead_tokens,
        layers=args.layers, hidden=args.hidden, heads=args.heads,
        threads=args.threads or max(1, (os.cpu_count() or 2) - 1), seed=args.seed,
        drop_all_caches=args.drop_all_caches,
        backbone=args.backbone, schedule=args.schedule, eager_us=_eager_us(args), gpu=args.gpu, tp=args.tp, model=args.model, nvme_iops=args.nvme_iops,
        nvme_bytes_per_s=args.nvme_bytes_per_s, nvme_latency_us=args.nvme_latency_us, pool=args.pool,
        drafts=args.drafts, draft_predictor=_draft_predictor(args),
    )
    check_budget(settings)
    check_memory_needs(_bench_needs(args, header, cache_bytes, max(concurrency)))
    from ..bench.drafts import make_drafter

    make_drafter(settings.drafts, settings.draft_predictor)  # a bad --drafts fails here, before any run
    if args.backbone == "modeled":  # a bad --gpu, --model or --tp fails here, before any run
        from ..bench.modeled import modeled_backbone

        modeled_backbone(header.config, args.gpu, args.tp, args.model)
    _outputs(args)  # the last refusal before any run
    return _Plan(table, header, budget, tiers, states, concurrency, settings)


def _draft_predictor(args: argparse.Namespace) -> Any:
    """The trained model's predictor for --drafts model[:K] (loaded here, so a bad --draft-model
    fails before any run); None for the other kinds."""
    from ..bench.drafts import draft_kind

    kind, _ = draft_kind(args.drafts)
    if args.draft_model is not None and kind != "model":
        raise UsageError(f"--draft-model is for --drafts model[:K], not --drafts {args.drafts}")
    if kind != "model":
        return None
    from ..model.drafts import ModelPredictor

    predictor = ModelPredictor(args.draft_model)
    try:
        predictor.model()
    except (OSError, ValueError) as exc:
        raise UsageError(f"--draft-model {args.draft_model or '(the shipped model)'}: {exc}") from None
    return predictor


def _bench_needs(args: argparse.Namespace, header: Any, cache_bytes: int, concurrency: int) -> list[MemoryNeed]:
    """What ``bench``'s size options cost in memory, each counted at least."""
    config, row = header.config, header.layout.row_bytes
    context = args.prompt_tokens + args.turns * (args.answer_tokens + args.tool_tokens)
    layers = args.layers or max(config.layer_ids) + 2
    needs = [
        MemoryNeed(f"--cache-bytes {args.cache_bytes or args.dram_budget}", cache_bytes, "the row cache"),
        MemoryNeed(f"--concurrency {concurrency}" if concurrency / 32 > context / 1472 else
                   f"--prompt-tokens {args.prompt_tokens}",  # the one furthest above its default
                   concurrency * context * config.rows_per_token * 8,
                   f"{concurrency:,} requests x {context:,} tokens x {config.rows_per_token} row ids x 8 B"),
        MemoryNeed(f"--max-step-tokens {args.max_step_tokens}", args.max_step_tokens * config.rows_per_token * row,
                   f"{args.max_step_tokens:,} tokens x {config.rows_per_token} rows x {row} B"),
    ]
    if args.backbone == "cpu":
        needs.append(MemoryNeed(f"--hidden {args.hidden}" if args.hidden > layers else f"--layers {layers}",
                                layers * 12 * args.hidden * args.hidden * 4,
                                f"{layers:,} layers x 12 x {args.hidden:,}^2 weights x 4 B"))
    return needs


def _corpora(args: argparse.Namespace) -> tuple[Any, Any]:
    """The measured corpus (all of it) and the sweep's ``Corpora`` (measured, warm, mixed)."""
    from ..bench.corpus import Corpus, docs_root, load_corpus
    from ..bench.runner import Corpora
    from ..engram.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    specs = args.corpus or ["stdlib"]
    parts = [load_corpus(s, tokenizer, max_tokens=args.corpus_tokens, seed=args.seed) for s in specs]
    measured_all = Corpus("+".join(c.name for c in parts), tuple(d for c in parts for d in c.documents),
                          "; ".join(c.source for c in parts))
    warm, measured = measured_all.split()
    mixed_spec = args.mixed_corpus or ("docs" if docs_root() is not None and "docs" not in specs else "zipf")
    mixed = load_corpus(mixed_spec, tokenizer, max_tokens=args.corpus_tokens, seed=args.seed)
    return measured_all, Corpora(measured=measured, warm=warm, mixed=mixed)


def _describe(plan: _Plan, args: argparse.Namespace, measured_all: Any, corpora: Any, seconds: float) -> str:
    """One line saying what is about to run."""
    budget = format_bytes(plan.budget) if plan.budget is not None else "none"
    runs = len(plan.tiers) * len(plan.states) * len(plan.concurrency) * args.repeats
    return (f"table {plan.table} ({format_bytes(plan.table_bytes)}, layout {plan.header.config.name}); "
            f"DRAM budget {budget}, row cache {format_bytes(plan.settings.cache_bytes)} ({args.policy}); "
            f"corpus {measured_all.name} ({corpora.measured.tokens:,} measured + {corpora.warm.tokens:,} "
            f"warm-up tokens), mixed warm-up {corpora.mixed.name}; {runs} runs of {args.seconds:g} s "
            f"(corpora ready in {seconds:.1f} s)")


def _document(plan: _Plan, args: argparse.Namespace, corpora: Any, runs: list[dict[str, Any]],
              ratios: list[dict[str, Any]], limits: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """The results JSON."""
    from ..machine import machine_facts

    header, measured, mixed = plan.header, corpora.measured, corpora.mixed
    return {
        "kind": "engram-offload serving benchmark",
        "command": "engram-offload " + " ".join(getattr(args, "argv", ["bench"])),
        "machine": machine_facts(plan.table),
        "table": {"path": str(plan.table), "bytes": plan.table_bytes, "rows": header.layout.num_rows,
                  "row_bytes": header.layout.row_bytes, "layout": header.config.name,
                  "layer_ids": list(header.config.layer_ids)},
        "settings": plan.settings.to_dict(),
        "corpora": {"measured": measured.name, "measured_source": measured.source,
                    "measured_tokens": measured.tokens, "warm_tokens": corpora.warm.tokens,
                    "mixed": mixed.name, "mixed_source": mixed.source},
        "runs": runs,
        "comparisons": ratios,
        "stall_limits": limits,
        "wall_seconds": wall,
    }


@contextmanager
def _remote_pool(plan: _Plan, args: argparse.Namespace, show: bool) -> Iterator[Any]:
    """The sweep's settings, with the pool of the remote runs (``--pool``, or a loopback one
    started here and stopped on exit) holding the table, published now with progress."""
    if "remote" not in plan.tiers:
        yield plan.settings
        return
    from ..bench.remote import bench_pool, publish
    from ..pool.client import redact

    with bench_pool(args.pool, args.pool_nodes) as url:
        where = redact(url) if args.pool else f"a loopback pool of {args.pool_nodes} server(s) at {url}"
        print(f"publishing the table to {where} for the remote runs", file=sys.stderr, flush=True)
        done = publish(str(plan.table), url, progress=show)
        print(f"  table {done['fingerprint']}: {done['extents']} extents, {done['sent']} sent, "
              f"{done['skipped']} already there ({done['seconds']:.1f} s)", file=sys.stderr, flush=True)
        yield replace(plan.settings, pool=url)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.report import (
        comparisons,
        comparisons_table,
        frontier_plot,
        markdown_table,
        stall_limits,
        stall_limits_table,
        thin_points,
    )
    from ..bench.sweep import run_sweep
    from ..engram.tokenizer import cached_token_map

    show = not args.no_progress and sys.stderr.isatty()
    plan = _plan(args, show)
    t0 = time.perf_counter()
    measured_all, corpora = _corpora(args)
    token_map = cached_token_map()
    print(_describe(plan, args, measured_all, corpora, time.perf_counter() - t0), file=sys.stderr)
    with _remote_pool(plan, args, show) as settings:
        with _Progress(show) as progress:
            runs = run_sweep(settings, plan.tiers, plan.states, plan.concurrency, corpora, token_map,
                             repeats=args.repeats, progress=progress.run, on_step=progress.step,
                             ranks=args.ranks, tp=args.tp)
        plan.settings = settings
    sample = {"min_steps": args.min_steps, "min_users": args.min_users}
    ratios = comparisons(runs, **sample)
    limits = stall_limits(runs)
    json_path, plot_path = _outputs(args)  # again: made meanwhile, they are still not written over
    write_json_atomic(json_path, _document(plan, args, corpora, runs, ratios, limits, time.perf_counter() - t0),
                      replace=args.force)
    budget = format_bytes(plan.budget) if plan.budget is not None else "none"
    frontier_plot(runs, plot_path,
                              title=f"{plan.header.config.name}, {format_bytes(plan.table_bytes)} table, "
                                    f"budget {budget}", **sample)
    print(markdown_table(runs, **sample))
    if args.ranks > 1:
        from ..bench.report import ranks_table

        print()
        print(ranks_table(runs, plan.table_bytes, plan.budget))
    if ratios:
        print()
        print(comparisons_table(ratios))
    thin = thin_points(runs, **sample)
    if thin:
        print(f"ratios leave out points with too few steps or users: {', '.join(thin)}")
    print()
    print(stall_limits_table(limits))
    print(f"\nwrote {json_path} and {plot_path}")
    return 0


def _outputs(args: argparse.Namespace) -> tuple[Path, Path]:
    """The results JSON and the frontier plot's paths, refused when they exist (unless ``--force``)."""
    from ..table.safeio import refuse_existing

    out = Path(args.out)
    paths = Path(args.json_out or out / "results.json"), Path(args.plot or out / "frontier.png")
    for path in paths:
        refuse_existing(path, args.force, "benchmark result")
    return paths


# ---------------------------------------------------------------------- bench-tier
def add_bench_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench-tier`` command's arguments (its parser's ``func`` is ``cmd_bench_tier``)."""
    parser.add_argument("--table", required=True, help="the table file to read (required)")
    parser.add_argument("--tier", required=True, type=local_tier_arg(placements=True),
                        help="memory, pinned, mmap, direct or shared, or a placement such as 1=memory/14=direct "
                        "(required; the remote tier: bench --tiers remote)")
    parser.add_argument("--engine", default="auto", help="direct tier engine: auto, uring or threads (default auto)")
    parser.add_argument("--cold", action="store_true", help="evict the table file's pages from the page cache first")
    parser.add_argument("--drop-all-caches", action="store_true", help=DROP_ALL_HELP)
    parser.add_argument("--seconds", type=positive_float, default=10.0,
                        help="seconds to measure (default 10; with --prefetcher the cold phase, then half as long warm)")
    parser.add_argument("--queue-depth", type=positive_int, default=DEFAULT_QUEUE_DEPTH,
                        help=f"reads in flight (direct) or concurrent reader threads (mmap) (default {DEFAULT_QUEUE_DEPTH})")
    parser.add_argument("--batch", type=positive_int,
                        help=f"rows per random gather call (default {RANDOM_BATCH}; not with --prefetcher)")
    parser.add_argument("--callers", type=positive_int,
                        help="caller threads of random gathers (default: 1; mmap: the queue depth; not with --prefetcher)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random row ids (default 0)")
    add_cache_bytes(parser)
    add_policy(parser)
    add_json(parser)
    steps = parser.add_argument_group(
        "decode steps (--prefetcher)",
        "real-text decode steps through a Prefetcher from one caller instead of random gathers: a cold "
        "phase for --seconds, then, with --cache-bytes, a warm phase (every row a hit) that measures "
        "the CPU of a hit row, and so of a missed one")
    steps.add_argument("--prefetcher", action="store_true",
                       help="fetch the rows of real-text decode steps through the Prefetcher (begin_step, "
                       "rows of every Engram layer, end_step)")
    steps.add_argument("--sequences", type=positive_int,
                       help=f"sequences decoding one token each per step (default {PREFETCH_SEQUENCES})")
    steps.add_argument("--run-ahead", type=positive_int,
                       help=f"steps in flight: step N+1 is begun before step N is consumed (default {PREFETCH_RUN_AHEAD})")
    steps.add_argument("--corpus", metavar="DIR", help="the text: stdlib, docs or a folder of text files (default stdlib)")
    steps.add_argument("--corpus-tokens", type=positive_int,
                       help=f"tokens of the corpus to use (default {PREFETCH_CORPUS_TOKENS:,})")
    steps.add_argument("--check", action="store_true",
                       help="compare the rows of a sample of steps with the mmap tier's rows of the same ids")
    parser.set_defaults(func=cmd_bench_tier)


RANDOM_BATCH = 1024
# A GPU server's decode batch: V4.1-Flash decoding 256 sequences reads 256 x 48 = 12,288 row
# ids a step. Smaller batches spread a step's fixed host costs over fewer rows (README).
PREFETCH_SEQUENCES = 256
PREFETCH_RUN_AHEAD = 2
PREFETCH_CORPUS_TOKENS = 300_000
_PREFETCH_ONLY = ("sequences", "run_ahead", "corpus", "corpus_tokens", "check")


def _tier_bench_mode(args: argparse.Namespace) -> dict[str, Any]:
    """``run_tier_bench``'s mode arguments; a flag of the other mode is a usage error."""
    if not args.prefetcher:
        given = [f"--{name.replace('_', '-')}" for name in _PREFETCH_ONLY if getattr(args, name) not in (None, False)]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise UsageError(f"{', '.join(given)} only {verb} to decode steps: add --prefetcher")
        return {"batch": args.batch or RANDOM_BATCH, "callers": args.callers}
    for flag, value, instead in (("--batch", args.batch, "--sequences (sequences per decode step)"),
                                 ("--callers", args.callers, "--run-ahead (steps in flight from the one caller)")):
        if value is not None:
            raise UsageError(f"{flag} is for random gathers; with --prefetcher give {instead}")
    return {"prefetcher": True, "sequences": args.sequences or PREFETCH_SEQUENCES,
            "run_ahead": args.run_ahead or PREFETCH_RUN_AHEAD, "corpus": args.corpus or "stdlib",
            "corpus_tokens": args.corpus_tokens or PREFETCH_CORPUS_TOKENS, "check": args.check}


def cmd_bench_tier(args: argparse.Namespace) -> int:
    from ..bench.tier_bench import caller_threads, memory_needs, run_tier_bench
    from ..serving.layered import parse_placement
    from ..table.format import read_header
    from ..tiers import is_resident

    mode = _tier_bench_mode(args)
    header = read_header(args.table)
    layout = header.layout
    cache_bytes = parse_size(args.cache_bytes, whole=layout.num_rows * layout.row_bytes)
    placement = parse_placement(args.tier, header.config.layer_ids) if "=" in args.tier else None
    needs = memory_needs("direct" if placement else args.tier, layout.num_rows, layout.row_bytes,
                         header.config.rows_per_token, queue_depth=args.queue_depth, cache_bytes=cache_bytes,
                         **{k: v for k, v in mode.items() if k != "check"})
    if placement:  # the rows of its layers on resident tiers
        rows = sum(header.config.rows_per_layer[i] for i, tier in placement.items() if is_resident(tier))
        needs.append(("tier", 0, rows * layout.row_bytes,
                      f"{args.tier}: its resident layers' {rows:,} rows x {layout.row_bytes} B"))
    check_memory_needs([MemoryNeed(_flag(name, value, args), need, how) for name, value, need, how in needs])
    if not mode.get("prefetcher"):
        source, threads = caller_threads(args.tier, mode.get("callers"), args.queue_depth)
        check_thread_stacks(threads, _flag(source, threads, args))
    result = run_tier_bench(args.table, args.tier, seconds=args.seconds, queue_depth=args.queue_depth,
                            cold=args.cold, drop_all_caches=args.drop_all_caches, engine=args.engine,
                            seed=args.seed, cache_bytes=cache_bytes, policy=args.policy, **mode)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_tier_result(result, args, cache_bytes)
    if args.tier == "shared":
        from ..tiers.shared import segment_name

        print(f"note: the shared segment {segment_name(header)} stays in /dev/shm for the next process; "
              "engram-offload shared list shows it, shared drop removes it", file=sys.stderr)
    return 0


def _flag(name: str, value: int, args: argparse.Namespace) -> str:
    """A ``memory_needs`` setting as the operator gave it: ``--batch 1000000000``."""
    if name == "tier":
        return f"--tier {args.tier}"
    if name == "cache_bytes":
        return f"--cache-bytes {args.cache_bytes}"
    return f"--{name.replace('_', '-')} {value}"


def _print_tier_result(result: dict[str, Any], args: argparse.Namespace, cache_bytes: int) -> None:
    cold = f"cold ({', '.join(result['cold_method'])})" if args.cold else "warm"
    if result["mode"] == "prefetcher":
        print(f"{result['tier']} [{result['engine']}] {cold}, Prefetcher: {result['sequences']} sequences per "
              f"decode step, {result['run_ahead']} steps in flight, queue depth {args.queue_depth}, "
              f"corpus {result['corpus']['name']}")
        print(f"  {result['rows_per_s']:,.0f} rows/s, {result['misses_per_s']:,.0f} missed rows/s "
              f"(hit rate {result['hit_rate']:.1%}), {result['reads_per_s']:,.0f} reads/s, "
              f"{result['tokens_per_s']:,.0f} tokens/s")
        per_hit, per_miss = result["cpu_us_per_hit"], result["cpu_us_per_miss"]
        split = (f" (kernel {_us(result['kernel_cpu_us_per_miss'])}, process {_us(result['user_cpu_us_per_miss'])})"
                 if per_miss is not None else "")
        print(f"  CPU per missed row {_us(per_miss)}{split}, per hit row {_us(per_hit)}, hashing and dedup "
              f"{result['hash_dedup_cpu_us_per_token']:.2f} us per token; step p50 {result['step_ms_p50']:.2f} ms, "
              f"p99 {result['step_ms_p99']:.2f} ms")
        print(f"  the fetch loop alone (the Prefetcher's workers): {_us(result['fetch_cpu_us_per_miss'])} CPU per "
              f"missed row, {_us(result['fetch_cpu_us_per_hit'])} per hit row")
        if result["check"] is not None:
            print(f"  checked {result['check']['rows']:,} rows of {result['check']['steps']} steps against the "
                  f"{result['check']['reference']} tier: equal")
    else:
        print(f"{result['tier']} [{result['engine']}] {cold}, batch {result['batch']}, queue depth {args.queue_depth}")
        print(f"  {result['rows_per_s']:,.0f} rows/s, {result['reads_per_s']:,.0f} reads/s, "
              f"{result['bytes_read'] / result['seconds'] / 2**20:,.1f} MiB/s")
        print(f"  {result['cpu_us_per_read']:.2f} us CPU per read (kernel {result['kernel_cpu_us_per_read']:.2f}, "
              f"process {result['user_cpu_us_per_read']:.2f}), batch p50 {result['batch_ms_p50']:.2f} ms, "
              f"p99 {result['batch_ms_p99']:.2f} ms")
    if result["cache"] is not None:
        from ..cache.report import format_stats_table

        print(format_stats_table(result["cache"], title=f"{args.tier} + {cache_bytes:,} B {args.policy} cache"))


def _us(value: float | None) -> str:
    return "n/a (no cache)" if value is None else f"{value:.2f} us"
