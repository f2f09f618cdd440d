"""Lockstep against one process on many small random fleets (`simulate_fleet(workers=N)`,
`sim.fleet_lockstep`): 2 and 3 processes give the records of 1 exactly, behind
least-outstanding, power-of-two and sglang-cache-aware, with what could break the argument
of docs/fleet.md ("Lockstep"): finishes exactly at arrival times (step times on a 2^-16 s
grid, arrivals on a 2^-10 s grid), several requests at one arrival, prompts only some
replicas or none can hold, max_tokens 1, priority scheduling, routing latency 0 and > 0,
serving-stack delays, 1-3 router replicas, step noise, an output cost, multi-turn sessions
and hash-id prompts (Mooncake)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pytest

import workloads
from runtime import CacheConfig, SchedulerConfig
from runtime.batch import BatchFeatures
from runtime.router import make_policy
from sim import fleet as fleet_module
from sim.cost.api_server import ApiServerCost
from sim.fleet import FleetResult, simulate_fleet
from sim.simulator import SimConfig
from sim.step_noise import StepNoise
from tests.sim.fleet_support import COST, FIXTURES, Replica
from tests.sim.test_fleet_workers import equal
from workloads import ArrivalProcess, MultiTurn, RandomLengths, Trace, TraceRequest, load_trace

POLICIES = ("least-outstanding", "power-of-two", "sglang-cache-aware")


class GridCost:
    """Step time (256 + prefill tokens + 16 x decode tokens) / 2^16 s: every step end is a
    sum of exact binary fractions, so finishes land exactly on arrival times."""

    def step_time(self, features: BatchFeatures) -> float:
        return (256 + features.num_prefill_tokens + 16 * features.num_decode_tokens) / 65536

    def describe(self) -> dict[str, Any]:
        return {"kind": "grid"}


@dataclass(frozen=True)
class Case:
    """One random fleet run (`simulate_fleet`'s arguments but the workers)."""

    trace: Trace
    setups: list[Replica]
    policy: str
    routers: int
    latency_s: float
    stack_delay_s: dict[str, float] | None
    refresh_s: float

    def run(self, workers: int) -> FleetResult:
        policies = [make_policy(self.policy, (), seed=5 + r) for r in range(self.routers)]
        return simulate_fleet(self.trace, self.setups, policies, refresh_s=self.refresh_s,
                              routing_latency_s=self.latency_s,
                              stack_delay_s=self.stack_delay_s, workers=workers)


def grid_trace(rng: np.random.Generator) -> Trace:
    """5-49 requests, arrivals on a 2^-10 s grid (gaps of 0 ticks often: shared arrivals);
    prompts of 1-5,000 tokens (some fit only the large pools, some no pool), outputs of
    1-59 tokens (1 often), priorities 0-2, sessions sometimes."""
    n = int(rng.integers(5, 50))
    arrivals = np.cumsum(rng.choice([0, 0, 1, 2, 4, 16, 64], size=n)) / 1024
    sessions = rng.random() < 0.3
    requests = []
    for i in range(n):
        prompt = (int(rng.choice([1, 16, 17, 100, 300, 600, 1500, 5000])) if rng.random() < 0.3
                  else int(rng.integers(1, 700)))
        output = 1 if rng.random() < 0.3 else int(rng.integers(1, 60))
        requests.append(TraceRequest(
            request_id=f"r{i}", arrival_s=float(arrivals[i]), prompt_len=prompt,
            output_len=output, priority=int(rng.integers(0, 3)),
            session_id=f"s{i % 3}" if sessions else None))
    return Trace(tuple(requests))


def multi_turn(rng: np.random.Generator, seed: int) -> Trace:
    """Conversations whose prompts quote the earlier turns (segments)."""
    arrivals = ArrivalProcess(request_rate=float(rng.choice([20, 80, 300])),
                              burstiness=float(rng.choice([0.3, 1.0])), seed=seed)
    turns = MultiTurn(num_turns=int(rng.integers(2, 5)),
                      turn_gap_s=float(rng.choice([0.0, 0.01, 0.05])),
                      lengths=RandomLengths(int(rng.choice([40, 96, 200])),
                                            int(rng.choice([1, 10, 40])), 0.9))
    return workloads.multi_turn_trace(int(rng.integers(5, 20)), turns, arrivals)


def replica(rng: np.random.Generator, grid: bool, noise: StepNoise | None,
            scheduling: Literal["fcfs", "priority"]) -> Replica:
    """A pool of 3-300 blocks of 16 tokens (3 hold no 48-token prompt), a small or default
    token budget and batch, the default API server or a free one (with an output cost at
    times)."""
    api = ApiServerCost() if rng.random() < 0.5 else ApiServerCost(
        per_request_s=0.0, per_prompt_token_s=0.0,
        per_output_token_s=float(rng.choice([0.0, 2e-5])))
    config = SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=int(rng.choice([64, 512])),
                                  max_num_seqs=int(rng.choice([2, 16])), max_model_len=16384,
                                  policy=scheduling),
        cache=CacheConfig(block_size=16, num_blocks=int(rng.choice([3, 8, 20, 40, 300]))),
        api_server=api, step_noise=noise, fast_forward=bool(rng.random() < 0.8))
    return Replica(config, GridCost() if grid else COST)


