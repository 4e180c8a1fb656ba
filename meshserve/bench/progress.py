"""The live progress bar of ``meshserve bench`` (``rich.progress``).

One bar per measured run (a sweep point of one target), advanced as each request
finishes. It draws on stderr, only when stderr is a terminal and ``--quiet`` is
off; otherwise every call is a no-op, so logs and CI output stay clean.
"""

from __future__ import annotations

import sys
from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from meshserve.bench.loop import RequestResult


class ProgressBars:
    """A context manager over one ``rich.progress.Progress``.

    Args:
        enabled: draw bars (``live_progress_enabled`` decides for the CLI).
    """

    def __init__(self, enabled: bool):
        self._progress = None
        if enabled:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(stderr=True), transient=False)

    def __enter__(self) -> "ProgressBars":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def bar(self, label: str, total: int) -> Callable[[RequestResult], None] | None:
        """A new bar of ``total`` requests; returns the ``on_result`` callback that advances
        it by one (None when disabled)."""
        if self._progress is None:
            return None
        task = self._progress.add_task(label, total=total)
        return lambda _result: self._progress.advance(task)


def live_progress_enabled(quiet: bool) -> bool:
    """True when bars should be drawn: not ``quiet`` and stderr is a terminal."""
    return not quiet and sys.stderr.isatty()
