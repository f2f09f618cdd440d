"""`sim.fleet_run.FleetRun`: `rt simulate --replicas N`'s fleet equals `simulate_fleet` run
directly, with run.json's sections; a combination it refuses is one ValueError."""

from __future__ import annotations

import pytest

import workloads
from runtime.router.registry import make_policy
from sim.autoscale_flags import AutoscaleFlags, fixed_scaling
from sim.engine_args import EngineArgs, build_setup
from sim.fleet import simulate_fleet
from sim.fleet_config import FleetFlags
from sim.fleet_run import FleetRun
from sim.pd_flags import PDFlags

TRACE = workloads.first_n(workloads.default_trace(), 60)


def test_fleet_run_equals_simulate_fleet_and_describes_itself() -> None:
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "h200", None, 0)
    fleet = FleetFlags(replicas=3, router="least-outstanding")
    run = FleetRun.build(setup, fleet, PDFlags(), AutoscaleFlags())
    result, sections = run.run(TRACE)
    direct = simulate_fleet(TRACE, [setup] * 3, make_policy("least-outstanding", [], 0),
                            fleet.router_refresh_ms / 1e3, fleet.routing_latency_ms / 1e3)
    assert [r.to_row() for r in result.requests] == [r.to_row() for r in direct.requests]
    assert sections["fleet"] == fleet.describe(None)
    assert sections["pd"] is None and sections["autoscale"] is None
    expected = fixed_scaling(setup, None, fleet, AutoscaleFlags(), direct).to_json()
    assert sections["scaling"] == expected


def test_a_bad_policy_is_a_value_error_before_anything_runs() -> None:
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "h200", None, 0)
    with pytest.raises(ValueError, match="nope"):
        FleetRun.build(setup, FleetFlags(replicas=2, router="nope"), PDFlags(),
                       AutoscaleFlags())
