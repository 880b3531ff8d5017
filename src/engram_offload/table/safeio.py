"""Opening the files an operator names as inputs: no open that blocks, no read without bound.

``open_input`` refuses anything but a regular file (a FIFO, a device such as ``/dev/zero``, a
socket, a folder) from its ``stat``, before opening it; opens with ``O_NONBLOCK`` (a FIFO put in
its place meanwhile returns at once instead of waiting for a writer) and checks the ``fstat`` of
what it opened before a byte is read, then clears ``O_NONBLOCK``.
Symbolic links are followed: the paths are the operator's own, and what a link leads to is
checked like any other file. ``read_input`` reads a whole input of at most ``max_bytes``;
``parse_json`` parses one with nesting too deep for the parser refused in one line.

Outputs: ``refuse_existing`` (checked before the work, so a refusal costs nothing) and
``output_path``: a file written atomically (``atomic.atomic_path``) that replaces an existing
one only with ``force``, a write error (a full disk) naming the file.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from ..atomic import atomic_path
from ..units import format_bytes

__all__ = ["open_input", "read_input", "parse_json", "refuse_existing", "output_path", "MAX_JSON_BYTES"]

MAX_JSON_BYTES = 16 << 20  # a settings, server or config file: far more than any real one

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_input(path: str | os.PathLike[str], what: str, error: type[Exception] = ValueError) -> BinaryIO:
    """``path`` opened for reading (blocking again), once it is known to be a regular file;
    ``FileNotFoundError`` naming the ``what`` when absent, ``error`` when it is something else."""
    try:
        _check_regular(os.stat(path).st_mode, path, what, error)  # a socket or device is never opened
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # swapped for a FIFO meanwhile: no wait
    except FileNotFoundError:
        raise FileNotFoundError(f"no {what} at {os.fspath(path)}") from None
    try:
        _check_regular(os.fstat(fd).st_mode, path, what, error)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_regular(mode: int, path: str | os.PathLike[str], what: str, error: type[Exception]) -> None:
    if not stat.S_ISREG(mode):
        kind = next((text for test, text in _KINDS if test(mode)), "not a regular file")
        raise error(f"{os.fspath(path)} is {kind}, not a regular file: give the {what} itself")


def read_input(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The whole of input file ``path`` (see ``open_input``); ``ValueError`` for one over ``max_bytes``."""
    with open_input(path, what) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{os.fspath(path)} is over {format_bytes(max_bytes)}, the most a {what} may hold: "
                         f"give a smaller {what}")
    return data


def parse_json(text: str | bytes, where: str) -> Any:
    """``json.loads(text)``; ``ValueError`` naming ``where`` for text that is not JSON or nests
    deeper than the parser goes."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{where} nests JSON too deeply to read: give a flat object") from None
    except UnicodeDecodeError:
        raise ValueError(f"{where} is not UTF-8 text: give a JSON object") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc.msg}, line {exc.lineno}): give a JSON object") from None


def refuse_existing(path: str | os.PathLike[str], force: bool, what: str = "output") -> None:
    """``FileExistsError`` (one line) for an ``path`` that exists, unless ``force``."""
    if not force and os.path.lexists(path):
        raise FileExistsError(f"{os.fspath(path)} exists: the {what} is not written over it; give another path, "
                              "or --force to replace it")


@contextmanager
def output_path(path: str | os.PathLike[str], force: bool, suffix: str = ".tmp", what: str = "output") -> Iterator[Path]:
    """A temporary path to write, renamed onto ``path`` when the block ends well (``atomic_path``);
    refused when ``path`` exists, unless ``force``; an ``OSError`` of the write names ``path``."""
    refuse_existing(path, force, what)
    try:
        with atomic_path(path, suffix) as tmp:
            yield tmp
    except OSError as exc:
        if exc.strerror is None or exc.filename == os.fspath(path):
            raise
        raise OSError(exc.errno, exc.strerror, os.fspath(path)) from None
