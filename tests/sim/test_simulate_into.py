"""`sim.fleet_run.SimulateRun.simulate_into`: what `rt simulate` hands its output, in order,
and the same run directory through `analysis.run_console.RunConsole` as simulating by hand."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

from analysis.run_console import RunConsole
from analysis.rundir import load_run, write_result
from sim.autoscale_flags import AutoscaleFlags
from sim.engine_args import EngineArgs, SimFlags
from sim.fleet_config import FleetFlags
from sim.fleet_run import SimulateRun
from sim.pd_flags import PDFlags
from tests.run_output import Recorder
from workloads import ArrivalProcess, RandomLengths, random_trace, trace_info

TRACE = random_trace(12, RandomLengths(64, 8), ArrivalProcess(5.0))


def _run(replicas: int = 1) -> SimulateRun:
    return SimulateRun.build(EngineArgs(), SimFlags(), FleetFlags(replicas=replicas), PDFlags(),
                             AutoscaleFlags(), 0, False)


def test_start_up_lines_then_progress_save_and_show(tmp_path: Path) -> None:
    run, out = _run(), Recorder()
    run.simulate_into(TRACE, tmp_path / "r", out, [99.0], 5.0)
    (_, (path, kind, trace, result, describe, extra)), (_, shown) = out.calls[-2:]
    assert out.calls[:-2] == [*[("tell", line) for line in run.first.startup_lines],
                              ("progress", ("simulating", 12))]
    assert (path, kind, trace, len(result.requests), extra) == (
        tmp_path / "r", "simulate", trace_info(TRACE), 12, {})
    assert describe == run.first.describe()
    assert shown == (tmp_path / "r", result.summary(), [99.0], 5.0, False, False)


def test_a_fleet_is_shown_as_one(tmp_path: Path) -> None:
    out = Recorder()
    _run(replicas=2).simulate_into(TRACE, tmp_path / "f", out, [50.0], None)
    assert out.calls[-1][1][2:] == ([50.0], None, True, False)
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
