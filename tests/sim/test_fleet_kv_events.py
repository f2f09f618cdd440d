"""KV events from the replicas' block pools to the routers' precise indexes
(`--kv-event-delay-ms`): what the index holds, when a router sees it, and the choices."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from runtime import CacheConfig, SchedulerConfig
from runtime.router import ReplicaSnapshot, RoutingDecision, RoutingRequest, make_policy
from runtime.router.dynamo import DynamoKv
from sim.fleet import _Fleet, simulate_fleet
from sim.simulator import SimConfig
from tests.sim.fleet_support import FIXTURES, Replica
from workloads import PrefixRepetition, Trace, TraceRequest, load_trace, prefix_repetition_trace
from workloads.arrivals import ArrivalProcess


def config(num_blocks: int = 400, fast_forward: bool = True) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16,
                                  max_model_len=16384),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks), fast_forward=fast_forward)


def shared_prompt_trace(second_at_s: float) -> Trace:
    """A: a 512-token prompt decoding 400 tokens; B: the same prompt at `second_at_s`."""
    prompt = tuple(range(1000, 1512))
    return Trace([TraceRequest("A", 0.0, 512, 400, prompt_token_ids=prompt),
                  TraceRequest("B", second_at_s, 512, 4, prompt_token_ids=prompt)])


@pytest.mark.parametrize("policy", ["dynamo-kv", "kv-aware"])
def test_an_index_fed_without_delay_holds_what_each_pool_caches(policy: str) -> None:
    mooncake = load_trace(FIXTURES / "mooncake_conversation_first300.jsonl").trace
    arrivals = ArrivalProcess(request_rate=30.0, seed=3)
    prefix = prefix_repetition_trace(
        120, PrefixRepetition(prefix_len=200, suffix_len=40, num_prefixes=4, output_len=60),
        arrivals)
    for trace in (Trace(mooncake.requests[:80]), prefix):
        router = make_policy(policy, seed=4)
        fleet = _Fleet(trace, [Replica(config(num_blocks=150))] * 3, router, 0.02, 0.0, None)
        fleet.run()
        fleet.routers[0].deliver_kv_events(math.inf)
        pools = [r.core.scheduler.kv_cache_manager.block_pool for r in fleet.replicas]
        held = [router.precise.hashes(i) for i in range(3)]  # type: ignore[attr-defined]
        assert held == [set(pool.cached_block_ids()) for pool in pools]
        assert sum(len(h) for h in held) > 0


def first_step_end(result_steps: dict[str, list], replica: int) -> float:
    ends = [e for e, r in zip(result_steps["end_s"], result_steps["replica"], strict=True)
            if r == replica]
    return float(ends[0])


def test_a_request_routed_before_delivery_does_not_see_the_blocks() -> None:
    replicas = [Replica(config())] * 2
    base = simulate_fleet(shared_prompt_trace(0.3), replicas, make_policy("kv-aware"), 0.0)
    a, b = base.requests
    assert b.replica == a.replica  # delay 0: A's prompt blocks are seen
    # A's blocks are stored in its first step; the event leaves at that step's end
    emitted = first_step_end(base.step_columns, a.replica)
    assert 0.0 < emitted < 0.3
    delay = 0.1
    for at_s, same in ((emitted + delay, True), (emitted + delay - 1e-6, False)):
        run = simulate_fleet(shared_prompt_trace(at_s), replicas, make_policy("kv-aware"), 0.0,
                             kv_event_delay_s=delay)
        assert first_step_end(run.step_columns, a.replica) == emitted
        assert (run.requests[1].replica == run.requests[0].replica) is same


class RecordingDynamo(DynamoKv):
    def __init__(self) -> None:
        super().__init__()
        self.decisions: list[RoutingDecision] = []

    def choose(self, request: RoutingRequest,
               replicas: Sequence[ReplicaSnapshot]) -> RoutingDecision:
        self.decisions.append(super().choose(request, replicas))
        return self.decisions[-1]


@pytest.mark.parametrize(("delay", "costs"), [(0.0, (32.0, 64.0)), (1.0, (64.0, 64.0))])
def test_dynamo_costs_with_precise_state_by_hand(delay: float,
                                                 costs: tuple[float, float]) -> None:
    """B (32 blocks, all cached on A's replica once A's prefill step ended): there,
    prefill max(0, (0 + 512) / 16 - 1.0 * 32) = 0, decode 32 (A's blocks) + 32 (B's) - 32
    (shared) = 32; on the other, prefill 32, decode 0 + 32. Not yet seen (delay 1 s): A's
    replica has overlap 0, prefill 32 + decode 32 = 64, a tie."""
    policy = RecordingDynamo()
    result = simulate_fleet(shared_prompt_trace(0.3), [Replica(config())] * 2, policy, 0.0,
                            kv_event_delay_s=delay)
    a = result.requests[0].replica
    assert dict(policy.decisions[0].scores) == {0: 32.0 + 32.0, 1: 32.0 + 32.0}
    assert dict(policy.decisions[1].scores) == {a: costs[0], 1 - a: costs[1]}
    if delay == 0.0:
        assert result.requests[1].replica == a


@pytest.mark.parametrize(("formula", "delay", "scores"), [
    ("current", 0.0, (1.0, 0.0)), ("current", 1.0, (0.0, 0.0)),
    ("legacy", 0.0, (1.0, 0.0)), ("legacy", 1.0, (1.0, 1.0))])
def test_llmd_precise_scorer_by_hand(formula: str, delay: float,
                                     scores: tuple[float, float]) -> None:
    """llm-d with only the precise-prefix scorer: leading blocks held / the request's blocks
    (legacy: min-max normalised, all equal -> 1). B's 32 blocks are all on A's replica once
    seen (32/32), none elsewhere; with the delay none is seen yet."""
    args = ["queue=0", "kv_cache_utilization=0", "prefix_cache=0", "precise_prefix_cache=1",
            f"formula={formula}"]
    policy = make_policy("llm-d", args)
    assert policy.wants_kv_events and not policy.completion_blind
    decisions: list[RoutingDecision] = []
    choose = policy.choose

    def recording(request: RoutingRequest,
                  replicas: Sequence[ReplicaSnapshot]) -> RoutingDecision:
        decisions.append(choose(request, replicas))
        return decisions[-1]

    policy.choose = recording  # type: ignore[method-assign]
    result = simulate_fleet(shared_prompt_trace(0.3), [Replica(config())] * 2, policy, 0.0,
                            kv_event_delay_s=delay)
    a = result.requests[0].replica
    assert dict(decisions[1].scores) == {a: scores[0], 1 - a: scores[1]}
    if delay == 0.0:
        assert result.requests[1].replica == a


@pytest.mark.parametrize(("policy", "delay"), [("dynamo-kv", 0.0), ("dynamo-kv", 0.03),
                                               ("kv-aware", 0.0), ("kv-aware", 0.2)])
def test_decode_runs_keep_a_listening_fleets_records(policy: str, delay: float) -> None:
    """Runs end by the next decision minus the delay, their events stamped with their end:
    the same choices and records as stepping one by one."""
    arrivals = ArrivalProcess(request_rate=20.0, burstiness=0.5, seed=5)
    trace = prefix_repetition_trace(
        150, PrefixRepetition(prefix_len=160, suffix_len=40, num_prefixes=5, output_len=90),
        arrivals)
    runs = [simulate_fleet(trace, [Replica(config(200, fast))] * 3, make_policy(policy, seed=2),
                           0.02, kv_event_delay_s=delay) for fast in (False, True)]
    assert [r.to_row() for r in runs[1].requests] == [r.to_row() for r in runs[0].requests]
    assert runs[1].step_columns == runs[0].step_columns
