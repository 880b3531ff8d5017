"""Measuring a tier: random-row throughput, reads per second, CPU per read; cold starts; or
real-text decode steps through a ``Prefetcher`` (``bench.prefetch_bench``).

``run_tier_bench`` is shared by the ``bench-tier`` command, ``benchmarks/bench_tier.py`` and
``benchmarks/bench_fetch.py``.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..cache.policy import DEFAULT_POLICY
from ..serving.store import TableStore, open_table
from ..tiers import is_resident
from ..tiers.policy import DEFAULT_QUEUE_DEPTH
from .cold import make_cold
from .corpus import Corpus

__all__ = ["caller_threads", "memory_needs", "run_tier_bench"]


@dataclass
class _Callers:
    """Caller threads gathering random batches until a deadline; their batch latencies."""

    store: TableStore
    batch: int
    seed: int
    latencies: list[float] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, callers: int, seconds: float) -> tuple[float, float, float]:
        """Run ``callers`` threads for ``seconds``; returns (wall, CPU, the CPU's kernel part)
        seconds of the process."""
        cpu0, t0, kernel0 = time.process_time(), time.perf_counter(), os.times().system
        threads = [threading.Thread(target=self._caller, args=(i, t0 + seconds)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.errors:
            raise self.errors[0]
        return time.perf_counter() - t0, time.process_time() - cpu0, os.times().system - kernel0

    def _caller(self, index: int, stop_at: float) -> None:
        rng = np.random.default_rng([self.seed, index])
        mine = []
        try:
            while time.perf_counter() < stop_at:
                ids = rng.integers(0, self.store.num_rows, self.batch)
                t0 = time.perf_counter()
                self.store.read_raw(ids)
                mine.append(time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 - raised by run()
            self.errors.append(exc)
        with self._lock:
            self.latencies.extend(mine)


def _check(seconds: float, counts: dict[str, int | None]) -> None:
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be a finite number > 0, got {seconds}")
    for name, value in counts.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _tier_options(tier: str, engine: str, queue_depth: int, cache_bytes: int, policy: str,
                  options: dict[str, Any]) -> dict[str, Any]:
    """``open_table`` options of a run: the direct tier's engine and depth, the row cache."""
    options = dict(options)
    if tier == "direct":
        options.update(engine=engine, queue_depth=queue_depth)
    if cache_bytes:
        options.update(cache_bytes=cache_bytes, policy=policy)
    return options


def _figures(before: dict[str, Any], after: dict[str, Any], served_rows: int, wall: float, cpu: float,
             kernel_cpu: float, latencies: list[float]) -> dict[str, Any]:
    """Rates and per-read costs from the tier's counters before and after, and the batch
    latencies; a read's CPU also split into the kernel's (system time) and the process's."""
    tier_rows = after["rows"] - before["rows"]
    reads = after.get("reads", 0) - before.get("reads", 0)
    lat = np.array(latencies) * 1e3 if latencies else np.zeros(1)
    us_per_read = 1e6 / max(reads or served_rows, 1)  # rows stand in for reads on tiers that count none
    return {
        "rows": served_rows,
        "reads": reads,
        "bytes_read": after.get("bytes_read", 0) - before.get("bytes_read", 0),
        "rows_per_s": served_rows / wall,
        "reads_per_s": reads / wall,
        "cpu_seconds": cpu,
        "cpu_us_per_read": cpu * us_per_read,
        "kernel_cpu_us_per_read": kernel_cpu * us_per_read,
        "user_cpu_us_per_read": (cpu - kernel_cpu) * us_per_read,
        "cpu_us_per_row": cpu / max(served_rows, 1) * 1e6,
        "batch_ms_p50": float(np.percentile(lat, 50)),
        "batch_ms_p99": float(np.percentile(lat, 99)),
        "tier_rows": tier_rows,
    }


def _load_rate(tier_stats: dict[str, Any]) -> float | None:
    """Bytes per second of a resident tier's load at open (None for tiers that load nothing)."""
    seconds = tier_stats.get("load_seconds")
    return tier_stats["load_bytes"] / seconds if seconds else None


# The least memory a caller thread takes (its stack pages, thread state and Python frame).
THREAD_BYTES = 32 << 10


def caller_threads(tier: str, callers: int | None, queue_depth: int) -> tuple[str, int]:
    """The setting that sets a run's caller threads (``callers``, else ``queue_depth``: the
    mmap tier reads with one thread a read in flight) and how many it starts."""
    if callers is not None:
        return "callers", callers
    return "queue_depth", queue_depth if tier == "mmap" else 1


def memory_needs(tier: str, num_rows: int, row_bytes: int, rows_per_token: int, *, batch: int = 1024,
                 callers: int | None = None, queue_depth: int = DEFAULT_QUEUE_DEPTH, cache_bytes: int = 0,
                 prefetcher: bool = False, sequences: int = 32, run_ahead: int = 2,
                 corpus_tokens: int = 300_000, corpus: str | Corpus = "stdlib") -> list[tuple[str, int, int, str]]:
    """What a run's settings cost in memory, each counted at least (the real cost is higher):
    ``(setting, its value, bytes, how)``, to refuse a run that cannot fit before it allocates."""
    row = 6 * 8 + 2 * row_bytes  # a row id in, five 8-byte arrays of ids while deduplicating, the distinct rows, the rows out
    needs = [("cache_bytes", cache_bytes, cache_bytes, "the row cache")]
    if is_resident(tier):
        needs.append(("tier", 0, num_rows * row_bytes, f"{tier}: the whole table, {num_rows:,} rows x {row_bytes} B"))
    if prefetcher:
        needs += [
            ("sequences", sequences, sequences * max(run_ahead, 1) * rows_per_token * row,
             f"{sequences:,} sequences x {run_ahead} steps x {rows_per_token} rows x {row} B"),
            ("run_ahead", run_ahead, run_ahead * THREAD_BYTES, f"{run_ahead:,} steps x {THREAD_BYTES >> 10} KiB"),
        ]
        if corpus == "zipf":  # made up to the count asked (a real corpus is only capped by it)
            needs.append(("corpus_tokens", corpus_tokens, corpus_tokens * 8, f"{corpus_tokens:,} token ids x 8 B"))
        return needs
    source, threads = caller_threads(tier, callers, queue_depth)
    larger = ("batch", batch) if batch >= threads else (source, threads)  # the one to make smaller
    needs += [
        (*larger, threads * batch * row, f"{threads:,} caller(s) x {batch:,} rows x {row} B"),
        (source, threads, threads * THREAD_BYTES, f"{threads:,} threads x {THREAD_BYTES >> 10} KiB"),
        ("queue_depth", queue_depth, queue_depth * (THREAD_BYTES if tier == "mmap" else row),
         f"{queue_depth:,} reads in flight"),
    ]
    return needs


def run_tier_bench(
    table: str | os.PathLike[str],
    tier: str,
    *,
    seconds: float = 10.0,
    batch: int = 1024,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
    cold: bool = False,
    drop_all_caches: bool = False,
    engine: str = "auto",
    seed: int = 0,
    callers: int | None = None,
    cache_bytes: int = 0,
    policy: str = DEFAULT_POLICY,
    prefetcher: bool = False,
    sequences: int = 32,
    run_ahead: int = 2,
    corpus: str | Corpus = "stdlib",
    corpus_tokens: int = 300_000,
    warm_seconds: float | None = None,
    check: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Gather uniformly random rows for ``seconds`` (or, with ``prefetcher``, real-text decode
    steps); return the figures as a dict.

    ``direct``: one caller, ``queue_depth`` reads in flight in the tier. ``mmap``: page
    faults are synchronous, so ``queue_depth`` caller threads fault concurrently.
    ``memory``/``pinned``: one caller. ``callers`` overrides the number of caller threads
    (e.g. 2 for ``direct``, so one caller's copying overlaps the other's I/O). CPU time is
    process time (all threads) over the run. ``cold`` evicts the table file's pages first
    (and ``drop_all_caches`` the whole machine's page cache, where permitted).
    ``cache_bytes`` puts a DRAM row cache evicting by ``policy`` in front of the tier; the
    store's ``stats()`` (hit rate per level) are then returned as ``cache``.

    ``prefetcher``: instead of random gathers, decode steps of ``sequences`` sequences of
    ``corpus`` (a name for ``load_corpus``, its first ``corpus_tokens`` tokens, or a loaded
    ``Corpus``) through a ``Prefetcher`` from one caller, ``run_ahead`` steps in flight; a
    cold phase of ``seconds``, then (with a cache) a warm phase of ``warm_seconds`` (default
    half of ``seconds``) that measures the CPU of a hit row, hence of a missed one: see
    ``bench.prefetch_bench``. ``check`` compares a sample of the rows with the mmap tier's.
    """
    if prefetcher:
        if callers is not None:
            raise ValueError("the prefetcher runs from one caller (run_ahead keeps its queue full): drop callers")
        _check(seconds, {"queue_depth": queue_depth, "sequences": sequences, "run_ahead": run_ahead,
                         "corpus_tokens": corpus_tokens})
        return _prefetcher_bench(table, tier, seconds=seconds, warm_seconds=warm_seconds, queue_depth=queue_depth,
                                 cold=cold, drop_all_caches=drop_all_caches, engine=engine, seed=seed,
                                 cache_bytes=cache_bytes, policy=policy, sequences=sequences, run_ahead=run_ahead,
                                 corpus=corpus, corpus_tokens=corpus_tokens, check=check, options=options)
    _check(seconds, {"batch": batch, "queue_depth": queue_depth, "callers": callers})
    cold_method = make_cold(table, drop_all=drop_all_caches) if cold else []
    if callers is None:
        callers = queue_depth if tier == "mmap" else 1
    with open_table(table, tier, **_tier_options(tier, engine, queue_depth, cache_bytes, policy, options)) as store:
        before = store.stats()
        run = _Callers(store, batch, seed)
        wall, cpu, kernel_cpu = run.run(callers, seconds)
        after = store.stats()
    return {
        "tier": tier,
        "engine": after["tier"].get("engine", tier),
        "table": str(Path(table)),
        "table_bytes": after["table_bytes"],
        "mode": "random",
        "cold": cold,
        "cold_method": cold_method,
        "seconds": wall,
        "batch": batch,
        "queue_depth": queue_depth,
        "caller_threads": callers,
        "requests": after["store"]["fetches"] - before["store"]["fetches"],
        "load_bytes_per_s": _load_rate(after["tier"]),
        **_figures(before["tier"], after["tier"], len(run.latencies) * batch, wall, cpu, kernel_cpu,
                    run.latencies),
        "cache_bytes": cache_bytes,
        "policy": policy if cache_bytes else None,
        "cache": after if cache_bytes else None,
    }


def _prefetcher_bench(table: str | os.PathLike[str], tier: str, *, seconds: float, warm_seconds: float | None,
                      queue_depth: int, cold: bool, drop_all_caches: bool, engine: str, seed: int,
                      cache_bytes: int, policy: str, sequences: int, run_ahead: int, corpus: str | Corpus,
                      corpus_tokens: int, check: bool, options: dict[str, Any]) -> dict[str, Any]:
    """``run_tier_bench(..., prefetcher=True)``: the text first, then the cold start, then the phases."""
    from .prefetch_bench import load_text, run_prefetch_phases

    if warm_seconds is None:
        warm_seconds = seconds / 2
    _check(warm_seconds, {})
    text, token_map = load_text(corpus, corpus_tokens, seed)
    cold_method = make_cold(table, drop_all=drop_all_caches) if cold else []
    with open_table(table, tier, **_tier_options(tier, engine, queue_depth, cache_bytes, policy, options)) as store:
        figures = run_prefetch_phases(store, str(table), text, token_map, seconds=seconds,
                                      warm_seconds=warm_seconds, sequences=sequences, run_ahead=run_ahead,
                                      seed=seed, check=check)
        tier_stats = store.stats()["tier"]
    return {
        "tier": tier,
        "engine": tier_stats.get("engine", tier),
        "table": str(Path(table)),
        "table_bytes": figures["cache"]["table_bytes"],
        "mode": "prefetcher",
        "cold": cold,
        "cold_method": cold_method,
        "queue_depth": queue_depth,
        "caller_threads": 1,
        "load_bytes_per_s": _load_rate(tier_stats),
        "cache_bytes": cache_bytes,
        "policy": policy if cache_bytes else None,
        **figures,
        "cache": figures["cache"] if cache_bytes else None,
    }
