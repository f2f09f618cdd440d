"""Sleeping through runs: behind routers that read completions but neither snapshots nor KV
events (least-outstanding, power-of-two on its in-flight counts, sglang-cache-aware), a
replica with no routed request waiting sleeps through a plain decode run that nothing not
yet routed could cut, instead of cutting it at every arrival: the same records, fewer runs
(docs/fleet.md)."""

from __future__ import annotations

import random

import pytest

from runtime import BatchFeatures, CacheConfig, EngineCore, SchedulerConfig
from runtime.engine import RunPlan
from runtime.router import make_policy
from sim import fleet as fleet_module
from sim.cost.api_server import ApiServerCost
from sim.fleet import FleetResult, simulate_fleet
from sim.simulator import SimConfig
from sim.step_noise import StepNoise
from tests.sim.fleet_support import Replica
from tests.sim.test_fleet_ahead import TRACES
from workloads import Trace, TraceRequest

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
    run_plan = EngineCore.run_plan

    def counting(self: EngineCore, plan: RunPlan) -> float:
        runs.append(run_plan(self, plan))
        return runs[-1]

    monkeypatch.setattr(EngineCore, "run_plan", counting)
    counts = []
    for sleeps in (False, True):
        runs.clear()
        result = run("random", "least-outstanding", [], 4, sleeps)
        assert len(result.requests) == len(TRACES["random"])
        counts.append(len(runs))
    cut, slept = counts
    assert slept < cut



def test_a_sleeping_replica_plans_once_per_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica that found no run to sleep through (its next step is not a plain decode)
    does not plan it again at the same clock and step before that step (a plan of no run
    from `clock` to `clock + 1 s` is none to any horizon)."""
    no_run: list[tuple[int, float, int]] = []  # (replica, clock, steps) where none was found
    again: list[tuple[int, float, int]] = []
    plan_run = fleet_module.Replica.plan_run

    def counting(self: fleet_module.Replica, clock: float, horizon: float) -> RunPlan | None:
        key = (id(self), clock, self.core.recorder.num_steps)
        if key in no_run:
            again.append(key)
        plan = plan_run(self, clock, horizon)
        if plan is None:
            no_run.append(key)
        return plan

    monkeypatch.setattr(fleet_module.Replica, "plan_run", counting)
    result = run("random", "least-outstanding", [], 4, True)
    assert len(result.requests) == len(TRACES["random"])
    assert no_run and again == []



def test_a_plan_cut_past_its_last_start_is_the_plan_itself() -> None:
    """`RunPlan.cut`: the steps starting before the horizon; no copy when that is all of
    them (a sleeping replica's plan, run as planned)."""
    plan = RunPlan(clock=1.0, horizon=3.0, num_steps=7, ends=[1.25, 1.5, 2.0],
                   durations=[0.25, 0.25, 0.5], limit=3, kv_tokens=10, finishes_last=True,
                   reason=None, tokens=None)
    assert plan.cut(1.5 + 1e-9) is plan and plan.cut(2.5) is plan
    cut = plan.cut(1.5)  # the third step starts at 1.5: not before the horizon
    assert (cut.ends, cut.durations, cut.horizon) == ([1.25, 1.5], [0.25, 0.25], 1.5)
    assert plan.cut(1.0 + 1e-9).ends == [1.25]


class _Dyadic:
    """A cost model of dyadic step times (1/64 s a decode step, 1/32 s a step with a
    prefill), so that step ends meet dyadic arrivals exactly."""

    def step_time(self, features: BatchFeatures) -> float:
        return 1 / 64 if features.num_prefill_tokens == 0 else 1 / 32

    def describe(self) -> dict[str, object]:
        return {"kind": "dyadic"}


def _dyadic_trace(seed: int, n: int = 120) -> Trace:
    rng = random.Random(seed)
    arrival, requests = 0.0, []
    for i in range(n):
        arrival += rng.choice([0, 1, 1, 2, 3, 5, 8]) / 64
        requests.append(TraceRequest(request_id=f"r{i}", arrival_s=arrival,
                                     prompt_len=rng.randint(8, 200),
                                     output_len=rng.randint(2, 40)))
    return Trace(requests)


# r1 finishes on replica 1 at 0.140625 s, when r6 arrives (review 20's case): cutting and
# stepping one by one route r6 to replica 1
_TIE = Trace([TraceRequest(request_id=f"r{i}", arrival_s=a, prompt_len=p, output_len=o)
              for i, (a, p, o) in enumerate([
                  (0.015625, 126, 26), (0.03125, 84, 5), (0.0625, 68, 20), (0.078125, 200, 30),
                  (0.109375, 67, 7), (0.125, 85, 16), (0.140625, 144, 5), (0.140625, 176, 28)])])


def _dyadic_run(trace: Trace, policy: str, sleeps: bool, replicas: int, routers: int,
                fast_forward: bool = True) -> FleetResult:
    """The fleet on `_Dyadic` replicas (the first with a small pool), no routing latency
    and no API-server time: hand-overs at the arrivals."""
    def config(num_blocks: int) -> SimConfig:
        return SimConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8,
                                      max_model_len=4096),
            cache=CacheConfig(block_size=16, num_blocks=num_blocks),
            api_server=ApiServerCost(0.0, 0.0), fast_forward=fast_forward)

    setups = [Replica(config(40 if i == 0 and replicas > 2 else 200), _Dyadic())  # type: ignore[arg-type]
              for i in range(replicas)]
    saved = fleet_module._Fleet.sleeps_through_runs_allowed
    fleet_module._Fleet.sleeps_through_runs_allowed = sleeps
    try:
        return simulate_fleet(trace, setups, [make_policy(policy, [], seed=5 + r)
                                              for r in range(routers)], refresh_s=0.02)
    finally:
        fleet_module._Fleet.sleeps_through_runs_allowed = saved


def _rows(result: FleetResult) -> list[dict[str, object]]:
    return [r.to_row() for r in result.requests]


def test_a_run_ending_at_an_arrival_is_cut_as_at_each_arrival() -> None:
    """Ties: a run whose last step ends exactly at an arrival is not slept through (the
    event loop orders the finish and the routing, as when cutting); sleeping through it
    reported the finish after the routing (review 20)."""
    cut, stepped, slept = (_dyadic_run(_TIE, "least-outstanding", sleeps, 2, 1, fast)
                           for sleeps, fast in ((False, True), (False, False), (True, True)))
    assert _rows(cut) == _rows(stepped)
    assert [r.replica for r in slept.requests] == [r.replica for r in cut.requests]
    assert _rows(slept) == _rows(cut) and slept.step_columns == cut.step_columns


@pytest.mark.parametrize("policy", [policy for policy, _ in SLEEPING])
@pytest.mark.parametrize(("seed", "routers"), [(0, 1), (1, 2), (2, 1), (3, 2)])
def test_dyadic_ties_with_arrivals_keep_the_records(policy: str, seed: int,
                                                    routers: int) -> None:
    trace = _dyadic_trace(seed)
    cut, slept = (_dyadic_run(trace, policy, sleeps, 4, routers) for sleeps in (False, True))
    assert _rows(slept) == _rows(cut)
    assert slept.step_columns == cut.step_columns
