"""The ``engram-offload`` command line: one sub-command module per area under ``commands/``.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its
sub-commands and sets ``func(args) -> int`` on each. ``main`` returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from . import __version__
from .errors import EngramError

COMMAND_MODULES = ("core", "table", "plan", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engram-offload",
        description="Serve DeepSeek Engram conditional memory from tiered memory.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__package__}.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for records of the command line
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (EngramError, ValueError, FileNotFoundError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"engram-offload {args.command}: error: {message}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
