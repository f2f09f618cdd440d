"""A run's output on the terminal, as the one object the drivers' libraries take
(`backends.replay.run_output.RunOutput`): run directories written with `analysis.rundir`,
vLLM's result blocks with `analysis.console`, one progress bar; the terminal's lines and the
exit status are the CLI's functions, given once."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from analysis.console import show_run, show_written_run
from analysis.fidelity import report_fidelity_dirs
from analysis.progress import progress
from analysis.rundir import load_run, run_info, write_result, write_run
from analysis.scaling import show_fleet


@dataclass(frozen=True)
class RunConsole:
    """Where runs go and how they are shown: `echo` prints a result block (stdout), `say` a
    status line and `tell` a plain line (stderr); `exit` ends the command with a status."""

    echo: Callable[[str], None]
    say: Callable[[str], None]
    tell: Callable[[str], None]
    exit: Callable[[int], NoReturn]

    @contextmanager
    def progress(self, label: str, total: int | None = None
                 ) -> Iterator[Callable[[int, int], None]]:
        """`analysis.progress.progress`: the one progress bar."""
        with progress(label, total) as update:
            yield update

    def save(self, path: Path, kind: str, trace: Mapping[str, Any], result: Any,
             describe: Mapping[str, Any], **extra: Any) -> None:
        """`analysis.rundir.write_result`: a driver's `RunResult` as a run directory."""
        write_result(path, kind, trace, result, describe, **extra)

    def write(self, path: Path, kind: str, trace: Mapping[str, Any],
              rows: Sequence[dict[str, Any]], fields: Mapping[str, Any]) -> None:
        """A client-timed run: its request rows, no steps, run.json's head and `fields`."""
        write_run(path, rows, {},
                  run_info(kind, path.name, trace, **fields))

    def show(self, path: Path, result: Any, percentiles: Sequence[float]) -> None:
        """`analysis.console.show_run` of the run directory at `path`."""
        show_run(load_run(path), result, percentiles, None, self.echo, self.say)

    def show_simulated(self, path: Path, summary: Any, percentiles: Sequence[float],
                       request_rate: float | None, fleet: bool, autoscaled: bool) -> None:
        """`analysis.console.show_written_run` (streamed: a fraction of the memory), then a
        fleet's blocks (`analysis.scaling.show_fleet`)."""
        run = show_written_run(path, summary, percentiles, request_rate, self.echo, self.say)
        if fleet:
            show_fleet(run, autoscaled, self.echo, self.say)

    def report_fidelity(self, dirs: Any, root: Path, plots: bool, max_error: float | None
                        ) -> bool:
        """`analysis.fidelity.report_fidelity_dirs` of what a fidelity run wrote (`dirs`:
        `sim.fidelity_run.FidelityDirs`); True when an error exceeds `max_error`."""
        return report_fidelity_dirs(dirs.reals, dirs.sims, dirs.predict, root, plots,
                                    max_error, self.echo, self.say, dirs.calibrations,
                                    dirs.extra)
