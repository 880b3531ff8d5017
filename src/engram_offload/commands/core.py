"""``info`` and ``hash``: the Engram layout of a model and the row ids of a text."""

from __future__ import annotations

import argparse
import json

from ..config import EngramConfig
from ..rows import get_row_format


def add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """``--preset NAME`` or ``--config config.json`` (one of them)."""
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--preset", help="a named layout, e.g. deepseek-v4.1-flash")
    group.add_argument("--config", help="a Hugging Face config.json with engram_* fields")


def config_from_args(args: argparse.Namespace) -> EngramConfig:
    if getattr(args, "config", None):
        return EngramConfig.from_hf_config(args.config)
    return EngramConfig.from_name(args.preset or "deepseek-v4.1-flash")


def register(sub: argparse._SubParsersAction) -> None:
    info = sub.add_parser(
        "info",
        help="show an Engram layout: rows, bytes per token, table size",
        description="Show the table geometry of an Engram layout.",
    )
    add_model_arguments(info)
    info.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks sharing the heads (default 1)")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=cmd_info)


def layout_summary(config: EngramConfig, tp: int = 1) -> dict:
    """The figures ``info`` prints, as a JSON-able dict."""
    return {
        "name": config.name,
        "variant": config.variant,
        "row_format": config.row_format,
        "head_dim": config.head_dim,
        "row_bytes": config.row_bytes,
        "num_rows": config.num_rows,
        "table_bytes": config.table_bytes,
        "rows_per_token": config.rows_per_token,
        "bytes_per_token": config.bytes_per_token,
        "tp": tp,
        "bytes_per_token_per_gpu": config.bytes_per_token_per_gpu(tp),
        "layers": [
            {"layer_id": i, "rows": config.rows_per_layer[i], "row_base": config.layer_row_base(i)}
            for i in config.layer_ids
        ],
    }


def cmd_info(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    summary = layout_summary(config, args.tp)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    fmt = get_row_format(config.row_format)
    print(f"layout          {config.name or args.config} ({config.variant} variant)")
    print(f"engram layers   {list(config.layer_ids)}, orders 2..{config.max_ngram_size}, "
          f"{config.n_heads} heads per order")
    print(f"row format      {fmt.name} ({fmt.description}), head_dim {config.head_dim}, "
          f"{config.row_bytes} bytes a row")
    for layer in summary["layers"]:
        print(f"layer {layer['layer_id']:<9} {layer['rows']:,} rows (first row {layer['row_base']:,})")
    print(f"table           {config.num_rows:,} rows, {config.table_bytes:,} bytes "
          f"({config.table_bytes / 2**30:.2f} GiB)")
    print(f"per token       {config.rows_per_token} rows, {config.bytes_per_token:,} bytes "
          f"({config.bytes_per_token / 1024:.1f} KiB)")
    print(f"per token, TP={args.tp}  {summary['bytes_per_token_per_gpu']:,} bytes per GPU")
    return 0
