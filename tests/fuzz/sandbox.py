"""Running a case in a separate process, so that a hang or a crash fails the test instead of
stopping the test run."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

import pytest


class Sandbox:
    """One spawned worker process, reused from case to case (imports are paid once).

    ``run`` fails the test, naming the case, when the call runs past ``timeout`` seconds
    (a hang) or the worker dies (a crash: SIGSEGV, SIGBUS, abort); the worker is then
    replaced for the next case.
    """

    def __init__(self, timeout: float, first_timeout: float = 180.0) -> None:
        self.timeout, self.first_timeout = timeout, first_timeout
        self._pool: ProcessPoolExecutor | None = None

    def run(self, fn: Callable[..., Any], *args: Any, case: str = "") -> Any:
        timeout = self.timeout
        if self._pool is None:  # a fresh worker imports torch first
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            timeout = self.first_timeout
        future = self._pool.submit(fn, *args)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            self._discard()
            pytest.fail(f"{case}: still running after {timeout:g} s (a hang)")
        except BrokenProcessPool:
            self._discard()
            pytest.fail(f"{case}: the reading process died (a crash)")

    def _discard(self) -> None:
        pool, self._pool = self._pool, None
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
