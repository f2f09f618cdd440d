"""Sleeping through runs: behind routers that read completions but neither snapshots nor KV
events (least-outstanding, power-of-two on its in-flight counts, sglang-cache-aware), a
replica with no routed request waiting sleeps through a plain decode run that nothing not
yet routed could cut, instead of cutting it at every arrival: the same records, fewer runs
(docs/fleet.md)."""

from __future__ import annotations

import pytest

from runtime import CacheConfig, EngineCore, SchedulerConfig
from runtime.router import make_policy
from sim import fleet as fleet_module
from sim.cost.api_server import ApiServerCost
from sim.fleet import FleetResult, simulate_fleet
from sim.simulator import SimConfig
from sim.step_noise import StepNoise
from tests.sim.fleet_support import Replica
from tests.sim.test_fleet_ahead import TRACES

SLEEPING = [("least-outstanding", []), ("power-of-two", []), ("sglang-cache-aware", [])]


def config(num_blocks: int, noise: StepNoise | None = None,
           api: ApiServerCost | None = None) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                                  max_model_len=16384),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks), step_noise=noise,
        api_server=api or ApiServerCost())


def run(trace_name: str, policy: str, args: list[str], replicas: int, sleeps: bool,
        routers: int = 1, noise: StepNoise | None = None, instant: bool = False
        ) -> FleetResult:
    """`instant`: no routing latency and no API-server time (a request reaches its
    replica's core at its arrival, the moment it is routed)."""
    saved = fleet_module._Fleet.sleeps_through_runs_allowed
    fleet_module._Fleet.sleeps_through_runs_allowed = sleeps
    api = ApiServerCost(0.0, 0.0) if instant else None
    try:  # a small pool first: prompts it cannot hold go to the others
        setups = [Replica(config(num_blocks=60 if i == 0 else 300, noise=noise, api=api))
                  for i in range(replicas)]
        return simulate_fleet(TRACES[trace_name], setups,
                              [make_policy(policy, args, seed=5 + r) for r in range(routers)],
                              refresh_s=0.02, routing_latency_s=0.0 if instant else 0.001)
    finally:
        fleet_module._Fleet.sleeps_through_runs_allowed = saved


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize(("policy", "args", "replicas", "routers", "noisy", "instant"), [
    ("least-outstanding", [], 3, 1, False, False), ("least-outstanding", [], 5, 2, True, False),
    ("least-outstanding", [], 4, 1, False, True),  # routed and handed over at once
    ("power-of-two", [], 4, 1, False, False), ("sglang-cache-aware", [], 3, 1, True, False),
])
def test_sleeping_through_runs_keeps_the_records(name: str, policy: str, args: list[str],
                                                 replicas: int, routers: int, noisy: bool,
                                                 instant: bool) -> None:
    chosen = make_policy(policy, args)
    assert chosen.snapshot_blind and not chosen.completion_blind
    noise = StepNoise((0.7, 1.0, 1.6), seed=3) if noisy else None
    cut, slept = (run(name, policy, args, replicas, flag, routers, noise, instant)
                  for flag in (False, True))
    assert [r.to_row() for r in slept.requests] == [r.to_row() for r in cut.requests]
    assert slept.step_columns == cut.step_columns


@pytest.mark.parametrize(("policy", "args", "sleeps"), [
    *((policy, args, True) for policy, args in SLEEPING),
    ("round-robin", [], False),  # pre-routed: each replica runs its share in one go
    ("llm-d", [], False),  # completion-blind: steps ahead instead
    ("llm-d", ["active_request=1"], False),  # reads completions and snapshots
    ("power-of-two", ["load=snapshot"], False),  # reads snapshots
    ("dynamo-kv", [], False),  # reads KV events
])
def test_which_fleets_sleep_through_runs(policy: str, args: list[str], sleeps: bool) -> None:
    fleet = fleet_module._Fleet(TRACES["random"], [Replica(config(300))] * 2,
                                make_policy(policy, args), 0.02, 0.001, None)
    assert fleet.sleeps_through_runs is sleeps
    assert all(r.sleeps_through_runs is sleeps for r in fleet.replicas)


def test_a_sleeping_replica_runs_fewer_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[float] = []
    fast_forward = EngineCore.fast_forward

    def counting(self: EngineCore, clock: float, *args: object) -> float | None:
        end = fast_forward(self, clock, *args)  # type: ignore[arg-type]
        if end is not None:
            runs.append(end)
        return end

    monkeypatch.setattr(EngineCore, "fast_forward", counting)
    counts = []
    for sleeps in (False, True):
        runs.clear()
        result = run("random", "least-outstanding", [], 4, sleeps)
        assert len(result.requests) == len(TRACES["random"])
        counts.append(len(runs))
    cut, slept = counts
    assert slept < cut
