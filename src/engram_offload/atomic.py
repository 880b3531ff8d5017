"""Files written whole or not at all: a temporary file beside the target, synced, renamed.

A reader never sees a half-written file, and after the rename returns the new file
survives a crash: the file's bytes are synced before the rename, the directory after it.
Table files have their own writer (``table.writer``: their temporary names say which
process writes them, so a dead writer's leftovers can be cleaned); everything else the
package writes (token maps, checkpoints, benchmark reports, plots) goes through here.

The file gets the mode an ordinary ``open(path, "w")`` would give it: a new file 0666 less the
process's umask, a replaced file keeps its mode (the temporary file's own 0600 never shows).

``replace=False`` never writes over a file, even one made after the caller checked: the rename
itself refuses (``rename_noreplace``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["atomic_path", "current_umask", "fsync_dir", "rename_noreplace", "write_bytes_atomic",
           "write_json_atomic"]

_AT_FDCWD, _RENAME_NOREPLACE = -100, 1
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM)  # by the kernel or file system


@contextmanager
def atomic_path(path: str | os.PathLike[str], suffix: str = ".tmp", replace: bool = True) -> Iterator[Path]:
    """A fresh temporary path beside ``path`` for the caller to write (by any means); when
    the block ends well it is synced and renamed onto ``path``, when it fails it is removed.
    ``suffix``: the temporary name's ending (some writers choose the format by it);
    ``replace=False``: a ``path`` that exists at the rename is kept (``FileExistsError``)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _mode_for(target))
        _fsync_file(tmp)
        os.replace(tmp, target) if replace else rename_noreplace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def rename_noreplace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists: ``FileExistsError`` (one line) then, and
    ``src`` stays. ``renameat2(RENAME_NOREPLACE)``; where the kernel or file system lacks it, a
    hard link then an unlink; where links are refused too, ``dst`` taken with ``O_EXCL`` and replaced."""
    try:
        if not _renameat2_noreplace(src, dst):
            try:
                os.link(src, dst, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in _UNSUPPORTED:
                    raise
                os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
                os.replace(src, dst)
            else:
                os.unlink(src)
    except FileExistsError:
        raise FileExistsError(f"{os.fspath(dst)} exists (made while it was written): it is not written over; "
                              "remove it or give another path") from None


@lru_cache(maxsize=1)
def _renameat2() -> Callable[..., int] | None:
    try:
        func = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc 2.28+ / musl 1.2.2+
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func  # type: ignore[no-any-return]


def _renameat2_noreplace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> bool:
    """True once renamed; False where ``renameat2`` or its flag is unsupported; ``OSError`` else."""
    func = _renameat2()
    if func is None:
        return False
    if func(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), os.fspath(dst))


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


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, replace: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically (see ``atomic_path``); returns the path."""
    with atomic_path(path, replace=replace) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_json_atomic(path: str | os.PathLike[str], obj: Any, sort_keys: bool = False,
                      replace: bool = True) -> Path:
    """Write ``obj`` as indented JSON (a value JSON lacks as its ``str``) to ``path`` atomically;
    a value that cannot be written (a cycle) raises before any file is made. Returns the path."""
    text = json.dumps(obj, indent=2, ensure_ascii=False, default=str, sort_keys=sort_keys) + "\n"
    return write_bytes_atomic(path, text.encode(), replace)


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
