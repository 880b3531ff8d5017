"""Progress of long passes: a rich bar on a terminal, periodic lines elsewhere (a log, a pipe,
CI), silent for small passes."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

from ..units import format_bytes

PROGRESS_MIN_BYTES = 256 << 20
LINE_SECONDS = 10.0  # off a terminal: one line at most this often, and one at the end


class LineProgress:
    """Progress as plain lines on ``stream`` (default stderr): ``update(done)`` prints
    ``"DESCRIPTION: DONE of TOTAL (P%)"`` when ``every`` seconds (default ``LINE_SECONDS``) have
    passed since the last line; ``close()`` prints the last one."""

    def __init__(self, description: str, total: float, show: Callable[[float], str] = str,
                 every: float | None = None, stream: TextIO | None = None) -> None:
        self.description, self.total, self.show = description, total, show
        self.every = LINE_SECONDS if every is None else every
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0.0
        self.extra = ""
        self._last = time.monotonic()
        self._printed = -1.0

    def update(self, done: float, extra: str = "") -> None:
        self.done, self.extra = done, extra
        if time.monotonic() - self._last >= self.every:
            self._line()

    def advance(self, n: float) -> None:
        self.update(self.done + n)

    def close(self) -> None:
        if self._printed != self.done:
            self._line()

    def _line(self) -> None:
        self._last = time.monotonic()
        self._printed = self.done
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        print(f"{self.description}: {self.show(self.done)} of {self.show(self.total)}{share}"
              + (f"  {self.extra}" if self.extra else ""), file=self.stream, flush=True)


def on_terminal() -> bool:
    """Whether stderr is a terminal (a bar redraws in place) rather than a file or a pipe."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def byte_progress(
    description: str, total: int, enabled: bool | None = None
) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(nbytes)``; show progress when ``enabled`` (default: ``total`` is large):
    a bar on a terminal, a line every ``LINE_SECONDS`` elsewhere."""
    if enabled is None:
        enabled = total >= PROGRESS_MIN_BYTES
    if not enabled:
        yield lambda n: None
        return
    if not on_terminal():
        lines = LineProgress(description, total, format_bytes)
        yield lines.advance
        lines.close()
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
