"""Summed PSS of processes that each open one table: how many copies of it the machine holds.

``summed_pss(table, tier, shm_dir)`` starts ``max(counts)`` processes (``spawn``). Each reads
its own PSS (``smaps_rollup``) before the table, as a baseline; then, as the count grows to
each of ``counts``, the next processes open the table on ``tier`` (``shared``: one segment in
``shm_dir`` for them all; ``memory``: a copy each) and touch every row. For each count it
returns the summed growth of the open processes' PSS from their baselines and, for ``shared``,
the summed PSS of their mappings of the segment alone. PSS divides a shared page among the
processes that map it, so one copy for N processes sums to about one table, N copies to N.
Every answer is awaited at most ``timeout`` seconds, and not at all once its process has died.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from engram_offload.table.format import read_header
from engram_offload.tiers.memory import MemoryTier
from engram_offload.tiers.shared import SharedTier, process_pss

__all__ = ["PSS_TIERS", "summed_pss"]

PSS_TIERS = ("shared", "memory")


def _holder(conn: Connection, table: str, tier: str, shm_dir: str) -> None:
    """A process: its baseline, then on "open" the table on ``tier`` with every row touched;
    answers each command with (PSS, PSS of the segment's mapping or 0) until "exit"."""
    header = read_header(table)
    opened: Any = None
    int(torch.ones(1 << 20, dtype=torch.uint8).sum())  # torch's reduction threads and kernels, before the baseline
    conn.send(process_pss())
    for command in iter(conn.recv, "exit"):
        if command == "open" and opened is None:
            opened = SharedTier(header, shm_dir=shm_dir) if tier == "shared" else MemoryTier(header)
            int(opened.rows.sum())  # fault in every page
        segment = getattr(opened, "segment", None)
        conn.send((process_pss(), process_pss(mapping=str(segment)) if segment else 0))
    if opened is not None:
        opened.close()


def _answer(pipe: Connection, worker: Any, timeout: float) -> Any:
    """The worker's next answer; an error as soon as it has died, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pipe.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
        if not worker.is_alive() and not pipe.poll():
            raise RuntimeError(f"a PSS process exited with code {worker.exitcode} before answering")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"a PSS process did not answer within {timeout:.0f} s (it is still running)")
    return pipe.recv()


def summed_pss(table: str | Path, tier: str, shm_dir: str | Path, counts: tuple[int, ...] = (1, 2, 4),
               timeout: float = 120.0) -> list[dict[str, Any]]:
    """One entry per count of processes holding the table (see the module): ``processes``,
    ``tier``, ``summed_pss_growth_bytes`` and ``summed_segment_pss_bytes``."""
    if tier not in PSS_TIERS:
        raise ValueError(f"summed_pss opens the tiers {', '.join(PSS_TIERS)}, not {tier!r}")
    if not counts or min(counts) < 1 or list(counts) != sorted(counts):
        raise ValueError(f"counts must be increasing and >= 1, got {counts}")
    ctx = multiprocessing.get_context("spawn")
    pipes: list[Connection] = []
    workers: list[Any] = []
    rows = []
    try:
        for _ in range(max(counts)):
            parent, child = ctx.Pipe()
            workers.append(ctx.Process(target=_holder, args=(child, str(table), tier, str(shm_dir)), daemon=True))
            workers[-1].start()
            pipes.append(parent)
        baselines = [_answer(p, w, timeout) for p, w in zip(pipes, workers)]
        opened = 0
        for n in counts:
            for p, w in zip(pipes[opened:n], workers[opened:n]):
                p.send("open")
                _answer(p, w, timeout)
            opened = n
            for p in pipes[:n]:
                p.send("pss")
            answers = [_answer(p, w, timeout) for p, w in zip(pipes[:n], workers[:n])]
            rows.append({"processes": n, "tier": tier,
                         "summed_pss_growth_bytes": sum(total - base for (total, _), base in zip(answers, baselines)),
                         "summed_segment_pss_bytes": sum(segment for _, segment in answers)})
    finally:
        for p, w in zip(pipes, workers):
            if w.is_alive():
                try:
                    p.send("exit")
                except OSError:
                    pass
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
                w.join(timeout=5)
    return rows
