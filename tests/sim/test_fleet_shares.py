"""Each replica of a fleet is the single-engine simulator on its share of the requests: the
fleet adds routing and hand-overs, never engine work (no step differs, none is added), with
policies routing ahead and at the arrival alike, each replica with its own front end. `rt
bench fleet` times these shares as the fleet's work without the fleet."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.router import make_policy
from sim.cost.api_server import ApiServerCost
from sim.cost.profile_model import ProfileCoefficients
from sim.engine_args import token_times
from sim.fleet import FleetResult, simulate_fleet
from sim.fleet_config import build_fleet, parse_fleet
from sim.profile import Profile, write_profile
from sim.simulator import simulate
from tests.sim.test_fleet import COST, TRACES, Replica, config
from workloads import Trace


def replica_rows(result: FleetResult, index: int) -> tuple[list[dict[str, object]],
                                                           dict[str, list[object]]]:
    """Replica `index`'s request rows (without the fleet's columns) and step columns."""
    requests = []
    for record in result.requests:
        if record.replica == index:
            row = record.to_row()
            del row["replica"], row["routing_s"]
            requests.append(row)
    mask = [r == index for r in result.step_columns["replica"]]
    steps = {name: [v for v, keep in zip(values, mask, strict=True) if keep]
             for name, values in result.step_columns.items() if name != "replica"}
    return requests, steps


@pytest.mark.parametrize("policy", ["round-robin", "llm-d", "least-outstanding", "dynamo-kv"])
@pytest.mark.parametrize("name", ["random", "prefix"])
def test_each_replica_is_one_engine_on_its_share(policy: str, name: str) -> None:
    trace, cfg = TRACES[name], config(num_blocks=150, max_num_seqs=16, budget=512)
    result = simulate_fleet(trace, [Replica(cfg)] * 3, make_policy(policy, seed=4),
                            refresh_s=0.02)
    where = {record.request_id: record.replica for record in result.requests}
    assert len(set(where.values())) >= 2  # the requests spread
    for index in range(3):
        share = Trace(tuple(req for req in trace if where[req.request_id] == index))
        expected = simulate(share, cfg, COST)
        requests, steps = replica_rows(result, index)
        assert requests == [r.to_row() for r in expected.requests]
        assert steps == {name: list(values) for name, values in expected.step_columns.items()}
        assert result.replicas[index].num_steps == expected.num_steps


def mixed_fleet_file(tmp_path: Path) -> str:
    """Two replicas without a front-end output cost (roofline), then one whose profile has
    one (fitted on client-side times)."""
    profile = tmp_path / "client.json"
    write_profile(Profile(device="H200", model="Llama-3.1-8B", dtype="bfloat16", versions={},
                          date="2026-12-02T00:00:00Z",
                          coefficients=ProfileCoefficients(2e-3, 6e-5, 2e-5, 3e-6, 1e-9, 2e-8),
                          api_server=ApiServerCost(per_output_token_s=2e-4)), profile)
    pool = '[[pool]]\nname = "{}"\ncount = {}\ngpu = "h200"\nmodel = "llama-3.1-8b"\n'
    return pool.format("engine", 2) + pool.format("client", 1) + f'profile = "{profile}"\n'


@pytest.mark.parametrize("policy", ["round-robin", "llm-d"])  # pre-routed, stepping
def test_each_replica_delivers_tokens_through_its_own_front_end(policy: str,
                                                                tmp_path: Path) -> None:
    setups = build_fleet(parse_fleet(mixed_fleet_file(tmp_path)))
    assert [s.config.api_server.per_output_token_s for s in setups] == [0.0, 0.0, 2e-4]
    assert token_times([setups[0].config]) == "engine"  # run.json: any replica's counts
    assert token_times([s.config for s in setups]) == "client"
    trace = TRACES["random"]
    result = simulate_fleet(trace, setups, make_policy(policy, seed=4), refresh_s=0.02)
    where = {record.request_id: record.replica for record in result.requests}
    for index, setup in enumerate(setups):
        share = Trace(tuple(req for req in trace if where[req.request_id] == index))
        expected = simulate(share, setup.config, setup.cost_model)  # delivered if it costs
        assert replica_rows(result, index)[0] == [r.to_row() for r in expected.requests]
