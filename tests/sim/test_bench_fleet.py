"""`rt bench fleet`'s report (sim.bench_fleet.bench_fleet) on a few requests."""

from __future__ import annotations

import json

from typer.testing import CliRunner

import cli
import workloads
from sim.bench_fleet import bench_fleet


def test_bench_fleet_report() -> None:
    trace = workloads.first_n(workloads.default_trace(), 40)
    report = bench_fleet(trace, "first 40", replicas=2, scaling=(1, 3), router="llm-d")
    runs = report["runs"]
    assert isinstance(runs, list)
    assert [r["run"] for r in runs] == [
        "single engine, trace as recorded", "2 replicas, trace x2 faster",
        "1 replicas, trace x1 faster", "3 replicas, trace x3 faster",
        "2 replicas' shares on one engine each", "2 replicas stepping one by one"]
    assert all(r["requests"] == 40 for r in runs)
    # one replica on the trace as recorded is the single engine: the same steps
    assert runs[2]["steps"] == runs[0]["steps"]
    # each replica is a single engine on its share of the requests: the same steps
    assert runs[4]["steps"] == runs[1]["steps"]
    assert runs[5]["steps"] == runs[1]["steps"]  # fast-forward changes no record
    assert set(report) >= {"fleet_vs_single_engine_per_request", "meets_goal_rate",
                           "cost_per_request_3_vs_1", "meets_goal_scaling",
                           "speedup_vs_stepped", "fleet_vs_replica_engines_per_request"}
    # llm-d reads the replicas: no parallel row, its keys empty
    assert report["sim_workers"] is None and report["meets_goal_rate_wall"] is None
    assert report["fleet_parallel_vs_single_engine_wall"] is None
    json.dumps(report)


def test_bench_fleet_parallel_row() -> None:
    trace = workloads.first_n(workloads.default_trace(), 40)
    report = bench_fleet(trace, "first 40", replicas=3, scaling=(1, 2), baseline=False,
                         sim_workers=2)
    runs = report["runs"]
    assert isinstance(runs, list)
    assert [r["run"] for r in runs][-1] == "3 replicas, trace x3 faster, 2 sim workers"
    assert runs[-1]["steps"] == runs[1]["steps"] and runs[-1]["sim_workers"] == 2
    assert report["sim_workers"] == 2
    assert isinstance(report["fleet_parallel_vs_single_engine_wall"], float)
    assert isinstance(report["meets_goal_rate_wall"], bool)
    assert "meets_goal_rate_wall" in str(report["goals"])


def test_bench_fleet_cli_bad_input() -> None:
    runner = CliRunner()
    result = runner.invoke(cli.app, ["bench", "fleet", "--first-n", "5", "--scaling", "4"])
    assert result.exit_code == 2
    result = runner.invoke(cli.app, ["bench", "fleet", "--first-n", "5", "--router", "nope"])
    assert result.exit_code == 2
