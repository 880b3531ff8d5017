"""Files written whole or not at all: a temporary file beside the target, synced, renamed.

A reader never sees a half-written file, and after the rename returns the new file
survives a crash: the file's bytes are synced before the rename, the directory after it.
Table files have their own writer (``table.writer``: their temporary names say which
process writes them, so a dead writer's leftovers can be cleaned); everything else the
package writes (token maps, checkpoints, benchmark reports, plots) goes through here.

The file gets the mode an ordinary ``open(path, "w")`` would give it: a new file 0666 less the
process's umask, a replaced file keeps its mode (the temporary file's own 0600 never shows).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["atomic_path", "current_umask", "fsync_dir", "write_bytes_atomic", "write_json_atomic"]


@contextmanager
def atomic_path(path: str | os.PathLike[str], suffix: str = ".tmp") -> Iterator[Path]:
    """A fresh temporary path beside ``path`` for the caller to write (by any means); when
    the block ends well it is synced and renamed onto ``path``, when it fails it is removed.
    ``suffix``: the temporary name's ending (some writers choose the format by it)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _mode_for(target))
        _fsync_file(tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def current_umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``), else set and reset."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _mode_for(target: Path) -> int:
    """The permission bits ``target`` gets: its own when it exists, else 0666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return 0o666 & ~current_umask()


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see ``atomic_path``); returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_json_atomic(path: str | os.PathLike[str], obj: Any, sort_keys: bool = False) -> Path:
    """Write ``obj`` as indented JSON (a value JSON lacks as its ``str``) to ``path`` atomically;
    a value that cannot be written (a cycle) raises before any file is made. Returns the path."""
    text = json.dumps(obj, indent=2, ensure_ascii=False, default=str, sort_keys=sort_keys) + "\n"
    return write_bytes_atomic(path, text.encode())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Sync a directory, so that a rename or a new name in it survives a crash."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
