"""Each replica of a fleet is the single-engine simulator on its share of the requests: the
fleet adds routing and hand-overs, never engine work (no step differs, none is added), with
policies routing ahead and at the arrival alike. `rt bench fleet` times these shares as
the fleet's work without the fleet."""

from __future__ import annotations

import pytest

from runtime.router import make_policy
from sim.fleet import FleetResult, simulate_fleet
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
