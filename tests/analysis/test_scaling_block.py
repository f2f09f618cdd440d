"""The console's Scaling block (`analysis.scaling.scaling_block`): what a fleet's cost says
when some or none of its pools has a price."""

from __future__ import annotations

from typing import Any

import pytest

from analysis.scaling import scaling_block


def _pool(name: str, cost_per_hour: float, gpu_hours: float) -> dict[str, Any]:
    # run.json's pool entry (`sim.autoscale.ScalingTimeline.to_json`), one replica
    return {"name": name, "gpus_per_replica": 1, "cost_per_hour": cost_per_hour,
            "gpu_hours": gpu_hours, "cost": gpu_hours * cost_per_hour, "times_s": [0.0],
            "serving": [1], "provisioned": [1]}


@pytest.mark.parametrize(("prices", "pool_costs", "total"), [
    ((14.0, 2.0), ["7.00", "0.50"], "7.50"),
    # b has no price: its cost is not 0.00 and the fleet's leaves it out, saying so
    ((14.0, 0.0), ["7.00", "-"], "7.00 (not priced: b)"),
    ((0.0, 0.0), ["-", "-"], "not priced (--gpu-cost-per-hour, or a pool's cost_per_hour)"),
])
def test_a_pool_without_a_price_is_not_shown_as_free(
        prices: tuple[float, float], pool_costs: list[str], total: str) -> None:
    pools = [_pool("a", prices[0], 0.5), _pool("b", prices[1], 0.25)]
    block = scaling_block({"policy": None, "end_s": 900.0, "gpu_hours": 0.75,
                           "cost": sum(p["cost"] for p in pools), "pools": pools})
    lines = block.splitlines()
    assert [line.split() for line in lines[3:5]] == [
        ["a", "1", "1", "0.500", pool_costs[0]], ["b", "1", "1", "0.250", pool_costs[1]]]
    assert lines[7] == f"{'Cost:':<40} {total}"
