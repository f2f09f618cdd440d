"""`analysis.sweep_run`: a sweep point and a plan shape as run directory + record, resumed
from a finished directory without simulating again; report options widened to the SLOs;
the sweep's grid or rate search."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import workloads
from analysis.report import ReportOptions
from analysis.sweep_run import PlanJob, SweepJob, plan_point, run_sweep, sweep_point, widen_options
from sim.engine_args import EngineArgs
from sim.plan import Candidate, Shape, simulate_shape
from sim.sweep import SweepPoint, simulate_point

OPTIONS = ReportOptions(["ttft"], [50.0], [])
TRACE = workloads.first_n(workloads.default_trace(), 20)
IDENTITY = {"name": TRACE.name, "requests": len(TRACE), "digest": workloads.trace_digest(TRACE)}


def _never(*args: Any) -> Any:
    raise AssertionError("a finished point was simulated again")


def test_widen_options_adds_what_the_slos_need_once() -> None:
    assert widen_options(OPTIONS, None) == OPTIONS
    wide = widen_options(OPTIONS, {"p99_ttft_ms": 500.0, "p90_itl_ms": 50.0})
    assert wide.percentile_metrics == ["ttft", "itl"]
    assert wide.percentiles == [50.0, 90.0, 99.0]


def test_sweep_point_writes_the_run_then_resumes_it(tmp_path: Path) -> None:
    point = SweepPoint(TRACE, EngineArgs(max_num_seqs=8), "llama-3.1-8b", "h200", None, 0,
                       {"max_num_seqs": 8})
    job = SweepJob(point, IDENTITY, OPTIONS, str(tmp_path / "p"), simulate_point)
    first = sweep_point(job)
    assert first["max_num_seqs"] == 8 and first["completed"] == 20
    assert first["run_dir"] == str(tmp_path / "p")
    again = sweep_point(SweepJob(point, IDENTITY, OPTIONS, str(tmp_path / "p"), _never))
    # `date` is when the report was made (vLLM's bench JSON: when it was written), so a
    # resume one second later differs there and nowhere else
    assert {**again, "date": None} == {**first, "date": None}


def test_plan_point_writes_its_record_then_reads_it_back(tmp_path: Path) -> None:
    shape = Shape(Candidate("h200", "llama-3.1-8b", 1, 2048, 64, "round-robin"), 2, 4.0)
    job = PlanJob(shape, TRACE, IDENTITY, 0, OPTIONS, str(tmp_path / shape.name()),
                  simulate_shape)
    record = plan_point(job)
    assert (record["shape"], record["replicas"], record["gpus"]) == (shape.name(), 2, 2)
    assert (tmp_path / shape.name() / "plan.json").is_file()
    again = plan_point(PlanJob(shape, TRACE, IDENTITY, 0, OPTIONS, job.run_dir, _never))
    assert {**again, "date": None} == {**record, "date": None}  # `date`: as the sweep's


def test_a_point_of_other_settings_is_simulated_again(tmp_path: Path) -> None:
    """A sweep run again into its directory with another --gpu (same labels) reported the
    first GPU's runs, exit 0."""
    point = SweepPoint(TRACE, EngineArgs(max_num_seqs=8), "llama-3.1-8b", "h200", None, 0,
                       {"max_num_seqs": 8})
    sweep_point(SweepJob(point, IDENTITY, OPTIONS, str(tmp_path / "p"), simulate_point))
    other = SweepPoint(TRACE, EngineArgs(max_num_seqs=8), "llama-3.1-8b", "l40s", None, 0,
                       {"max_num_seqs": 8})
    again = sweep_point(SweepJob(other, IDENTITY, OPTIONS, str(tmp_path / "p"),
                                 simulate_point))
    assert again["completed"] == 20
    run = json.loads((tmp_path / "p" / "run.json").read_text())
    assert (run["gpu"]["name"], run["point"]["gpu"]) == ("L40S-48GB", "l40s")


def test_a_shape_of_another_trace_or_slo_is_not_read_back_stale(tmp_path: Path) -> None:
    """rt plan run again into its directory reported another trace's runs as this one's,
    and a new SLO's metric was a KeyError (plan.json held the first run's metrics only)."""
    shape = Shape(Candidate("h200", "llama-3.1-8b", 1, 2048, 64, "round-robin"), 1, 4.0)
    run_dir = str(tmp_path / shape.name())
    plan_point(PlanJob(shape, TRACE, IDENTITY, 0, OPTIONS, run_dir, simulate_shape))
    wider = ReportOptions(["ttft", "itl"], [50.0, 90.0], [])
    resumed = plan_point(PlanJob(shape, TRACE, IDENTITY, 0, wider, run_dir, _never))
    assert "p90_itl_ms" in resumed
    ten = workloads.first_n(TRACE, 10)
    identity = {"name": ten.name, "requests": 10, "digest": workloads.trace_digest(ten)}
    record = plan_point(PlanJob(shape, ten, identity, 0, OPTIONS, run_dir, simulate_shape))
    assert record["completed"] == 10


class _How:
    def __init__(self, find_max_rate: bool) -> None:
        self.find_max_rate = find_max_rate

    def axis(self) -> tuple[str, list[float]]:
        return "request_rate", [1.0, 2.0]


class _Plan:
    def grid(self, key: str, axis: list[float]) -> list[tuple[str, str]]:
        return [(f"{key}={v}", f"dir{v}") for v in axis]


class _Runner:
    def sweep(self, points: list[tuple[str, str]]) -> list[dict[str, Any]]:
        return [{"point": p, "run_dir": d} for p, d in points]


def test_run_sweep_runs_the_grid_and_needs_slos_to_search() -> None:
    records, lines = run_sweep(_Plan(), _Runner(), _How(False), None)  # type: ignore[arg-type]
    assert records == [{"point": "request_rate=1.0", "run_dir": "dir1.0"},
                       {"point": "request_rate=2.0", "run_dir": "dir2.0"}] and lines == []
    with pytest.raises(ValueError, match="--find-max-rate needs --slo"):
        run_sweep(_Plan(), _Runner(), _How(True), None)  # type: ignore[arg-type]
