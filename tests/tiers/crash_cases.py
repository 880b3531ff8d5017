"""Scenarios that once killed the process (SIGSEGV, SIGBUS), run in a child process.

``python crash_cases.py close_during_read TABLE_COPY``, ``python crash_cases.py
truncated '[[TIER, OPTIONS, TABLE_COPY], ...]'`` or ``python crash_cases.py
truncated_mid_read OPTIONS TABLE_COPY TABLE_COPY2`` prints one JSON line of findings and
exits 0; a regression shows as a death by signal, which the test reports instead of dying
itself.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
import torch

from engram_offload.errors import TierError
from engram_offload.table import read_header
from engram_offload.tiers import open_tier


def reference_rows(path: str) -> np.ndarray:
    with open_tier("memory", read_header(path)) as t:
        return t.rows.numpy().copy()


def read_all(t) -> np.ndarray:
    out = torch.empty((t.num_rows, t.row_bytes), dtype=torch.uint8)
    return t.read_rows(np.arange(t.num_rows), out).numpy()


def close_during_read(path: str) -> dict:
    """A reader held inside the mmap tier's gather (injected delay) while another thread closes."""
    from engram_offload.tiers import mmap as mmap_tier

    expected = reference_rows(path)
    entered, go = threading.Event(), threading.Event()
    real_gather = mmap_tier.gather_at

    def slow_gather(*args):
        entered.set()
        go.wait()
        return real_gather(*args)

    mmap_tier.gather_at = slow_gather
    t = open_tier("mmap", read_header(path))
    got: list = []
    reader = threading.Thread(target=lambda: got.append(read_all(t)))
    reader.start()
    entered.wait()
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(0.3)
    close_waited = closer.is_alive()
    go.set()  # before the fix the mapping is gone by now: SIGSEGV here
    reader.join()
    closer.join()
    try:
        read_all(t)
        refused = False
    except ValueError:
        refused = True
    return {"close_waited": close_waited, "rows_ok": bool(np.array_equal(got[0], expected)),
            "refused_after_close": refused}


def truncated_while_open(path: str, tier: str, options: dict) -> dict:
    """The table file cut to half its size under an open store, then read."""
    expected = reference_rows(path)
    with open_tier(tier, read_header(path), **options) as t:
        before = bool(np.array_equal(read_all(t), expected))
        os.truncate(path, os.path.getsize(path) // 2)
        try:
            after = "rows_ok" if np.array_equal(read_all(t), expected) else "wrong_rows"
        except TierError as exc:
            after = f"TierError: {exc}"
    return {"before": before, "after": after}


def truncated_mid_read(options: dict, path: str, path2: str) -> dict:
    """An mmap store whose file is cut short while reads are inside their copy.

    First deterministically: the file is truncated, then a copy out of the mapping past the
    new end runs without the size check before it (what a read that passed the check just
    before the truncation does). Then racing: four threads read random rows in a loop while
    the main thread truncates the file (a bounded loop; each thread must stop on TierError)."""
    header = read_header(path)
    layout = header.layout
    with open_tier("mmap", header, **options) as t:
        os.truncate(path, layout.data_offset)
        page = layout.page_bytes
        try:
            t._copy(np.array([layout.data_offset + 3 * page], np.int64), np.array([page], np.int64),
                    np.empty(page, np.uint8), np.zeros(1, np.int64))
            copy = "no error"
        except TierError as exc:
            copy = f"TierError: {exc}"
    expected = reference_rows(path2)
    outcomes: list = []
    with open_tier("mmap", read_header(path2), **options) as t:
        started = threading.Barrier(5)
        good = threading.Semaphore(0)  # one release per reader after its first right batch

        def reader(seed: int) -> None:
            rng = np.random.default_rng(seed)
            started.wait()
            first = True
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ids = rng.integers(0, t.num_rows, 2048)
                out = torch.empty((len(ids), t.row_bytes), dtype=torch.uint8)
                try:
                    t.read_rows(ids, out)
                except TierError:
                    outcomes.append("TierError")
                    return
                except Exception as exc:  # noqa: BLE001 - reported
                    outcomes.append(f"{type(exc).__name__}: {exc}")
                    return
                if not np.array_equal(out.numpy(), expected[ids]):
                    outcomes.append("wrong rows")
                    return
                if first:
                    good.release()
                    first = False
            outcomes.append("still reading after 30 s")

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        started.wait()
        read_before = sum(good.acquire(timeout=20) for _ in threads)  # every reader read right rows
        time.sleep(0.05)
        os.truncate(path2, layout.data_offset)
        for thread in threads:
            thread.join()
    return {"copy": copy, "read_before": read_before, "readers": sorted(outcomes)}


if __name__ == "__main__":
    if sys.argv[1] == "close_during_read":
        result = close_during_read(sys.argv[2])
    elif sys.argv[1] == "truncated_mid_read":
        result = truncated_mid_read(json.loads(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        result = [truncated_while_open(path, tier, options) for tier, options, path in json.loads(sys.argv[2])]
    print(json.dumps(result))
