"""``make-table``, ``convert``, ``verify``, ``bench-tier``: table files and tier speed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import EngramConfig
from ..errors import ChecksumError
from ..table.format import MAX_BLOCK_SIZE, TableLayout, check_config_fields
from ..units import fraction, int_in_range, non_negative_int, positive_int
from . import UsageError
from .core import load_hf_config

DEFAULT_QUEUE_DEPTH = 64


def register(sub: argparse._SubParsersAction) -> None:
    make = sub.add_parser(
        "make-table", help="write a table of seeded random rows (for benchmarks)",
        description="Write a table of seeded random rows at a preset's layout, optionally scaled down.",
    )
    make.add_argument("--preset", default="deepseek-v4.1-flash", help="layout (default deepseek-v4.1-flash)")
    size = make.add_mutually_exclusive_group(required=True)
    size.add_argument("--scale", type=fraction,
                      help="scale every prime-search start by F (0 < F <= 1) for a smaller table")
    size.add_argument("--full", action="store_true", help="the preset's full-size table (e.g. 189 GiB)")
    make.add_argument("--out", required=True, type=output_file, help="table file to write")
    make.add_argument("--seed", type=non_negative_int, default=0, help="random seed (same seed, same file)")
    make.add_argument("--block-size", type=int_in_range(1, MAX_BLOCK_SIZE), default=1 << 20,
                      help="checksum block bytes (default 1 MiB)")
    make.add_argument("--force", action="store_true", help="write even if the disk looks too full")
    make.add_argument("--no-progress", action="store_true", help="no progress bar")
    make.set_defaults(func=cmd_make_table)

    conv = sub.add_parser(
        "convert", help="convert a checkpoint's Engram embeddings (safetensors) into a table",
        description="Stream the Engram embeddings of a safetensors checkpoint into one table file. "
        "The layout comes from CHECKPOINT_DIR/config.json, or --preset / --config, or the flags.",
    )
    conv.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    conv.add_argument("--out", required=True, type=output_file, help="table file to write")
    conv.add_argument("--preset", help="a named layout (for checkpoints without config.json)")
    conv.add_argument("--config", help="a Hugging Face config.json with engram_* fields")
    conv.add_argument("--layer-ids", help="comma-separated Engram layer ids, e.g. 1,15")
    conv.add_argument("--max-ngram-size", type=positive_int)
    conv.add_argument("--n-heads", type=positive_int)
    conv.add_argument("--head-dim", type=positive_int)
    conv.add_argument("--prime-start", help="prime-search start, one value or one per order (comma-separated)")
    conv.add_argument("--row-format", help="store rows in this format (default: the config's)")
    conv.add_argument("--force", action="store_true", help="write even if the disk looks too full")
    conv.add_argument("--no-progress", action="store_true")
    conv.set_defaults(func=cmd_convert)

    ver = sub.add_parser("verify", help="check every block of a table against its checksum",
                         description="Check a table's header, size and every block's checksum; "
                         "or, with --clean DIR, remove the temporary files that dead writers left in DIR.")
    ver.add_argument("path", help="the table file (with --clean: a directory)")
    ver.add_argument("--clean", action="store_true",
                     help="remove temporary table files whose writer is gone from the directory PATH")
    ver.add_argument("--no-progress", action="store_true")
    ver.set_defaults(func=cmd_verify)

    bench = sub.add_parser(
        "bench-tier", help="measure random-row reads from one tier",
        description="Gather uniformly random rows from a table on one tier and report rows/s, "
        "reads/s and CPU time per read.",
    )
    bench.add_argument("--table", required=True)
    bench.add_argument("--tier", required=True, help="memory, pinned, mmap or direct")
    bench.add_argument("--engine", default="auto", help="direct tier engine: auto, uring or threads")
    bench.add_argument("--cold", action="store_true", help="drop the file's page cache first")
    bench.add_argument("--seconds", type=float, default=10.0)
    bench.add_argument("--queue-depth", type=int, default=DEFAULT_QUEUE_DEPTH,
                       help="reads in flight (direct) or concurrent reader threads (mmap)")
    bench.add_argument("--batch", type=int, default=1024, help="rows per gather call")
    bench.add_argument("--callers", type=int, help="caller threads (default: 1; mmap: the queue depth)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--cache-bytes", default="0",
                       help="DRAM row cache in front of the tier: bytes, 512M, 2G or a percentage of the "
                       "table (10%%); default none")
    bench.add_argument("--policy", default="lru", help="cache eviction policy (lru, lfu, ...)")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.set_defaults(func=cmd_bench_tier)


def output_file(text: str) -> str:
    """argparse type: a table file to write (not empty, not a directory, its directory exists)."""
    path = Path(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("the output path is empty: give a file name")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file name inside it")
    if not path.absolute().parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {path.absolute().parent} does not exist: create it first")
    return text


def check_disk_for(config: EngramConfig, out: str, what: str, force: bool) -> None:
    """Refuse (``NotEnoughResources``) a table that will not fit where ``out`` goes."""
    from ..machine import check_free_disk

    need = TableLayout.for_config(config).file_bytes
    check_free_disk(Path(out).absolute().parent, need, f"{what} of {out}", force=force)


def cmd_make_table(args: argparse.Namespace) -> int:
    from ..table import make_random_table

    config = EngramConfig.from_name(args.preset)
    if not args.full:
        config = config.scaled(args.scale)
    check_disk_for(config, args.out, "make-table", args.force)
    path = make_random_table(args.out, config, args.seed, block_size=args.block_size,
                             progress=False if args.no_progress else None)
    print(f"wrote {path}: {config.num_rows:,} rows of {config.row_bytes} bytes "
          f"({path.stat().st_size / 2**30:.2f} GiB), layout {config.name}")
    return 0


def _convert_config(args: argparse.Namespace) -> EngramConfig:
    flags = (args.layer_ids, args.max_ngram_size, args.n_heads, args.head_dim, args.prime_start)
    if args.config:
        config = load_hf_config(args.config)
    elif args.preset:
        config = EngramConfig.from_name(args.preset)
    elif all(v is not None for v in flags):
        try:
            starts = [int(s) for s in args.prime_start.split(",")]
            layer_ids = [int(i) for i in args.layer_ids.split(",")]
        except ValueError:
            raise UsageError("--layer-ids and --prime-start take comma-separated integers, e.g. 1,15") from None
        check_config_fields({"layer_ids": layer_ids, "max_ngram_size": args.max_ngram_size,
                             "n_heads": args.n_heads, "head_dim": args.head_dim, "prime_starts": starts})
        config = EngramConfig(
            layer_ids=tuple(layer_ids),
            max_ngram_size=args.max_ngram_size, n_heads=args.n_heads, head_dim=args.head_dim,
            prime_starts=tuple(starts) if len(starts) > 1 else starts[0],
            row_format=args.row_format or "fp32",
        )
    elif (Path(args.checkpoint) / "config.json").exists():
        config = load_hf_config(Path(args.checkpoint) / "config.json")
    else:
        raise ValueError(
            f"{args.checkpoint} has no config.json: give --preset, --config, or all of --layer-ids, "
            "--max-ngram-size, --n-heads, --head-dim, --prime-start"
        )
    if args.row_format:
        config = config.replace(row_format=args.row_format)
    return config


def cmd_convert(args: argparse.Namespace) -> int:
    from ..table.convert import convert_checkpoint

    if not Path(args.checkpoint).is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {args.checkpoint}: give the directory of *.safetensors shards")
    config = _convert_config(args)
    _check_shards(Path(args.checkpoint))
    check_disk_for(config, args.out, "convert", args.force)
    path = convert_checkpoint(args.checkpoint, args.out, config,
                              progress=False if args.no_progress else None)
    print(f"wrote {path}: {config.num_rows:,} rows ({config.row_format}, {config.row_bytes} bytes a row), "
          f"layers {list(config.layer_ids)}")
    return 0


def _check_shards(checkpoint: Path) -> None:
    """Open every shard's header, so a damaged shard is named before the conversion starts."""
    from safetensors import safe_open

    for shard in sorted(checkpoint.glob("*.safetensors")):
        try:
            with safe_open(shard, framework="pt"):
                pass
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise ValueError(f"{shard} is not a readable safetensors file ({' '.join(str(exc).split())}): "
                             "re-download or remove the shard") from None


