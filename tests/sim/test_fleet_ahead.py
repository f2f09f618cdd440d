"""Routing ahead (a completion-blind policy decides at its router's last scrape tick before
the arrival): the same records as routing at each arrival, fewer cut decode runs."""

from __future__ import annotations

import pytest

from runtime import CacheConfig, SchedulerConfig
from runtime.router import make_policy
from sim import fleet as fleet_module
from sim.fleet import FleetResult, simulate_fleet
from sim.simulator import EngineProcess, SimConfig
from tests.sim.fleet_support import FIXTURES, Replica
from workloads import (
    ArrivalProcess,
    MultiTurn,
    RandomLengths,
    Trace,
    load_trace,
    multi_turn_trace,
    random_trace,
)


def config(num_blocks: int) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                                  max_model_len=16384),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks))


def traces() -> dict[str, Trace]:
    arrivals = ArrivalProcess(request_rate=60.0, burstiness=0.5, seed=11)
    mooncake = load_trace(FIXTURES / "mooncake_conversation_first300.jsonl").trace
    return {
        "random": random_trace(250, RandomLengths(180, 80, range_ratio=0.8), arrivals),
        "multi_turn": multi_turn_trace(
            50, MultiTurn(num_turns=3, turn_gap_s=0.02, lengths=RandomLengths(64, 40)),
            arrivals),
        "mooncake": Trace(mooncake.requests[:100]),
    }


TRACES = traces()


def run(trace: Trace, policy: str, args: list[str], replicas: int, ahead: bool,
        routers: int = 1) -> FleetResult:
    saved = fleet_module._Fleet.routes_ahead
    fleet_module._Fleet.routes_ahead = ahead
    try:
        return simulate_fleet(trace, [Replica(config(num_blocks=300))] * replicas,
                              [make_policy(policy, args, seed=3 + r) for r in range(routers)],
                              refresh_s=0.02, routing_latency_s=0.001)
    finally:
        fleet_module._Fleet.routes_ahead = saved


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize(("policy", "args", "replicas", "routers"), [
    ("round-robin", [], 3, 1), ("random", [], 4, 1), ("vllm-dp", ["formula=legacy"], 3, 2),
    ("llm-d", [], 4, 1), ("llm-d", [], 3, 3), ("prefix-aware", [], 2, 1),
    ("session-hash", [], 3, 1), ("power-of-two", ["load=snapshot"], 4, 1),
])
def test_routing_ahead_keeps_the_records(name: str, policy: str, args: list[str],
                                         replicas: int, routers: int) -> None:
    assert make_policy(policy, args).completion_blind
    trace = TRACES[name]
    at_arrival, ahead = (run(trace, policy, args, replicas, flag, routers)
                         for flag in (False, True))
    assert [r.to_row() for r in ahead.requests] == [r.to_row() for r in at_arrival.requests]
    assert ahead.step_columns == at_arrival.step_columns


@pytest.mark.parametrize(("policy", "args"), [
    ("least-outstanding", []), ("dynamo-kv", []), ("sglang-cache-aware", []),
    ("kv-aware", []), ("power-of-two", []), ("llm-d", ["active_request=1"]),
    ("llm-d", ["precise_prefix_cache=1"]),
])
def test_policies_reading_completions_are_not_blind(policy: str, args: list[str]) -> None:
    assert not make_policy(policy, args).completion_blind


@pytest.mark.parametrize(("policy", "ahead", "expected"), [
    ("round-robin", True, True), ("llm-d", True, True), ("round-robin", False, False),
    ("least-outstanding", True, False),
])
def test_replicas_step_ahead_of_the_event_loop(policy: str, ahead: bool, expected: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Routing ahead with a completion-blind policy, a replica takes its due hand-overs in
    itself and runs steps without waiting for the event loop (same records, above)."""
    taken: list[str] = []
    submit = EngineProcess.submit  # every replica kind's submit ends here

    def counting(self: EngineProcess, request: object, now: float) -> None:
        if self.env.now < now:  # submitted before the event loop reached the hand-over
            taken.append(request.request_id)  # type: ignore[attr-defined]
        submit(self, request, now)  # type: ignore[arg-type]

    monkeypatch.setattr(EngineProcess, "submit", counting)
    result = run(TRACES["random"], policy, [], 3, ahead)
    assert len(result.requests) == len(TRACES["random"])
    assert bool(taken) is expected
