"""`rt bench fleet`'s report (sim.bench_fleet.bench_fleet) on a few requests."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import cli
import workloads
from sim.bench_fleet import FleetRun, _fleet_row, _run_order, _scaling_keys, _size_runs, bench_fleet


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
    # --repeat 1 (the default): each size runs once, the ratio is the one pair's, as before
    small, large = runs[2], runs[3]
    ratio = float(large["cpu_s_per_request"]) / float(small["cpu_s_per_request"])
    assert report["cost_per_request_3_vs_1"] == round(ratio, 3)
    assert report["cost_per_request_3_vs_1_runs"] == [round(ratio, 3)]
    assert report["meets_goal_scaling"] == (large["cpu_s_per_request"]
                                            <= small["cpu_s_per_request"])
    assert small["cpu_s_runs"] == [small["cpu_s"]] and small["median_run"] == 1
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
    # once int()'s own words: "invalid literal for int() with base 10: 'x'"
    result = runner.invoke(cli.app, ["bench", "fleet", "--first-n", "5", "--scaling", "4,x"])
    assert result.exit_code == 2 and result.stderr == (
        "rt: error: --scaling: not a comma-separated list of int values: '4,x'\n")


class _StubFleet:
    """A fleet runner that simulates nothing: each call returns the next fixed CPU seconds
    of its size and the size's fixed step count, and records the order of the calls."""

    def __init__(self, cpu_s: dict[int, list[float]], steps: dict[int, int]) -> None:
        self.cpu_s = {count: list(values) for count, values in cpu_s.items()}
        self.steps = steps
        self.calls: list[int] = []

    def __call__(self, count: int) -> tuple[object, float, float]:
        self.calls.append(count)
        replicas = [SimpleNamespace(num_steps=self.steps[count] // count)] * count
        result = SimpleNamespace(replicas=replicas, requests=[], num_steps=self.steps[count])
        return result, 0.5, self.cpu_s[count].pop(0)


def test_run_order_interleaves_the_scaling_fleets() -> None:
    assert _run_order(16, (4, 64), 1) == [16, 4, 64]  # as before --repeat
    assert _run_order(16, (4, 64), 3) == [16, 4, 64, 64, 4, 4, 64]  # every other reversed
    assert _run_order(16, (4, 64), 4) == [16, 4, 64, 64, 4, 4, 64, 64, 4]
    # the --replicas fleet's run is its size's run 1
    assert _run_order(4, (4, 64), 3) == [4, 64, 64, 4, 4, 64]
    assert _run_order(2, (1, 3), 2) == [2, 1, 3, 3, 1]
    assert _run_order(2, (3, 1, 3), 2) == [2, 3, 1, 1, 3]  # each size once a round


def test_scaling_median_of_the_pairs() -> None:
    stub = _StubFleet({16: [3.0], 4: [2.0, 4.0, 2.0], 64: [2.2, 3.0, 1.9]},
                      {16: 1600, 4: 400, 64: 512})
    runs, shares = _size_runs(stub, _run_order(16, (4, 64), 3), 16, workloads.Trace(()))
    assert stub.calls == [16, 4, 64, 64, 4, 4, 64]
    assert list(runs) == [16, 4, 64]  # the report's rows in this order
    assert len(shares) == 16  # the --replicas fleet's, one (empty) share per replica
    assert [r.cpu_s for r in runs[4]] == [2.0, 4.0, 2.0] and runs[64][0].steps == 512
    keys = _scaling_keys(runs[4], runs[64])
    # pairs 2.2/2.0, 3.0/4.0, 1.9/2.0: median 0.95; per step x400/512
    assert keys == {"cost_per_request_64_vs_4": 0.95, "meets_goal_scaling": True,
                    "cost_per_request_64_vs_4_runs": [1.1, 0.75, 0.95],
                    "cost_per_request_64_vs_4_spread": [0.75, 1.1],
                    "cost_per_step_64_vs_4": round(0.95 * 400 / 512, 3)}
    row = _fleet_row(runs[64], 100, 0.02)
    # the lower median by CPU seconds is run 1 (2.2 s: 1.9, 2.2, 3.0)
    assert row["median_run"] == 1 and row["cpu_s"] == 2.2 and row["steps"] == 512
    assert row["cpu_s_runs"] == [2.2, 3.0, 1.9] and row["cpu_s_per_request"] == 2.2 / 100
    assert row["vs_single_engine_per_request"] == round(0.02 / 0.022, 3)


def test_scaling_even_repeat_averages_the_middle_pairs() -> None:
    small = [FleetRun(4, 1.0, 1.0, 100), FleetRun(4, 1.0, 2.0, 100)]
    large = [FleetRun(64, 1.0, 1.1, 200), FleetRun(64, 1.0, 1.6, 200)]
    keys = _scaling_keys(small, large)
    assert keys["cost_per_request_64_vs_4"] == 0.95  # (1.1 + 0.8) / 2
    assert keys["meets_goal_scaling"] is True
    assert keys["cost_per_step_64_vs_4"] == 0.475
    one = _scaling_keys(small[:1], large[:1])  # --repeat 1: the one pair
    assert one["cost_per_request_64_vs_4"] == 1.1 and one["meets_goal_scaling"] is False
    assert one["cost_per_request_64_vs_4_runs"] == [1.1]


def test_bench_fleet_repeat_rows() -> None:
    trace = workloads.first_n(workloads.default_trace(), 20)
    report = bench_fleet(trace, "first 20", replicas=2, scaling=(1, 3), baseline=False,
                         sim_workers=1, repeat=2)
    runs = report["runs"]
    assert isinstance(runs, list)
    assert [r["run"] for r in runs] == [
        "single engine, trace as recorded", "2 replicas, trace x2 faster",
        "1 replicas, trace x1 faster", "3 replicas, trace x3 faster",
        "2 replicas' shares on one engine each", "2 replicas, trace x2 faster, 1 sim workers"]
    assert [len(r["cpu_s_runs"]) for r in runs[1:4]] == [1, 2, 2]
    assert runs[2]["steps"] == runs[0]["steps"]
    assert report["repeat"] == 2 and len(report["cost_per_request_3_vs_1_runs"]) == 2
    assert isinstance(report["cost_per_step_3_vs_1"], float)
    assert "median of 2 interleaved pairs" in str(report["goals"])


@pytest.mark.parametrize(("value", "line"), [
    ("0", "rt: error: Invalid value for '--repeat': Input should be greater than or equal "
          "to 1 (got '0')"),
    ("21", "rt: error: --repeat must be at most 20, got 21")])
def test_bench_fleet_repeat_bounds(value: str, line: str) -> None:
    result = CliRunner().invoke(cli.app, ["bench", "fleet", "--first-n", "5", "--repeat", value])
    assert result.exit_code == 2 and result.stderr.splitlines() == [line]
