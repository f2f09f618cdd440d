"""`sim.fleet_run.SimulateRun.simulate_into`: what `rt simulate` hands its output, in order,
and the same run directory through `analysis.run_console.RunConsole` as simulating by hand."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from analysis.run_console import RunConsole
from analysis.rundir import load_run, write_result
from sim.autoscale_flags import AutoscaleFlags
from sim.engine_args import EngineArgs, SimFlags
from sim.fleet_config import FleetFlags
from sim.fleet_run import SimulateRun
from sim.pd_flags import PDFlags
from workloads import ArrivalProcess, RandomLengths, random_trace, trace_info

TRACE = random_trace(12, RandomLengths(64, 8), ArrivalProcess(5.0))


def _run(replicas: int = 1) -> SimulateRun:
    return SimulateRun.build(EngineArgs(), SimFlags(), FleetFlags(replicas=replicas), PDFlags(),
                             AutoscaleFlags(), 0, False)


class _Recorder:
    """A `SimOutput` that records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    @contextlib.contextmanager
    def progress(self, label: str, total: int | None = None
                 ) -> Iterator[Callable[[int, int], None]]:
        self.calls.append(("progress", (label, total)))
        yield lambda done, of: None

    def save(self, path: Path, kind: str, trace: Any, result: Any, describe: Any,
             **extra: Any) -> None:
        self.calls.append(("save", (path, kind, dict(trace), len(result.requests), describe,
                                    extra)))

    def show_simulated(self, path: Path, summary: Any, percentiles: Any, rate: Any,
                       fleet: bool, autoscaled: bool) -> None:
        self.calls.append(("show", (path, summary.num_steps > 0, list(percentiles), rate,
                                    fleet, autoscaled)))

    def tell(self, line: str) -> None:
        self.calls.append(("tell", line))


def test_start_up_lines_then_progress_save_and_show(tmp_path: Path) -> None:
    run, out = _run(), _Recorder()
    run.simulate_into(TRACE, tmp_path / "r", out, [99.0], 5.0)
    assert out.calls == [
        *[("tell", line) for line in run.first.startup_lines],
        ("progress", ("simulating", 12)),
        ("save", (tmp_path / "r", "simulate", trace_info(TRACE), 12, run.first.describe(), {})),
        ("show", (tmp_path / "r", True, [99.0], 5.0, False, False)),
    ]


def test_a_fleet_is_shown_as_one(tmp_path: Path) -> None:
    out = _Recorder()
    _run(replicas=2).simulate_into(TRACE, tmp_path / "f", out, [50.0], None)
    assert out.calls[-1] == ("show", (tmp_path / "f", True, [50.0], None, True, False))
    assert set(out.calls[-2][1][5]) == {"fleet", "pd", "autoscale", "scaling"}


def _never(code: int) -> NoReturn:
    raise AssertionError(f"exit {code}")


def test_through_the_console_the_records_of_simulating_by_hand(tmp_path: Path) -> None:
    printed: list[str] = []
    console = RunConsole(printed.append, printed.append, printed.append, _never)
    run = _run()
    run.simulate_into(TRACE, tmp_path / "console", console, [99.0], None)
    result, extra = run.run(TRACE)
    write_result(tmp_path / "hand", "simulate", trace_info(TRACE), result, run.first.describe(),
                 **extra)
    a, b = load_run(tmp_path / "console"), load_run(tmp_path / "hand")
    assert a.requests.equals(b.requests) and a.steps.equals(b.steps)
    assert printed[:2] == run.first.startup_lines
    assert any(line.startswith("wrote ") and "12 requests" in line for line in printed)
