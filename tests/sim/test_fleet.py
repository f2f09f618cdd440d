"""The fleet simulator: one replica is the single-engine simulator exactly (front-end output
cost included); N replicas route every request once, finish it, and keep the attribution
summing to E2E."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest

from runtime import CacheConfig, SchedulerConfig
from runtime.records import PART_COLUMNS
from runtime.router import (
    ReplicaSnapshot,
    RouterPolicy,
    RoutingDecision,
    RoutingRequest,
    make_policy,
)
from sim import fleet as fleet_module
from sim.autoscale import _AutoscaledFleet
from sim.cost.api_server import ApiServerCost
from sim.fleet import FleetResult, can_ever_fit, simulate_fleet
from sim.simulator import SimConfig, simulate
from sim.step_noise import StepNoise
from tests.sim.fleet_support import COST, FIXTURES, Replica
from workloads import (
    ArrivalProcess,
    MultiTurn,
    PrefixRepetition,
    RandomLengths,
    Trace,
    TraceRequest,
    load_trace,
    multi_turn_trace,
    prefix_repetition_trace,
    random_trace,
)

POLICIES = ("round-robin", "random", "least-outstanding", "vllm-dp", "llm-d", "dynamo-kv",
            "sglang-cache-aware", "prefix-aware", "kv-aware", "power-of-two", "session-hash")




def config(num_blocks: int = 3000, max_num_seqs: int = 32, budget: int = 1024,
           fast_forward: bool = True, check_invariants: bool = False) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  max_model_len=16384),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        api_server=ApiServerCost(), fast_forward=fast_forward,
        check_invariants=check_invariants)


def traces() -> dict[str, Trace]:
    arrivals = ArrivalProcess(request_rate=40.0, burstiness=0.5, seed=7)
    mooncake = load_trace(FIXTURES / "mooncake_conversation_first300.jsonl").trace
    return {
        "mooncake": Trace(mooncake.requests[:120]),
        "random": random_trace(200, RandomLengths(200, 60, range_ratio=0.9), arrivals),
        "prefix": prefix_repetition_trace(
            150, PrefixRepetition(prefix_len=96, suffix_len=40, num_prefixes=3, output_len=50),
            arrivals),
        "multi_turn": multi_turn_trace(
            40, MultiTurn(num_turns=3, turn_gap_s=0.05, lengths=RandomLengths(64, 24)),
            arrivals),
    }


TRACES = traces()


def single_engine_rows(result: FleetResult) -> tuple[list[dict[str, object]], dict[str, list]]:
    requests = [r.to_row() for r in result.requests]
    for row in requests:
        assert row.pop("replica") == 0
        assert row.pop("routing_s") == 0.0
    steps = {k: v for k, v in result.step_columns.items() if k != "replica"}
    return requests, steps


@pytest.mark.parametrize("name", ["mooncake", "prefix", "multi_turn"])
@pytest.mark.parametrize("policy", ["round-robin", "llm-d"])
def test_one_replica_gives_the_single_engine_records(name: str, policy: str) -> None:
    trace, cfg = TRACES[name], config(num_blocks=400)
    expected = simulate(trace, cfg, COST)
    result = simulate_fleet(trace, [Replica(cfg)], make_policy(policy, seed=5), refresh_s=0.05)
    requests, steps = single_engine_rows(result)
    assert requests == [r.to_row() for r in expected.requests]
    assert steps == expected.step_columns
    assert (result.prefix_cache_queries, result.prefix_cache_hits) == (
        expected.prefix_cache_queries, expected.prefix_cache_hits)


@pytest.mark.parametrize("policy", POLICIES)
def test_one_replica_is_exact_with_every_policy(policy: str) -> None:
    trace, cfg = TRACES["random"], config(num_blocks=200, max_num_seqs=16, budget=512)
    expected = simulate(trace, cfg, COST)
    result = simulate_fleet(trace, [Replica(cfg)], make_policy(policy, seed=1), refresh_s=0.0)
    requests, steps = single_engine_rows(result)
    assert requests == [r.to_row() for r in expected.requests]
    assert steps == expected.step_columns


@pytest.mark.parametrize("policy", ["round-robin", "llm-d"])  # pre-routed, stepping
def test_one_replica_with_a_front_end_output_cost_is_the_single_engine(policy: str) -> None:
    """With a client-side output cost (`per_output_token_s` > 0: run.json says token_times
    "client"), `simulate` shifts token times to their delivery; so does the fleet."""
    trace = TRACES["random"]
    cfg = dataclasses.replace(config(num_blocks=200, max_num_seqs=16, budget=512),
                              api_server=ApiServerCost(per_output_token_s=2e-4))
    expected = simulate(trace, cfg, COST)
    engine_side = simulate(trace, dataclasses.replace(cfg, api_server=ApiServerCost()), COST)
    assert expected.requests[0].first_token_s != engine_side.requests[0].first_token_s
    result = simulate_fleet(trace, [Replica(cfg)], make_policy(policy, seed=1))
    requests, steps = single_engine_rows(result)
    assert requests == [r.to_row() for r in expected.requests]
    assert steps == expected.step_columns


def rows(result: FleetResult) -> tuple[list[dict[str, object]], dict[str, list]]:
    return [r.to_row() for r in result.requests], result.step_columns


@pytest.mark.parametrize("policy", ["random", "power-of-two", "dynamo-kv"])
def test_same_seed_same_records(policy: str) -> None:
    trace = TRACES["prefix"]
    replicas = [Replica(config(num_blocks=150))] * 3
    runs = [simulate_fleet(trace, replicas, make_policy(policy, ["temperature=0.5"]
                                                        if policy == "dynamo-kv" else [], seed=9),
                           refresh_s=0.01, routing_latency_s=0.002) for _ in range(2)]
    assert rows(runs[0]) == rows(runs[1])


def test_fast_forward_gives_the_same_fleet_records() -> None:
    trace = TRACES["random"]
    results = [simulate_fleet(trace, [Replica(config(num_blocks=120, fast_forward=fast))] * 3,
                              make_policy("llm-d", seed=2), refresh_s=0.02)
               for fast in (False, True)]
    assert rows(results[0]) == rows(results[1])


@pytest.mark.parametrize("num_replicas", [2, 3, 4])
def test_round_robin_sends_request_i_to_replica_i_mod_n(num_replicas: int) -> None:
    trace = TRACES["random"]
    result = simulate_fleet(trace, [Replica(config())] * num_replicas,
                            make_policy("round-robin"), refresh_s=0.05)
    assert [r.request_id for r in result.requests] == [r.request_id for r in trace]
    assert [r.replica for r in result.requests] == [i % num_replicas for i in range(len(trace))]
    assert sorted(set(result.step_columns["replica"])) == list(range(num_replicas))
    assert [s.num_requests for s in result.replicas] == [
        len(range(i, len(trace), num_replicas)) for i in range(num_replicas)]


class Watched(RouterPolicy):
    """Wraps a policy and checks the hooks: each request routed once to a replica that can
    hold it, finished once after it was routed; at each decision the in-flight count per
    replica is as the records say."""

    name = "watched"

    def __init__(self, inner: RouterPolicy) -> None:
        super().__init__(0)
        self.inner = inner
        self.routed: dict[str, tuple[int, float]] = {}
        self.finished: list[str] = []
        self.in_flight_seen: list[tuple[float, int, dict[int, int]]] = []

    def choose(self, request: RoutingRequest,
               replicas: Sequence[ReplicaSnapshot]) -> RoutingDecision:
        self.in_flight_seen.append((request.now_s, len(self.routed), dict(self.local.count)))
        for snap in replicas:
            assert snap.taken_at_s <= request.now_s
        decision = self.inner.choose(request, replicas)
        assert decision.replica in {s.replica_id for s in replicas}
        return decision

    def on_routed(self, request: RoutingRequest, replica: int) -> None:
        assert request.request_id not in self.routed
        self.routed[request.request_id] = (replica, request.now_s)
        super().on_routed(request, replica)
        self.inner.on_routed(request, replica)

    def on_prefill_done(self, request_id: str) -> None:
        assert request_id in self.routed
        self.inner.on_prefill_done(request_id)

    def on_finished(self, request_id: str) -> None:
        assert request_id in self.routed and request_id not in self.finished
        self.finished.append(request_id)
        super().on_finished(request_id)
        self.inner.on_finished(request_id)


def check_fleet_run(trace: Trace, result: FleetResult, watched: Watched,
                    latency_s: float) -> None:
    records = result.requests
    assert [r.request_id for r in records] == [r.request_id for r in trace]
    assert sorted(watched.finished) == sorted(watched.routed) == sorted(r.request_id
                                                                       for r in trace)
    for record in records:
        assert record.status.startswith("FINISHED"), record
        assert watched.routed[record.request_id][0] == record.replica
        assert record.routing_s == pytest.approx(latency_s, abs=1e-12)
        parts = math.fsum([record.routing_s, *(getattr(record, c) for c in PART_COLUMNS)])
        assert parts == pytest.approx(record.finish_s - record.arrival_s, abs=1e-9)
        assert all(getattr(record, c) >= -1e-9 for c in PART_COLUMNS), record
    # on_finished at the finish time: the in-flight count a decision sees is the requests
    # routed before it that finish after it (ties either way)
    order = list(watched.routed)
    by_id = {r.request_id: r for r in records}
    for now, num_routed, counts in watched.in_flight_seen:
        before = [by_id[request_id] for request_id in order[:num_routed]]
        for replica in {r.replica for r in records}:
            mine = [r.finish_s for r in before if r.replica == replica]
            low = sum(1 for finish in mine if finish > now)
            high = sum(1 for finish in mine if finish >= now)
            assert low <= counts.get(replica, 0) <= high


@pytest.mark.parametrize("seed", range(6))
def test_every_request_routed_once_and_finished(seed: int) -> None:
    name = list(TRACES)[seed % len(TRACES)]
    trace = TRACES[name]
    policy = POLICIES[(seed * 5) % len(POLICIES)]
    num_replicas = 2 + seed % 3
    latency = (0.0, 0.003)[seed % 2]
    # one small replica that cannot hold the longest prompts
    replicas = [Replica(config(num_blocks=80 if i == 0 else 1500, max_num_seqs=8 + 4 * i,
                               check_invariants=name != "mooncake"))  # slow on long prompts
                for i in range(num_replicas)]
    watched = Watched(make_policy(policy, seed=seed))
    result = simulate_fleet(trace, replicas, watched, refresh_s=(0.0, 0.01, 0.1)[seed % 3],
                            routing_latency_s=latency)
    check_fleet_run(trace, result, watched, latency)
    for record in result.requests:  # to a replica that can hold it, if any can
        fits = [can_ever_fit(r.config, record.prompt_len) for r in replicas]
        assert fits[record.replica] or not any(fits), record


def test_routing_latency_delays_the_hand_over() -> None:
    trace = TRACES["random"]
    cfg = config()
    base = simulate_fleet(trace, [Replica(cfg)], make_policy("round-robin"))
    late = simulate_fleet(trace, [Replica(cfg)], make_policy("round-robin"),
                          routing_latency_s=0.25)
    first_base, first_late = base.requests[0], late.requests[0]
    assert first_late.routing_s == pytest.approx(0.25)
    assert first_late.queued_s == pytest.approx(first_base.queued_s + 0.25)


def test_a_fleet_needs_a_replica() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        simulate_fleet(TRACES["random"], [], make_policy("round-robin"))


NOISE = StepNoise((0.8, 0.95, 1.0, 1.1, 1.6), seed=4, drift_quantiles=(0.9, 1.0, 1.2),
                  drift_window_s=0.5)


def test_one_replica_with_step_noise_is_the_single_engine() -> None:
    trace = TRACES["prefix"]
    cfg = dataclasses.replace(config(num_blocks=200), step_noise=NOISE)
    expected = simulate(trace, cfg, COST)
    result = simulate_fleet(trace, [Replica(cfg)], make_policy("round-robin"))
    requests, steps = single_engine_rows(result)
    assert requests == [r.to_row() for r in expected.requests]
    assert steps == expected.step_columns


def test_replicas_draw_their_own_step_noise() -> None:
    # Requests 0 and 1 alike at t = 0 go one to each replica: without noise of their own,
    # both first steps would take the same time.
    trace = Trace(tuple(TraceRequest(str(i), 0.0, 64, 4) for i in range(2)))
    cfg = dataclasses.replace(config(), step_noise=NOISE)
    result = simulate_fleet(trace, [Replica(cfg)] * 2, make_policy("round-robin"))
    columns = result.step_columns
    first = {columns["replica"][k]: columns["duration_s"][k]
             for k in range(result.num_steps) if columns["step"][k] == 0}
    assert first[0] != first[1]


def test_candidates_on_a_fixed_and_a_changing_serving_set() -> None:
    # replica 2 holds at most 999 prompt tokens (max_model_len 1000); the others 16383
    small = dataclasses.replace(config(), scheduler=SchedulerConfig(
        max_num_batched_tokens=1024, max_num_seqs=32, max_model_len=1000))
    setups = [Replica(config()), Replica(config()), Replica(small)]
    fits_all, too_long = TraceRequest("a", 0.0, 999, 4), TraceRequest("b", 0.0, 1000, 4)
    fixed = fleet_module._Fleet(TRACES["random"], setups, make_policy("least-outstanding"),
                                0.05, 0.0, None)
    snapshots = fixed.snapshots(0.0)
    assert [s.replica_id for s in fixed.candidates(too_long, snapshots)] == [0, 1]
    fixed.serving[1] = False  # never done to a fixed fleet: shows `serving` is not scanned
    assert fixed.candidates(fits_all, snapshots) is snapshots

    class Changing(fleet_module._Fleet):
        serving_fixed = False

    changing = Changing(TRACES["random"], setups, make_policy("least-outstanding"),
                        0.05, 0.0, None)
    assert changing.candidates(fits_all, snapshots) is snapshots  # every replica serves
    changing.serving[1] = False
    assert [s.replica_id for s in changing.candidates(fits_all, snapshots)] == [0, 2]
    assert [s.replica_id for s in changing.candidates(too_long, snapshots)] == [0]
    assert _AutoscaledFleet.serving_fixed is False  # its replicas start, drain and stop
