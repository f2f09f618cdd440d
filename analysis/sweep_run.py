"""The runs of `rt sweep` and `rt plan`, each point (a grid point, a fleet shape) a run
directory and one record of metrics.

What simulates a point is injected (sim/, which analysis/ does not import), and so is the
executor (`sim.sweep.run_all` with its flags bound): `PointRunner` carries them. A point whose
run directory is complete is read back instead of simulated again, so a sweep or plan run
again into its directory resumes. Jobs and their functions are module-level and frozen, so a
process pool or Ray can ship them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.plan import what_binds
from analysis.progress import progress
from analysis.report import ReportOptions, result_dict
from analysis.rundir import finished_run, save_result
from analysis.sweep import meets_slo, rate_bracket, search_max_rates, search_summary, slo_needs

Simulate = Callable[..., tuple[Any, Any]]  # (point, ...) -> (RunResult, setup with describe())
RunAll = Callable[..., list[dict[str, Any]]]  # (worker, jobs, progress=) -> records, in order
PLAN_RECORD = "plan.json"  # a plan's shape record, beside its run directory's files


def widen_options(options: ReportOptions, slos: Mapping[str, float] | None) -> ReportOptions:
    """The report options, widened to the metrics and percentiles the SLOs need."""
    if not slos:
        return options
    metrics, percentiles = slo_needs(dict(slos))
    return ReportOptions(list(dict.fromkeys([*options.percentile_metrics, *metrics])),
                         sorted(set(options.percentiles) | set(percentiles)), options.goodput)


@dataclass(frozen=True)
class SweepJob:
    point: Any  # sim.sweep.SweepPoint: .labels (its grid values), .trace, .identity()
    trace: dict[str, Any]  # the point trace's identity in run.json: name, requests, digest
    options: ReportOptions
    run_dir: str
    simulate: Simulate  # point -> (result, setup)


def sweep_point(job: SweepJob) -> dict[str, Any]:
    """One sweep point: simulate, write the run directory, report it from the files."""
    labels, path, point = dict(job.point.labels), Path(job.run_dir), job.point.identity()
    run = finished_run(path, sweep=labels, trace=job.trace, point=point)
    if run is None:
        result, setup = job.simulate(job.point)
        rate = {"request_rate": labels["request_rate"]} if "request_rate" in labels else {}
        run = save_result(path, "simulate", job.trace, result, setup.describe(), sweep=labels,
                          point=point, **rate)
    return {**labels, **result_dict(run, job.options), "run_dir": job.run_dir}


@dataclass(frozen=True)
class PlanJob:
    shape: Any  # sim.plan.Shape: .candidate, .name(), .num_replicas, .gpus, .cost_per_hour
    trace: Any  # workloads.Trace, the same for every shape
    identity: dict[str, Any]  # the trace's identity in run.json
    seed: int
    options: ReportOptions
    run_dir: str
    simulate: Simulate  # (shape, trace, seed) -> (result, setup)


def plan_point(job: PlanJob) -> dict[str, Any]:
    """One shape: simulate, write the run directory and its record (plan.json). A directory
    with plan.json whose run has this trace and seed is not run again; its record is made
    afresh (the SLOs may need other metrics: once a KeyError; another trace's run was once
    reported as this one's)."""
    path, shape, c = Path(job.run_dir), job.shape, job.shape.candidate
    plan = {"shape": shape.name(), "replicas": shape.num_replicas}
    saved = finished_run(path, trace=job.identity, seed=job.seed, plan=plan) \
        if (path / PLAN_RECORD).is_file() else None
    if saved is None:
        result, setup = job.simulate(shape, job.trace, job.seed)
        saved = save_result(path, "simulate", job.identity, result, setup.describe(),
                            plan=plan)
    record = {**result_dict(saved, job.options), "shape": shape.name(), "gpu": c.gpu,
              "model": c.model, "tp": c.tensor_parallel_size, "replicas": shape.num_replicas,
              "gpus": shape.gpus, "cost_per_hour": shape.cost_per_hour,
              "binds": what_binds(saved.requests)}
    (path / PLAN_RECORD).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


@dataclass(frozen=True)
class PointRunner:
    """How points run: `run_all(worker, jobs, progress=)` (results in order), `simulate` (a
    point or a shape), `identify(trace)` (its identity in run.json), and the records' report
    options."""

    run_all: RunAll
    simulate: Simulate
    identify: Callable[[Any], dict[str, Any]]
    options: ReportOptions

    def sweep(self, points: Sequence[tuple[Any, str]]) -> list[dict[str, Any]]:
        """The records of (point, run directory) pairs, in order."""
        jobs = [SweepJob(p, self.identify(p.trace), self.options, d, self.simulate)
                for p, d in points]
        with progress("sweeping", len(jobs)) as update:
            return self.run_all(sweep_point, jobs, progress=update)

    def judge(self, shapes: Sequence[Any], trace: Any, seed: int, root: Path,
              slos: dict[str, float], records: list[dict[str, Any]]) -> list[bool]:
        """Simulate the shapes (or read a finished one's record), append their records to
        `records`, say which meet the SLOs."""
        identity = self.identify(trace)
        jobs = [PlanJob(shape, trace, identity, seed, self.options, str(root / shape.name()),
                        self.simulate) for shape in shapes]
        with progress("planning", len(jobs)) as update:
            done = self.run_all(plan_point, jobs, progress=update)
        for record in done:
            record["meets_slo"] = meets_slo(record, slos)
        records += done
        return [bool(r["meets_slo"]) for r in done]


def run_sweep(plan: Any, runner: PointRunner, how: Any, slos: dict[str, float] | None
              ) -> tuple[list[dict[str, Any]], list[str]]:
    """Every record of the sweep, and one summary line per configuration of a rate search.
    `plan` is the `sim.sweep.SweepPlan` (.configs, .job(i, key, value), .grid(key, axis),
    .trace_rate()), `how` its `sim.sweep.SweepFlags` (.axis(), .find_max_rate, .bracket(),
    .rate_tolerance). With --find-max-rate each configuration's request rate is bisected for
    the highest meeting every SLO (`analysis.sweep.search_max_rates`), else the grid runs."""
    key, axis = how.axis()
    if not how.find_max_rate:
        return runner.sweep(plan.grid(key, axis or [None])), []
    if not slos:
        raise ValueError("--find-max-rate needs --slo")
    bracket = rate_bracket(how.bracket(), axis if key == "request_rate" else None,
                           plan.trace_rate())
    records, searches = search_max_rates(
        len(plan.configs), lambda batch: runner.sweep([plan.job(i, "request_rate", r)
                                                        for i, r in batch]),
        slos, bracket, how.rate_tolerance)
    return records, [search_summary(config.labels, search)
                     for config, search in zip(plan.configs, searches, strict=True)]
