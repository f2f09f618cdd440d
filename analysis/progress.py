"""The one progress bar of every long command (simulate, replay, sweep, calibrate)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress(label: str, total: int | None = None) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr, shown once the work has taken a second and only when
    stderr is a terminal (a transient bar leaves a blank line in a log, one per bar); yields
    update(done, total) for the drivers' progress callbacks."""
    import time

    from rich.console import Console
    from rich.progress import Progress

    started, bar, task, console = time.perf_counter(), None, 0, Console(stderr=True)

    def update(done: int, of: int) -> None:
        nonlocal bar, task
        if bar is None:
            if not console.is_terminal or time.perf_counter() - started < 1.0:
                return
            bar = Progress(console=console, transient=True)
            bar.start()
            task = bar.add_task(label, total=total or of)
        bar.update(task, completed=done, total=of or total)

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()
