"""Measuring a tier: random-row throughput, reads per second, CPU per read; cold starts.

``run_tier_bench`` is shared by the ``bench-tier`` command and ``benchmarks/bench_tier.py``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["drop_page_cache", "run_tier_bench"]

DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache(path: str | os.PathLike[str]) -> list[str]:
    """Evict ``path`` from the page cache; return the methods that worked.

    ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file always; also
    ``/proc/sys/vm/drop_caches`` (all clean caches) when this process may write it.
    """
    done = []
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        done.append("posix_fadvise(DONTNEED)")
    finally:
        os.close(fd)
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("1\n")
        done.append(f"{DROP_CACHES}=1")
    except OSError:
        pass
    return done


def run_tier_bench(
    table: str | os.PathLike[str],
    tier: str,
    *,
    seconds: float = 10.0,
    batch: int = 1024,
    queue_depth: int = 64,
    cold: bool = False,
    engine: str = "auto",
    seed: int = 0,
    callers: int | None = None,
    cache_bytes: int = 0,
    policy: str = "lru",
    **options: Any,
) -> dict[str, Any]:
    """Gather uniformly random rows for ``seconds``; return the figures as a dict.

    ``direct``: one caller, ``queue_depth`` reads in flight in the tier. ``mmap``: page
    faults are synchronous, so ``queue_depth`` caller threads fault concurrently.
    ``memory``/``pinned``: one caller. ``callers`` overrides the number of caller threads
    (e.g. 2 for ``direct``, so one caller's copying overlaps the other's I/O). CPU time is
    process time (all threads) over the run. ``cache_bytes`` puts a DRAM row cache evicting by
    ``policy`` in front of the tier; its ``stats()`` (hit rate per level) are returned as
    ``cache``.
    """
    from ..store import open_table

    cold_method = drop_page_cache(table) if cold else []
    if tier == "direct":
        options.update(engine=engine, queue_depth=queue_depth)
    if callers is None:
        callers = queue_depth if tier == "mmap" else 1
    if cache_bytes:
        options.update(cache_bytes=cache_bytes, policy=policy)
    store = open_table(table, tier, **options)

    def tier_counts() -> dict[str, Any]:
        if not cache_bytes:
            return store.stats()
        return {**store.inner.stats(), **store.source.stats()}  # the tier's own counters: the misses
    stop_at = [0.0]
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def caller(index: int) -> None:
        rng = np.random.default_rng([seed, index])
        mine = []
        try:
            while time.perf_counter() < stop_at[0]:
                ids = rng.integers(0, store.num_rows, batch)
                t0 = time.perf_counter()
                store.read_raw(ids)
                mine.append(time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        with lock:
            latencies.extend(mine)

    with store:
        before = tier_counts()
        cpu0, t0 = time.process_time(), time.perf_counter()
        stop_at[0] = t0 + seconds
        threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        after = tier_counts()
        cache = store.stats() if cache_bytes else None
        if errors:
            raise errors[0]
    tier_rows = after["rows"] - before["rows"]
    rows = len(latencies) * batch if cache_bytes else tier_rows  # rows served (a cache serves some)
    reads = after.get("reads", 0) - before.get("reads", 0)
    lat = np.array(latencies) * 1e3 if latencies else np.zeros(1)
    return {
        "tier": tier,
        "engine": after.get("engine", tier),
        "table": str(Path(table)),
        "table_bytes": after["table_bytes"],
        "cold": cold,
        "cold_method": cold_method,
        "seconds": wall,
        "batch": batch,
        "queue_depth": queue_depth,
        "caller_threads": callers,
        "requests": after["requests"] - before["requests"],
        "rows": rows,
        "reads": reads,
        "bytes_read": after.get("bytes_read", 0) - before.get("bytes_read", 0),
        "rows_per_s": rows / wall,
        "reads_per_s": reads / wall,
        "cpu_seconds": cpu,
        "cpu_us_per_read": cpu / max(reads or rows, 1) * 1e6,
        "cpu_us_per_row": cpu / max(rows, 1) * 1e6,
        "batch_ms_p50": float(np.percentile(lat, 50)),
        "batch_ms_p99": float(np.percentile(lat, 99)),
        "tier_rows": tier_rows,
        "cache_bytes": cache_bytes,
        "policy": policy if cache_bytes else None,
        "cache": cache,
    }
