"""`--routers K`: router replicas with private state, requests spread round-robin by arrival,
rows naming their router; one router is today's run exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from analysis.rundir import load_run
from cli import app
from runtime import CacheConfig, SchedulerConfig
from runtime.router import MetricsRefresh, make_policy
from sim.fleet import simulate_fleet
from sim.fleet_router import make_routers
from sim.simulator import SimConfig
from tests.sim.fleet_support import Replica
from workloads import (
    ArrivalProcess,
    RandomLengths,
    Trace,
    TraceRequest,
    random_trace,
    write_rt_jsonl,
)

CONFIG = SimConfig(scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16,
                                             max_model_len=16384),
                   cache=CacheConfig(block_size=16, num_blocks=400))


def burst(count: int) -> Trace:
    """`count` requests at once, each long enough to stay in flight."""
    return Trace([TraceRequest(f"r{i}", 0.001 * i, 100, 200) for i in range(count)])


def test_each_router_counts_only_its_own_requests() -> None:
    """least-outstanding, 2 replicas: one router alternates 0, 1, 0, 1; two routers each see
    only their own two requests (0 then 1), so the fleet gets 0, 0, 1, 1."""
    replicas = [Replica(CONFIG)] * 2
    one = simulate_fleet(burst(4), replicas, make_policy("least-outstanding"), 0.0)
    two = simulate_fleet(burst(4), replicas,
                         [make_policy("least-outstanding") for _ in range(2)], 0.0)
    assert [r.replica for r in one.requests] == [0, 1, 0, 1]
    assert [r.replica for r in two.requests] == [0, 0, 1, 1]
    assert [r.router for r in two.requests] == [0, 1, 0, 1]
    assert all(r.router is None for r in one.requests)
    assert "router" not in one.requests[0].to_row() and two.requests[1].to_row()["router"] == 1


def test_one_router_in_a_list_is_the_single_router_run() -> None:
    trace = random_trace(60, RandomLengths(150, 30, range_ratio=0.5),
                         ArrivalProcess(request_rate=40.0, seed=2))
    replicas = [Replica(CONFIG)] * 3
    runs = [simulate_fleet(trace, replicas, policy, 0.02)
            for policy in (make_policy("llm-d", seed=3), [make_policy("llm-d", seed=3)])]
    assert [r.to_row() for r in runs[0].requests] == [r.to_row() for r in runs[1].requests]
    assert runs[0].step_columns == runs[1].step_columns


def test_router_scrape_phases_are_staggered() -> None:
    routers = make_routers([make_policy("vllm-dp") for _ in range(4)], 0.05, 0.0)
    assert [r.refresh.phase_s for r in routers] == pytest.approx([0.0, 0.0125, 0.025, 0.0375])
    refresh = MetricsRefresh(0.05, 0.0125)
    assert refresh.last_tick(0.01) == pytest.approx(-0.0375)  # before its first tick
    assert refresh.last_tick(0.07) == pytest.approx(0.0625)
    refresh.store([], 0.07)
    assert refresh.next_due_s == pytest.approx(0.1125)
    with pytest.raises(ValueError, match="own policy instance"):
        policy = make_policy("random")
        make_routers([policy, policy], 0.05, 0.0)


def test_cli_routers_name_the_router_and_one_router_keeps_the_records(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_rt_jsonl(random_trace(20, RandomLengths(120, 10), ArrivalProcess(20.0, seed=1)),
                   trace)
    runner = CliRunner()
    common = ["simulate", "--trace", str(trace), "--replicas", "2", "--router", "vllm-dp"]
    for name, extra in (("base", []), ("one", ["--routers", "1"]), ("two", ["--routers", "2"])):
        result = runner.invoke(app, [*common, *extra, "--result-dir", str(tmp_path / name)])
        assert result.exit_code == 0, result.stderr
    base, one, two = (load_run(tmp_path / n) for n in ("base", "one", "two"))
    assert one.requests.equals(base.requests) and one.steps.equals(base.steps)
    assert list(two.requests["router"]) == [i % 2 for i in range(20)]
    assert two.info["fleet"]["routers"] == 2
    bad = runner.invoke(app, [*common, "--routers", "0", "--result-dir", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--routers must be >= 1, got 0" in bad.stderr