def cmd_verify(args: argparse.Namespace) -> int:
    from ..table import verify_table

    if args.clean:
        return clean_directory(args.path)
    if Path(args.path).is_dir():
        raise UsageError(f"{args.path} is a directory: give a table file, or --clean to remove the "
                         "temporary files dead writers left in it")
    try:
        header = verify_table(args.path, progress=False if args.no_progress else None)
    except ChecksumError as exc:
        print(f"engram-offload verify: FAILED: {exc}", file=sys.stderr)
        return 1
    layout = header.layout
    print(f"{header.path}: OK, {layout.num_blocks:,} blocks, {layout.num_rows:,} rows "
          f"({layout.row_format}), {layout.file_bytes:,} bytes")
    return 0


def clean_directory(directory: str) -> int:
    from ..table.writer import clean_temp_files

    if not Path(directory).is_dir():
        raise UsageError(f"--clean takes a directory, got {directory}")
    removed = clean_temp_files(directory)
    for path in removed:
        print(f"removed {path}")
    print(f"{directory}: {len(removed)} temporary file(s) of dead writers removed")
    return 0


def cmd_bench_tier(args: argparse.Namespace) -> int:
    from ..tiers.bench import run_tier_bench

    from ..cache.policy import POLICIES
    from ..table.format import read_header
    from ..units import parse_size

    layout = read_header(args.table).layout
    cache_bytes = parse_size(args.cache_bytes, whole=layout.num_rows * layout.row_bytes)
    if cache_bytes and args.policy not in POLICIES:
        raise ValueError(f"unknown cache policy {args.policy!r}; choose one of: {', '.join(POLICIES)}")
    result = run_tier_bench(args.table, args.tier, seconds=args.seconds, batch=args.batch,
                            queue_depth=args.queue_depth, cold=args.cold, engine=args.engine,
                            seed=args.seed, callers=args.callers, cache_bytes=cache_bytes, policy=args.policy)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    cold = f"cold ({', '.join(result['cold_method'])})" if args.cold else "warm"
    print(f"{result['tier']} [{result['engine']}] {cold}, batch {args.batch}, queue depth {args.queue_depth}")
    print(f"  {result['rows_per_s']:,.0f} rows/s, {result['reads_per_s']:,.0f} reads/s, "
          f"{result['bytes_read'] / result['seconds'] / 2**20:,.1f} MiB/s")
    print(f"  {result['cpu_us_per_read']:.2f} us CPU per read, batch p50 {result['batch_ms_p50']:.2f} ms, "
          f"p99 {result['batch_ms_p99']:.2f} ms")
    if result["cache"] is not None:
        from ..cache.report import format_stats_table

        print(format_stats_table(result["cache"], title=f"{args.tier} + {cache_bytes:,} B {args.policy} cache"))
    return 0
