"""``index``: a checkpoint's sidecar, so its own shards serve as the table (no second copy)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..units import format_bytes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index", help="index a checkpoint's Engram tensors so its shards serve as the table (no copy)",
        description="Read every page of a checkpoint's Engram embeddings once and write a small sidecar "
        "(their place, page checksums and each shard's identity). The checkpoint folder (or the sidecar) "
        "then opens as a table wherever a table is taken (open_table, the plugins' table, verify, bench-tier, "
        "row-server); a shard changed since is refused. The layout comes from CHECKPOINT_DIR/config.json.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    p.add_argument("--out", metavar="SIDECAR", help="where to write the sidecar (default CHECKPOINT_DIR/"
                   "engram-offload.index; give one on a read-only mount, then open that file)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_index)


def cmd_index(args: argparse.Namespace) -> int:
    from ..table.checkpoint import index_checkpoint
    from .core import load_hf_config

    directory = Path(args.checkpoint)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {directory}: give the checkpoint's folder (its config.json "
                                "gives the layout)")
    config = load_hf_config(directory / "config.json")
    path, done = index_checkpoint(directory, config, args.out, progress=False if args.no_progress else None)
    rate = done["bytes"] / done["seconds"] if done["seconds"] else float("inf")
    print(f"wrote {path}: {config.num_rows:,} rows in {directory}, {format_bytes(done['bytes'])} read in "
          f"{done['seconds']:.2f} s ({format_bytes(rate)}/s); open {directory if args.out is None else path} as the table")
    return 0
