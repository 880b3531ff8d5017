"""The ``engram-offload`` command line: one sub-command module per area under ``commands/``.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its
sub-commands and sets ``func(args) -> int`` on each. ``main`` returns the exit code: 0 on
success, 1 when the command failed, 2 for a usage error, 130/143 when stopped by
SIGINT/SIGTERM. Every error is one line on stderr naming the problem and what to do; a
traceback only with ``--debug``.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import re
import signal
import sys
from contextlib import contextmanager
from typing import Iterator, NoReturn, Sequence

from . import __version__
from .commands import UsageError

COMMAND_MODULES = ("core", "table", "index", "plan", "trace", "bench", "pool", "shared", "rowserver", "model")

_OS_HINTS = {
    errno.ENOSPC: "free space or write elsewhere",
    errno.EDQUOT: "free space or write elsewhere",
    errno.EACCES: "check the path's permissions",
    errno.EPERM: "check the path's permissions",
    errno.EISDIR: "give a file, not a directory",
    errno.ENOTDIR: "a part of the path is not a directory",
    errno.ENOENT: "check the path",
    errno.EMFILE: "raise the open-file limit (ulimit -n)",
    errno.ENOMEM: "free memory or choose something smaller",
    errno.EROFS: "write to a writable file system",
    errno.EFBIG: "the file size limit (ulimit -f) is too small; raise it or write less",
}


class Terminated(BaseException):
    """SIGTERM arrived; raised in the main thread so every ``with`` block cleans up."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (and exit code 2), and which reads a
    negative size (``--cache -1G``) as a value (refused by its type) rather than an option."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d*\.?\d+\s*[A-Za-z%]+$")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="engram-offload",
        description="Serve DeepSeek Engram conditional memory from tiered memory.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__package__}.commands.{name}").register(sub)
    for command in sub.choices.values():  # --debug after the command name too
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error")
    return parser


def describe(exc: BaseException) -> str:
    """One line saying what went wrong and, where known, what to do."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename is not None else ""
        hint = _OS_HINTS.get(exc.errno or 0)
        text = f"{exc.strerror}{where}" + (f"; {hint}" if hint else "")
    elif isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])
    elif isinstance(exc, MemoryError):
        text = f"out of memory{f' ({exc})' if str(exc) else ''}; free memory or choose a smaller size"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` (SIGINT already raises ``KeyboardInterrupt``)."""
    def on_term(signum, frame):
        raise Terminated

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # start-up (the command modules' imports) ends in one line too
        parser = build_parser()
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else 2
    except KeyboardInterrupt:
        print("engram-offload: interrupted (SIGINT) while starting; nothing was done", file=sys.stderr)
        return 130
    except (MemoryError, OSError, RuntimeError) as exc:
        if "--debug" in argv:
            raise
        print(f"engram-offload: error while starting: {_message(exc)}", file=sys.stderr)
        return 1
    args.argv = argv  # for records of the command line
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    prefix = f"engram-offload {args.command}"
    with _signals_raise():
        try:
            return int(args.func(args) or 0)
        except BrokenPipeError:
            return 0
        except KeyboardInterrupt:
            print(f"{prefix}: interrupted (SIGINT); stopped, temporary files removed", file=sys.stderr)
            return 130
        except Terminated:
            print(f"{prefix}: terminated (SIGTERM); stopped, temporary files removed", file=sys.stderr)
            return 143
        except Exception as exc:
            if args.debug:
                raise
            print(f"{prefix}: error: {_message(exc)}", file=sys.stderr)
            return 2 if isinstance(exc, UsageError) else 1


def _message(exc: Exception) -> str:
    from .errors import EngramError

    limit = _address_space_limit()
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        import threading

        return (f"cannot start another thread ({threading.active_count()} running): the process's "
                f"{'address-space limit (ulimit -v, ' + limit + ')' if limit else 'memory'} or its thread limit "
                "(ulimit -u) is too low for this many; raise the limit or use fewer threads")
    if limit and (isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM)):
        return (f"out of memory under the address-space limit (ulimit -v, {limit}): raise the limit "
                "or choose a smaller size")
    if isinstance(exc, (EngramError, ValueError, KeyError, OSError, MemoryError)):
        return describe(exc)
    return f"unexpected {type(exc).__name__}: {describe(exc)} (rerun with --debug for the traceback)"


def _address_space_limit() -> str | None:
    """This process's address-space limit (``ulimit -v``, ``prlimit --as``) as text, or None."""
    import resource

    from .units import format_bytes

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else format_bytes(soft)


if __name__ == "__main__":
    sys.exit(main())
