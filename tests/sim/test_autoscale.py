"""Autoscaling in the loop: each policy's decisions by hand on a synthetic load, a scripted
policy's timeline (no request reaches a starting replica, a draining one loses none),
cancelling a start, and GPU-hours by hand."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest

from runtime.batch import BatchFeatures
from runtime.router import ReplicaSnapshot, make_policy
from sim.autoscale import ScalingPool, fixed_timeline, model_load_s, simulate_autoscaled
from sim.model_presets import resolve_model
from sim.scaling_policies import (
    DynamoPlanner,
    EngineBench,
    KvThreshold,
    PoolObservation,
    WindowStats,
    make_scaling_policy,
)
from tests.sim.test_fleet import Replica, config
from workloads import Trace, TraceRequest


def observe(now: float, kv: float, current: int, waiting: int = 0,
            window: WindowStats | None = None, interval: float = 10.0) -> PoolObservation:
    snaps = [ReplicaSnapshot(replica_id=i, taken_at_s=now, num_waiting=waiting, kv_usage=kv,
                             num_gpu_blocks=100) for i in range(current)]
    return PoolObservation(now, interval, current, snaps, window or WindowStats())


def test_kv_threshold_sequence_by_hand() -> None:
    policy = KvThreshold()  # up > 0.8 or waiting >= 5, down < 0.3 for 300 s
    load = [(0, 0.5, 0), (10, 0.81, 0), (20, 0.9, 0), (30, 0.6, 5), (40, 0.5, 4),
            (50, 0.29, 0), (340, 0.2, 0), (350, 0.1, 0), (360, 0.35, 0), (370, 0.1, 0),
            (660, 0.1, 0), (670, 0.1, 0), (970, 0.1, 0)]
    wanted, current = [], 2
    for now, kv, waiting in load:
        current = max(1, policy.desired(observe(now, kv, current, waiting)))
        wanted.append(current)
    # up at 10, 20 (KV), 30 (queue); low from 50: down at 350 (300 s later); the window
    # restarts at 360 (not low), again at 370: down at 670; after a step down the next
    # window starts at the next low tick (970, BLIS's "fresh window")
    assert wanted == [2, 3, 4, 5, 5, 5, 5, 4, 4, 4, 4, 3, 3]
    # starting replicas count as empty: one serving at 0.9 KV and one starting is 0.45
    assert KvThreshold().desired(observe(0, 0.9, 1)) == 2
    assert KvThreshold().desired(dataclasses.replace(observe(0, 0.9, 1), starting=1)) == 1


class LinearCost:
    """step = 10 ms + 0.1 ms per prefill token + 0.4 ms per decode sequence."""

    def step_time(self, f: BatchFeatures) -> float:
        return 0.010 + 1e-4 * f.num_prefill_tokens + 4e-4 * f.num_decode_tokens

    def describe(self) -> dict[str, Any]:
        return {"kind": "linear"}


BENCH = EngineBench(LinearCost(), max_num_batched_tokens=2048, max_num_seqs=64,
                    kv_tokens=10**6, gpus=1)


def test_engine_bench_by_hand() -> None:
    assert BENCH.prefill_s(1000) == pytest.approx(0.110)
    assert BENCH.prefill_s(3000) == pytest.approx(0.010 + 0.2048 + 0.010 + 0.0952)
    # ITL 50 ms allows 100 sequences, max_num_seqs caps at 64: 64 / 35.6 ms
    assert BENCH.best_decode_tokens_per_gpu_s(0.050, 1100) == pytest.approx(64 / 0.0356)
    assert BENCH.best_decode_tokens_per_gpu_s(0.025, 1100) == pytest.approx(37 / 0.0248)
    small_kv = EngineBench(LinearCost(), 2048, 64, kv_tokens=10 * 1101, gpus=2)
    assert small_kv.best_decode_tokens_per_gpu_s(0.050, 1100) == pytest.approx(
        10 / 0.014 / 2)


def test_dynamo_planner_by_hand() -> None:
    # 1800 requests in 60 s (30/s) of ISL 1000, OSL 200. Prefill: 1000 / 0.11 s = 9090.9
    # tokens/s/GPU -> 30 * 1000 / 9090.9 = 3.3 GPUs; decode at ITL 50 ms: 1797.75 tokens/s
    # -> 30 * 200 / 1797.75 = 3.34 GPUs
    window = WindowStats(num_requests=1800, num_finished=1700, mean_prompt_len=1000,
                         mean_output_len=200, mean_ttft_s=0.055, mean_itl_s=0.068,
                         mean_duration_s=8.0)
    obs = observe(60.0, 0.5, 4, window=window, interval=60.0)
    plain = {role: DynamoPlanner(BENCH, role=role, correction=False).desired(obs)
             for role in ("prefill", "decode", "both")}
    assert plain == {"prefill": 4, "decode": 4, "both": 7}  # ceil(3.3 + 3.34) = 7
    # corrections: TTFT 55 / 110 ms = 0.5 -> prefill 1.65 GPUs; concurrency 1800 / 4 * 8 /
    # 60 = 60 -> expected ITL 34 ms, observed 68: ITL target 25 ms -> 37 sequences, 1491.9
    # tokens/s -> 4.02 GPUs
    planner = DynamoPlanner(BENCH)
    assert planner.desired(obs) == 6  # ceil(1.65 + 4.02)
    assert (planner.p_correction, planner.d_correction) == pytest.approx((0.5, 2.0))
    assert DynamoPlanner(BENCH, role="decode").desired(obs) == 5
    idle = observe(120.0, 0.0, 3, window=WindowStats(num_requests=0), interval=60.0)
    assert planner.desired(idle) == 3  # nothing finished: the interval is skipped


def test_policy_arguments() -> None:
    policy = make_scaling_policy("kv-threshold", ["scale-up-kv=0.7", "down_window_s=60"],
                                 BENCH)
    assert isinstance(policy, KvThreshold) and policy.scale_up_kv == 0.7
    planner = make_scaling_policy("dynamo-planner", ["itl_ms=20", "correction=false"], BENCH)
    assert isinstance(planner, DynamoPlanner) and not planner.correction
    for bad in (["bench=1"], ["ttft_ms"], ["ttft_ms=fast"], ["correction=maybe"]):
        with pytest.raises(ValueError, match="--autoscale-arg"):
            make_scaling_policy("dynamo-planner", bad, BENCH)
    with pytest.raises(ValueError, match="unknown policy"):
        make_scaling_policy("hpa", [], BENCH)


def test_model_load_time() -> None:
    model = resolve_model("llama-3.1-8b")
    assert model_load_s(model, 1, 2.0, 20.0) == pytest.approx(model.weight_bytes / 2e9 + 20)
    assert model_load_s(model, 2, 2.0, 0.0) == pytest.approx(model.weight_bytes / 4e9)


@dataclass
class Scripted:
    """`wanted(now)` replicas at each tick."""

    plan: dict[float, int]

    def desired(self, obs: PoolObservation) -> int:
        return self.plan.get(obs.now_s, obs.current)


def run_scripted(plan: dict[float, int], startup_s: float, gpus: int = 2) -> Any:
    trace = Trace([TraceRequest(str(i), 0.25 + 0.5 * i, 64, 200) for i in range(120)])
    pool = ScalingPool("p", range(2), Scripted(plan), startup_s, gpus, cost_per_hour=3.0)
    return simulate_autoscaled(trace, [Replica(config()), Replica(config())],
                               make_policy("round-robin"), [pool], interval_s=10.0)


def test_start_up_delay_drain_and_gpu_hours_by_hand() -> None:
    result, scaling = run_scripted({10.0: 2, 30.0: 1}, startup_s=5.0)
    on_one = [r for r in result.requests if r.replica == 1]
    # start-up: nothing reaches replica 1 before 15 s; drain: nothing new after 30 s
    assert on_one and all(15.0 <= r.arrival_s < 30.0 for r in on_one)
    assert len(result.requests) == 120  # none lost
    assert all(r.status.startswith("FINISHED") for r in result.requests)
    last_one = max(r.finish_s for r in on_one)  # replica 1 stops when its last step ends
    assert last_one > 30.0  # it drained: what it held at 30 s finished there
    line = scaling.pools[0]
    assert list(zip(line.times_s, line.serving, line.provisioned, strict=True)) == [
        (0.0, 1, 1), (10.0, 1, 2), (15.0, 2, 2), (30.0, 1, 2), (last_one, 1, 1)]
    end = max(r.finish_s for r in result.requests)
    assert scaling.end_s == end
    # replica 0 from 0 to the end, replica 1 from its start at 10 s to its stop; 2 GPUs each
    assert scaling.gpu_hours == pytest.approx(2 * (end + last_one - 10.0) / 3600, abs=1e-12)
    assert scaling.cost == pytest.approx(3.0 * (end + last_one - 10.0) / 3600, abs=1e-12)


def test_a_start_cancelled_before_it_serves_takes_nothing() -> None:
    result, scaling = run_scripted({10.0: 2, 20.0: 1}, startup_s=15.0)
    assert {r.replica for r in result.requests} == {0}
    line = scaling.pools[0]
    assert list(zip(line.times_s, line.serving, line.provisioned, strict=True)) == [
        (0.0, 1, 1), (10.0, 1, 2), (20.0, 1, 1)]
    end = max(r.finish_s for r in result.requests)
    assert scaling.gpu_hours == pytest.approx(2 * (end + 10.0) / 3600, abs=1e-12)


def test_dynamo_planner_in_the_loop_by_hand() -> None:
    # 5 req/s for 60 s, 30 req/s for 60 s, 5 req/s for 120 s; ISL 1000, OSL 200. Without
    # corrections a 30 s window at r req/s wants ceil(0.22125 r) replicas (see the hand
    # computation above): 2 at 5 req/s, 7 at 30 req/s
    rates = [(0.0, 60.0, 5.0), (60.0, 120.0, 30.0), (120.0, 240.0, 5.0)]
    reqs = [TraceRequest(f"{a}-{i}", a + (i + 0.5) / r, 1000, 200)
            for a, b, r in rates for i in range(round((b - a) * r))]
    setups = [Replica(config(num_blocks=20000, max_num_seqs=64, budget=2048),
                      LinearCost()) for _ in range(8)]
    planner = DynamoPlanner(EngineBench.of(setups[0].config, LinearCost(), 1),
                            correction=False)
    pool = ScalingPool("p", range(8), planner, startup_s=5.0)
    result, scaling = simulate_autoscaled(Trace(reqs), setups, make_policy("round-robin"),
                                          [pool], interval_s=30.0)
    assert all(r.status.startswith("FINISHED") for r in result.requests)
    line = scaling.pools[0]
    serving = list(zip(line.times_s, line.serving, strict=True))
    # ticks at 30 (2), 60 (2), 90 (7), 120 (7), 150 (2), ...; 5 s start-up
    assert [(t, n) for t, n in serving if n != serving[max(0, serving.index((t, n)) - 1)][1]
            or t == 0.0] == [(0.0, 1), (35.0, 2), (95.0, 7), (150.0, 2)]
    assert max(line.provisioned) == 7 and line.provisioned[-1] == 2


def test_fixed_timeline_gpu_hours() -> None:
    line = fixed_timeline(["a", "b"], [2, 1], [4, 1], [10.0, 0.0], end_s=1800.0)
    assert line.gpu_hours == pytest.approx(2 * 4 * 0.5 + 1 * 0.5)
    assert line.cost == pytest.approx(2 * 10.0 * 0.5)
    assert line.to_json()["pools"][0]["serving"] == [2]


def test_pools_must_cover_the_replicas() -> None:
    trace = Trace([TraceRequest("0", 0.0, 64, 8)])
    pool = ScalingPool("p", range(1), KvThreshold(), 0.0)
    with pytest.raises(ValueError, match="cover every replica"):
        simulate_autoscaled(trace, [Replica(config())] * 2, make_policy("round-robin"), [pool])
    with pytest.raises(ValueError, match="min replicas"):
        ScalingPool("p", range(2), KvThreshold(), 0.0, min_replicas=3)


def test_an_autoscaled_fleet_never_sleeps_through_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The autoscaler's serving set is read at each arrival (`routes_ahead` off): its
    replicas never sleep through runs, whatever the router (docs/fleet.md)."""
    from sim.fleet_replica import Replica as FleetReplica

    def never(self: FleetReplica, clock: float) -> object:
        raise AssertionError("an autoscaled replica slept through a run")

    monkeypatch.setattr(FleetReplica, "sleep_through_run", never)
    trace = Trace([TraceRequest(str(i), 0.25 + 0.5 * i, 64, 200) for i in range(40)])
    pool = ScalingPool("p", range(2), Scripted({}), 1.0, 2, cost_per_hour=3.0)
    result, _ = simulate_autoscaled(trace, [Replica(config()), Replica(config())],
                                    make_policy("least-outstanding"), [pool])
    assert len(result.requests) == 40


@pytest.mark.parametrize(("interval", "message"), [
    (1e-300, "got 1e-300"),  # once a hang: decisions forever at one instant
    (1e308, "got 1e+308"),  # once 'Maximum allowed size exceeded' after the start-up lines
])
def test_the_interval_is_refused_outside_a_tenth_of_a_second_to_194_days(
        interval: float, message: str) -> None:
    from sim.autoscale_flags import AutoscaleFlags

    with pytest.raises(ValueError) as info:
        AutoscaleFlags(autoscale="kv-threshold", autoscale_interval_s=interval)
    assert str(info.value) == ("--autoscale-interval-s must be in [0.1, 16,777,216] s, "
                               + message)
    assert AutoscaleFlags(autoscale="kv-threshold", autoscale_interval_s=0.1).interval_s == 0.1
