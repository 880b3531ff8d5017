"""``bench``: the serving benchmark, every tier and cache state on the throughput-interactivity plane."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..units import format_bytes, parse_size

DEFAULT_PRESET = "deepseek-v4.1-flash"
DEFAULT_SCALE = 0.002  # 386 MiB: made in a few seconds, still far beyond the CPU caches


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="serving benchmark: throughput vs interactivity per tier and cache state",
        description="Serve real-text requests (continuous batching, a small real transformer, rows "
        "prefetched each step) from each tier and cache state at each concurrency; print a markdown "
        "table, write JSON and a throughput-interactivity frontier plot. With no options: a small "
        "V4.1-Flash-layout table made once in the cache folder, the standard library as corpus, "
        "about 2 minutes.",
    )
    t = p.add_argument_group("table")
    t.add_argument("--table", help="an existing table file (default: make one in the cache folder)")
    t.add_argument("--preset", default=DEFAULT_PRESET, help=f"layout of the table to make (default {DEFAULT_PRESET})")
    t.add_argument("--scale", type=float, default=DEFAULT_SCALE,
                   help=f"fraction of the preset's table size to make (default {DEFAULT_SCALE})")
    t.add_argument("--seed", type=int, default=7, help="seed of the table's random rows and of the workload (default 7)")
    r = p.add_argument_group("runs")
    r.add_argument("--tiers", default="memory,direct,mmap", help="comma list of memory, pinned, direct, mmap (default memory,direct,mmap)")
    r.add_argument("--cache-states", default="cold,warm,mixed", help="comma list of cold, warm, mixed (default all)")
    r.add_argument("--concurrency", default="1,8,32", help="comma list of requests in flight (default 1,8,32)")
    r.add_argument("--seconds", type=float, default=2.0, help="measured seconds per run (default 2)")
    r.add_argument("--repeats", type=int, default=1, help="run every point this many times; medians reported (default 1)")
    r.add_argument("--warmup-seconds", type=float, default=None, help="warm-up seconds for warm and mixed (default: --seconds)")
    m = p.add_argument_group("memory")
    m.add_argument("--dram-budget", default="20%", help="DRAM the store may hold: bytes, 2G, or %% of the table (default 20%%); 'none' for no budget")
    m.add_argument("--cache-bytes", default=None, help="the direct tier's DRAM row cache (default: the whole budget)")
    m.add_argument("--fast-cache-bytes", default="0", help="a fast cache above it (GPU memory when there is one; default 0)")
    m.add_argument("--policy", default="lfu", help="row cache eviction policy (default lfu)")
    w = p.add_argument_group("workload")
    w.add_argument("--corpus", action="append", default=None, metavar="DIR",
                   help="measured corpus: stdlib, docs, zipf or a folder of text files; repeatable (default stdlib)")
    w.add_argument("--mixed-corpus", default=None, help="warm-up corpus of the mixed state (default: docs when installed, else zipf)")
    w.add_argument("--workload", default="agent", choices=["agent", "chat"], help="agentic coding sessions or single chat turns (default agent)")
    w.add_argument("--prompt-tokens", type=int, default=512, help="first context of a request (default 512)")
    w.add_argument("--answer-tokens", type=int, default=64, help="tokens decoded per turn (default 64)")
    w.add_argument("--turns", type=int, default=3, help="agent turns after the first context (default 3)")
    w.add_argument("--tool-tokens", type=int, default=256, help="tool output appended per agent turn (default 256)")
    w.add_argument("--corpus-tokens", type=int, default=400_000, help="tokens read from each corpus (default 400000)")
    w.add_argument("--max-step-tokens", type=int, default=256, help="token budget of a step (default 256)")
    w.add_argument("--lookahead-tokens", type=int, default=None,
                   help="prefill tokens fetched ahead of their step (default: two steps' budget; 0: off)")
    b = p.add_argument_group("backbone")
    b.add_argument("--layers", type=int, default=None, help="transformer layers (default: last Engram layer + 2)")
    b.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    b.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    b.add_argument("--threads", type=int, default=None, help="torch threads for the backbone (default: cores - 1)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="engram-bench", help="folder for results.json and frontier.png (default ./engram-bench)")
    o.add_argument("--json", default=None, metavar="PATH", help="JSON path (default OUT/results.json)")
    o.add_argument("--plot", default=None, metavar="PATH", help="frontier PNG path (default OUT/frontier.png)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def _list(text: str, allowed: tuple[str, ...] | None, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"--{what} is empty")
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise ValueError(f"--{what}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
    return items


def _concurrency(text: str) -> list[int]:
    try:
        values = [int(x) for x in _list(text, None, "concurrency")]
    except ValueError as exc:
        raise ValueError(f"--concurrency needs integers like 1,8,32: {exc}") from None
    if any(v < 1 for v in values):
        raise ValueError("--concurrency values must be >= 1")
    return values


def default_table(preset: str, scale: float, seed: int, progress: bool) -> Path:
    """The cached table for (preset, scale, seed), made on first use."""
    from ..config import EngramConfig
    from ..table import make_random_table
    from ..tokenizer import engram_cache_dir

    path = engram_cache_dir() / "tables" / f"{preset}-x{scale:g}-seed{seed}.table"
    if path.exists():
        return path
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


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.corpus import Corpus, docs_root, load_corpus
    from ..bench.report import comparisons, comparisons_table, frontier_plot, markdown_table, write_json
    from ..bench.runner import CACHE_STATES, TIERS, BenchSettings, Corpora, check_budget, run_sweep
    from ..bench.workload import WorkloadShape
    from ..machine import machine_facts
    from ..table.format import read_header
    from ..tokenizer import cached_token_map, load_tokenizer

    tiers = _list(args.tiers, TIERS, "tiers")
    states = _list(args.cache_states, CACHE_STATES, "cache-states")
    concurrency = _concurrency(args.concurrency)
    if args.seconds <= 0:
        raise ValueError("--seconds must be > 0")
    if args.lookahead_tokens is not None and args.lookahead_tokens < 0:
        raise ValueError("--lookahead-tokens must be >= 0 (0 turns lookahead off)")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    show = not args.no_progress and sys.stderr.isatty()
    table = Path(args.table) if args.table else default_table(args.preset, args.scale, args.seed, show)
    if not table.exists():
        raise FileNotFoundError(f"no table at {table}: make one with engram-offload make-table")
    header = read_header(table)
    table_bytes = header.layout.num_rows * header.layout.row_bytes
    budget = None if args.dram_budget.lower() == "none" else parse_size(args.dram_budget, table_bytes)
    cache_bytes = parse_size(args.cache_bytes, table_bytes) if args.cache_bytes else (budget or 0)
    if "direct" in tiers and cache_bytes == 0 and budget is None:
        print("note: direct runs without a row cache (no --dram-budget and no --cache-bytes)", file=sys.stderr)
    shape = WorkloadShape(args.workload, args.prompt_tokens, args.answer_tokens, args.turns, args.tool_tokens)
    settings = BenchSettings(
        table=str(table), seconds=args.seconds,
        warmup_seconds=args.seconds if args.warmup_seconds is None else args.warmup_seconds,
        cache_bytes=cache_bytes, fast_cache_bytes=parse_size(args.fast_cache_bytes, table_bytes),
        policy=args.policy, dram_budget=budget, shape=shape, max_step_tokens=args.max_step_tokens,
        lookahead_tokens=args.lookahead_tokens,
        layers=args.layers, hidden=args.hidden, heads=args.heads,
        threads=args.threads or max(1, (os.cpu_count() or 2) - 1), seed=args.seed,
    )
    check_budget(settings)

    t0 = time.perf_counter()
    tokenizer = load_tokenizer()
    token_map = cached_token_map()
    specs = args.corpus or ["stdlib"]
    parts = [load_corpus(s, tokenizer, max_tokens=args.corpus_tokens, seed=args.seed) for s in specs]
    measured_all = Corpus("+".join(c.name for c in parts), tuple(d for c in parts for d in c.documents),
                          "; ".join(c.source for c in parts))
    warm, measured = measured_all.split()
    mixed_spec = args.mixed_corpus or ("docs" if docs_root() is not None and "docs" not in specs else "zipf")
    mixed = load_corpus(mixed_spec, tokenizer, max_tokens=args.corpus_tokens, seed=args.seed)
    corpora = Corpora(measured=measured, warm=warm, mixed=mixed)
    print(f"table {table} ({format_bytes(table_bytes)}, layout {header.config.name}); "
          f"DRAM budget {format_bytes(budget) if budget is not None else 'none'}, direct row cache "
          f"{format_bytes(cache_bytes)} ({args.policy}); corpus {measured_all.name} "
          f"({measured.tokens:,} measured + {warm.tokens:,} warm-up tokens), mixed warm-up {mixed.name}; "
          f"{len(tiers) * len(states) * len(concurrency) * args.repeats} runs of {args.seconds:g} s "
          f"(corpora ready in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)

    with _Progress(show) as progress:
        runs = run_sweep(settings, tiers, states, concurrency, corpora, token_map, repeats=args.repeats,
                         progress=progress.run, on_step=progress.step)
    ratios = comparisons(runs)
    document = {
        "kind": "engram-offload serving benchmark",
        "command": "engram-offload " + " ".join(getattr(args, "argv", ["bench"])),
        "machine": machine_facts(table),
        "table": {"path": str(table), "bytes": table_bytes, "rows": header.layout.num_rows,
                  "row_bytes": header.layout.row_bytes, "layout": header.config.name,
                  "layer_ids": list(header.config.layer_ids)},
        "settings": settings.to_dict(),
        "corpora": {"measured": measured.name, "measured_source": measured.source,
                    "measured_tokens": measured.tokens, "warm_tokens": warm.tokens,
                    "mixed": mixed.name, "mixed_source": mixed.source},
        "runs": runs,
        "comparisons": ratios,
        "wall_seconds": time.perf_counter() - t0,
    }
    out = Path(args.out)
    json_path = write_json(args.json or out / "results.json", document)
    plot_path = frontier_plot(runs, args.plot or out / "frontier.png",
                              title=f"{header.config.name}, {format_bytes(table_bytes)} table, "
                                    f"budget {format_bytes(budget) if budget is not None else 'none'}")
    print(markdown_table(runs))
    if ratios:
        print()
        print(comparisons_table(ratios))
    print(f"\nwrote {json_path} and {plot_path}")
    return 0
