"""``make-table``, ``convert``, ``verify``, ``bench-tier``: table files and tier speed (``upgrade`` is refused)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..engram.config import EngramConfig, check_config_fields
from ..errors import ChecksumError
from ..table.format import TableLayout
from ..units import format_bytes, fraction, non_negative_int, positive_int
from . import UsageError
from .bench import add_bench_tier_arguments
from .core import load_hf_config
from .options import preset_arg, removed_option


def register(sub: argparse._SubParsersAction) -> None:
    make = sub.add_parser(
        "make-table", help="write a table of seeded random rows (for benchmarks)",
        description="Write a table of seeded random rows at a preset's layout, optionally scaled down.",
    )
    make.add_argument("--preset", default="deepseek-v4.1-flash", type=preset_arg,
                      help="a named model whose layout to make (default deepseek-v4.1-flash)")
    size = make.add_mutually_exclusive_group(required=True)
    size.add_argument("--scale", type=fraction,
                      help="scale every prime-search start by F (0 < F <= 1) for a smaller table")
    size.add_argument("--full", action="store_true", help="the preset's full-size table (e.g. 189 GiB)")
    make.add_argument("--out", required=True, type=output_file, help="table file to write")
    make.add_argument("--seed", type=non_negative_int, default=0, help="random seed (same seed, same file; default 0)")
    removed_option(make, "--block-size", why="tables carry page checksums only")
    make.add_argument("--force", action="store_true",
                      help="replace --out if it exists, and write even if the disk looks too full")
    make.add_argument("--no-progress", action="store_true", help="no progress bar")
    make.set_defaults(func=cmd_make_table)

    conv = sub.add_parser(
        "convert", help="convert a checkpoint's Engram embeddings (safetensors) into a table",
        description="Stream the Engram embeddings of a safetensors checkpoint into one table file. "
        "The layout comes from CHECKPOINT_DIR/config.json, or --preset / --config, or the flags.",
    )
    conv.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    conv.add_argument("--out", required=True, type=output_file, help="table file to write")
    conv.add_argument("--preset", type=preset_arg,
                      help="a named model, for checkpoints without config.json (default: the checkpoint's config.json)")
    conv.add_argument("--config", metavar="PATH", help="a Hugging Face config.json with engram_* fields "
                      "(default: CHECKPOINT_DIR/config.json)")
    conv.add_argument("--layer-ids", help="comma-separated Engram layer ids, e.g. 1,15 (default: the config's)")
    conv.add_argument("--max-ngram-size", type=positive_int, help="largest n-gram order (default: the config's)")
    conv.add_argument("--n-heads", type=positive_int, help="hashed heads per n-gram order (default: the config's)")
    conv.add_argument("--head-dim", type=positive_int, help="values per row (default: the config's)")
    conv.add_argument("--prime-start", help="prime-search start, one value or one per order (comma-separated; "
                      "default: the config's)")
    conv.add_argument("--row-format", help="store rows in this format (default: the config's)")
    conv.add_argument("--force", action="store_true",
                      help="replace --out if it exists, and write even if the disk looks too full")
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    conv.set_defaults(func=cmd_convert)

    ver = sub.add_parser("verify", help="check every page of a table against its checksum",
                         description="Check a table's header, size and every data page's checksum; "
                         "or, with --clean DIR, remove the temporary files that dead writers left in DIR.")
    ver.add_argument("path", help="the table file (with --clean: a directory)")
    ver.add_argument("--clean", action="store_true",
                     help="remove temporary table files whose writer is gone from the directory PATH")
    ver.add_argument("--no-progress", action="store_true", help="no progress bar")
    ver.set_defaults(func=cmd_verify)

    up = sub.add_parser("upgrade", help="removed: rewrite an older table with convert",
                        description="Removed: this engram-offload reads format version 3 only; rewrite "
                        "an older table with engram-offload convert (or make-table).")
    up.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    up.set_defaults(func=cmd_upgrade)

    bench = sub.add_parser(
        "bench-tier", help="measure random-row reads from one tier",
        description="Gather uniformly random rows from a table on one tier and report rows/s, "
        "reads/s and CPU time per read.",
    )
    add_bench_tier_arguments(bench)


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
    """Refuse a table that will not fit where ``out`` goes (``NotEnoughResources``), or ``out``
    when it exists; ``force`` writes anyway."""
    from ..machine import check_free_disk
    from ..table.safeio import refuse_existing

    refuse_existing(out, force, "table")
    need = TableLayout.for_config(config).file_bytes
    check_free_disk(Path(out).absolute().parent, need, f"{what} of {out}", force=force)


def cmd_make_table(args: argparse.Namespace) -> int:
    from ..table import make_random_table

    config = EngramConfig.from_name(args.preset)
    if not args.full:
        config = config.scaled(args.scale)
    check_disk_for(config, args.out, "make-table", args.force)
    path = make_random_table(args.out, config, args.seed, progress=False if args.no_progress else None)
    print(f"wrote {path}: {config.num_rows:,} rows of {config.row_bytes} bytes "
          f"({format_bytes(path.stat().st_size)}), layout {config.name}")
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
            prime_starts=tuple(starts) if len(starts) > 1 else (starts[0],) * (args.max_ngram_size - 1),
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
    check_disk_for(config, args.out, "convert", args.force)
    path = convert_checkpoint(args.checkpoint, args.out, config,
                              progress=False if args.no_progress else None)
    print(f"wrote {path}: {config.num_rows:,} rows ({config.row_format}, {config.row_bytes} bytes a row), "
          f"layers {list(config.layer_ids)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ..table import verify_table
    from ..table.checkpoint import is_checkpoint

    if args.clean:
        return clean_directory(args.path)
    if Path(args.path).is_dir() and not is_checkpoint(args.path):
        raise UsageError(f"{args.path} is a directory: give a table file, or --clean to remove the "
                         "temporary files dead writers left in it")
    try:
        header = verify_table(args.path, progress=False if args.no_progress else None)
    except ChecksumError as exc:
        print(f"engram-offload verify: FAILED: {exc}", file=sys.stderr)
        return 1
    layout = header.layout
    print(f"{header.path}: OK, {layout.num_pages:,} pages, {layout.num_rows:,} rows "
          f"({layout.row_format}), {layout.file_bytes:,} bytes")
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    raise UsageError("upgrade was removed: this engram-offload reads table format version 3 only; "
                     "rewrite an older table with engram-offload convert (or make-table)")


def clean_directory(directory: str) -> int:
    from ..table.writer import clean_temp_files

    if not Path(directory).is_dir():
        raise UsageError(f"--clean takes a directory, got {directory}")
    removed = clean_temp_files(directory)
    for path in removed:
        print(f"removed {path}")
    print(f"{directory}: {len(removed)} temporary file(s) of dead writers removed")
    return 0
