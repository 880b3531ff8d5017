"""The pool behind the benchmark's ``remote`` runs: the user's, or a loopback one for the run.

``bench_pool(url, nodes)`` yields the pool's URL: ``url`` when given, else that of
``nodes`` loopback ``redis-server`` processes started for the run (``pool.servers``) and
stopped at its end. ``publish(table, url, fresh=...)`` puts the table in the pool before
the remote runs; a cold run asks for a fresh copy (the table dropped, then published again),
so no reply comes from a server that has served these rows before.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..pool.layout import fingerprint
from ..pool.publish import drop_table, publish_table
from ..pool.servers import start_local_pool
from ..table.format import read_header

__all__ = ["bench_pool", "publish"]


@contextmanager
def bench_pool(url: str | None, nodes: int = 1) -> Iterator[str]:
    """``url``, or a loopback pool of ``nodes`` servers started now and stopped on exit."""
    if url is not None:
        yield url
        return
    pool = start_local_pool(nodes, None)
    try:
        yield pool.url
    finally:
        pool.stop()


def publish(table: str, url: str, *, fresh: bool = False, progress: bool | None = None,
            on_step: Callable[[str, float], Any] | None = None) -> dict[str, Any]:
    """Publish ``table`` to the pool at ``url`` (a no-op when it is there, complete);
    ``fresh``: drop it first. Returns ``publish_table``'s summary plus ``dropped_keys`` and
    ``seconds``. ``on_step("publish", elapsed)`` is called after each extent."""
    t0 = time.perf_counter()
    dropped = drop_table(url, fingerprint(read_header(table))) if fresh else 0
    on_extent = (lambda _: on_step("publish", time.perf_counter() - t0)) if on_step else None
    result = publish_table(table, url, progress=progress, on_extent=on_extent)
    return {**result, "dropped_keys": dropped, "seconds": time.perf_counter() - t0}
