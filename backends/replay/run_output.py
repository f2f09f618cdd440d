"""Where a replay's run goes and how it is shown: the caller's, as one object. Run directories
and vLLM's result blocks are analysis/'s (which backends/ does not import); the terminal and
the exit status are the CLI's. `analysis.run_console.RunConsole` is the one the CLI builds."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NoReturn, Protocol

from runtime.records import RunResult

Progress = Callable[[int, int], None]  # (requests finished, requests in the trace)
INTERRUPTED = "interrupted: records of the requests so far were written"  # said on Ctrl-C


class RunOutput(Protocol):
    """A run's output: its progress bar, its run directory, what is printed, how it ends."""

    def progress(self, label: str, total: int | None = None
                 ) -> AbstractContextManager[Progress]:
        """A progress bar over `total` requests, updated through the function it yields."""

    def save(self, path: Path, kind: str, trace: Mapping[str, Any], result: RunResult,
             describe: Mapping[str, Any], **extra: Any) -> None:
        """Write a driver's result as run directory `path` (`trace`: `workloads.trace_info`;
        `describe` and `extra`: run.json's sections)."""

    def write(self, path: Path, kind: str, trace: Mapping[str, Any],
              rows: Sequence[dict[str, Any]], fields: Mapping[str, Any]) -> None:
        """Write a client-timed run (request rows, no steps) as run directory `path`."""

    def show(self, path: Path, result: RunResult | None, percentiles: Sequence[float]
             ) -> None:
        """Print the run at `path`: vLLM's result block (these percentiles), and with the
        driver's `result` rt's block and where it was written."""

    def say(self, line: str) -> None:
        """A status line for the user."""

    def tell(self, line: str) -> None:
        """A plain line for the user (vLLM's start-up lines)."""

    def exit(self, code: int) -> NoReturn:
        """End the command with this exit status (130: interrupted)."""
