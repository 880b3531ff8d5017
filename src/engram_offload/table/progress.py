"""A byte-count progress bar (rich) for long table passes; silent for small ones."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

PROGRESS_MIN_BYTES = 256 << 20


@contextmanager
def byte_progress(
    description: str, total: int, enabled: bool | None = None
) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(nbytes)``; show a bar when ``enabled`` (default: ``total`` is large)."""
    if enabled is None:
        enabled = total >= PROGRESS_MIN_BYTES
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
        transient=False,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)