def random_case(seed: int) -> Case:
    rng = np.random.default_rng(seed)
    trace = multi_turn(rng, seed) if seed % 5 == 4 else grid_trace(rng)
    grid = rng.random() < 0.6
    noise = StepNoise((0.7, 1.0, 1.6), seed=seed) if rng.random() < 0.25 else None
    scheduling: Literal["fcfs", "priority"] = "priority" if rng.random() < 0.4 else "fcfs"
    setups = [replica(rng, grid, noise, scheduling) for _ in range(int(rng.integers(2, 6)))]
    stack = ({r.request_id: float(rng.choice([0.0, 1 / 1024, 0.003, rng.exponential(0.01)]))
              for r in trace} if rng.random() < 0.3 else None)
    return Case(trace, setups, POLICIES[seed % 3], routers=int(rng.integers(1, 4)),
                latency_s=float(rng.choice([0.0, 0.0, 1 / 1024, 0.001])),
                stack_delay_s=stack, refresh_s=float(rng.choice([0.0, 0.02])))


def counting_lockstep(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The process counts of the lockstep runs from now on (`run_lockstep` wrapped)."""
    ran: list[int] = []
    lockstep = fleet_module.run_lockstep

    def counted(tasks: Any, *args: Any) -> Any:
        ran.append(len(tasks))
        return lockstep(tasks, *args)
    monkeypatch.setattr(fleet_module, "run_lockstep", counted)
    return ran


@pytest.mark.parametrize("seed", range(90))
def test_random_fleets_give_the_records_of_one_process(seed: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    case = random_case(seed)
    one = case.run(workers=1)
    ran = counting_lockstep(monkeypatch)
    for workers in (2, 3):
        equal(case.run(workers), one)
    assert ran == [2, min(3, len(case.setups))]


@pytest.mark.parametrize(("crowded", "expected"), [(False, 0), (True, 1)])
def test_a_finish_exactly_at_an_arrival_is_heard_as_in_one_process(
        crowded: bool, expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """r1 (one token, on replica 1: the child's) finishes at 2^-7 s, when r2 arrives. Its
    step end was scheduled at 0, the router's wait for r2 after the last routing before it:
    at 0 too (routed first: least-outstanding sees 1 and 1 in flight and takes replica 0),
    or at 2^-8 s when m and m2 arrive (the finish is heard first: 2 and 1, replica 1)."""
    free_api = ApiServerCost(per_request_s=0.0, per_prompt_token_s=0.0)
    config = SimConfig(scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                                                 max_model_len=4096),
                       cache=CacheConfig(block_size=16, num_blocks=300), api_server=free_api)
    setups = [Replica(config, GridCost())] * 2
    requests = [TraceRequest("r0", 0.0, 256, 50), TraceRequest("r1", 0.0, 256, 1)]
    if crowded:
        requests += [TraceRequest("m", 1 / 256, 16, 50), TraceRequest("m2", 1 / 256, 16, 50)]
    trace = Trace((*requests, TraceRequest("r2", 1 / 128, 16, 5)))
    one = simulate_fleet(trace, setups, make_policy("least-outstanding"))
    ran = counting_lockstep(monkeypatch)
    two = simulate_fleet(trace, setups, make_policy("least-outstanding"), workers=2)
    assert ran == [2]
    rows = {r.request_id: r for r in two.requests}
    assert (rows["r1"].replica, rows["r1"].finish_s, rows["r2"].arrival_s) == (1, 1 / 128,
                                                                               1 / 128)
    assert rows["r2"].replica == expected
    equal(two, one)


def test_hash_id_prompts_give_the_records_of_one_process() -> None:
    """Mooncake conversations (512-token hash blocks, prefix hits), 20x faster, on pools of
    2,000 and 700 blocks; sglang-cache-aware reads the token ids."""
    full = load_trace(FIXTURES / "mooncake_conversation_first300.jsonl").trace
    start = full[150].arrival_s
    trace = Trace(tuple(dataclasses.replace(r, arrival_s=(r.arrival_s - start) / 20)
                        for r in full.requests[150:210]))
    config = SimConfig(scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16,
                                                 max_model_len=65536),
                       cache=CacheConfig(block_size=16, num_blocks=2000))
    small = dataclasses.replace(config, cache=CacheConfig(block_size=16, num_blocks=700))
    setups = [Replica(config), Replica(small), Replica(config)]
    for policy in POLICIES:
        case = Case(trace, setups, policy, routers=2, latency_s=0.001, stack_delay_s=None,
                    refresh_s=0.02)
        one = case.run(workers=1)
        assert sum(r.cached_tokens for r in one.requests) > 0
        equal(case.run(workers=3), one)
