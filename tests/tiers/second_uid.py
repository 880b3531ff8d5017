"""Run part of a test as another local user: a forked child that drops to uid/gid 65534
(``nobody``), or stays this uid, and reports what its function returned or raised.

``in_child(fn, *args, uid=NOBODY)`` runs ``fn(*args)`` in the child and returns
``("ok", value)`` or ``("error", "ExceptionType: message")``; a child killed by a signal
(SIGBUS, say) or silent for ``timeout`` seconds fails the test. ``Held`` keeps the child
alive after it answered, holding whatever it opened (a lock), until the block ends.
The child is forked, so it runs the code already imported here and needs no interpreter
of its own; it leaves with ``os._exit``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import time
from typing import Any, Callable

import pytest

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second local uid needs root to drop to uid 65534")


def _fork(fn: Callable[..., Any], args: tuple, uid: int | None, hold: bool) -> tuple[int, int, int | None]:
    """The child's pid, the read end of its answer, and (``hold``) the write end that keeps it alive."""
    answer_r, answer_w = os.pipe()
    keep_r, keep_w = os.pipe() if hold else (None, None)
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(answer_r)
            if keep_w is not None:
                os.close(keep_w)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            try:
                result: tuple[str, Any] = ("ok", fn(*args))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                result = ("error", f"{type(exc).__name__}: {exc}")
            os.write(answer_w, pickle.dumps(result))
            os.close(answer_w)
            if keep_r is not None:
                os.read(keep_r, 1)  # until the parent closes its end
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(answer_w)
    if keep_r is not None:
        os.close(keep_r)
    return pid, answer_r, keep_w


def _answer(pid: int, fd: int, timeout: float) -> tuple[str, Any]:
    """The child's pickled answer; fails the test when it died without one or took too long."""
    data, deadline = b"", time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the child did not answer within {timeout:.0f} s (it hung)")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if not data:
        _, status = os.waitpid(pid, 0)
        what = f"signal {os.WTERMSIG(status)} ({signal.Signals(os.WTERMSIG(status)).name})" \
            if os.WIFSIGNALED(status) else f"code {os.WEXITSTATUS(status)}"
        pytest.fail(f"the child died without answering: {what}")
    return pickle.loads(data)


def in_child(fn: Callable[..., Any], *args: Any, uid: int | None = NOBODY, timeout: float = 120.0) -> tuple[str, Any]:
    """``fn(*args)`` in a forked child running as ``uid`` (None: this uid); its answer."""
    pid, fd, _ = _fork(fn, args, uid, hold=False)
    result = _answer(pid, fd, timeout)
    with contextlib.suppress(ChildProcessError):  # reaped already when it died or hung
        os.waitpid(pid, 0)
    return result


class Held:
    """``with Held(fn, *args) as answer:`` the child answered and keeps running (holding
    what ``fn`` opened) until the block ends."""

    def __init__(self, fn: Callable[..., Any], *args: Any, uid: int | None = NOBODY, timeout: float = 120.0) -> None:
        self.fn, self.args, self.uid, self.timeout = fn, args, uid, timeout

    def __enter__(self) -> tuple[str, Any]:
        self.pid, fd, self.keep = _fork(self.fn, self.args, self.uid, hold=True)
        try:
            return _answer(self.pid, fd, self.timeout)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        os.close(self.keep)
        with contextlib.suppress(ChildProcessError):  # reaped already when it died or hung
            os.waitpid(self.pid, 0)
