"""What a simulated step costs the event loop and the block pool: the API server is no
SimPy process (its hand-overs enter at step boundaries, at the times a sleeping server
process would have woken), and a fast-forwarded run's blocks are taken and filled in one
pool call each. Records stay those of stepping one by one."""

from __future__ import annotations

import random
from collections.abc import Generator

import pytest
import simpy

import runtime.block_pool
import runtime.steady
from runtime import CacheConfig, SchedulerConfig
from runtime.block_pool import BlockPool
from runtime.native import is_compiled
from runtime.steady import SteadyDecodes
from sim.api_server import server_wakes
from sim.cost.roofline import RooflineCostModel
from sim.hardware import resolve_gpu
from sim.model_presets import resolve_model
from sim.simulator import SimConfig, _Simulation, simulate
from workloads import ArrivalProcess, RandomLengths, Trace, TraceRequest, random_trace

COST = RooflineCostModel(resolve_model("llama-3.1-8b"), resolve_gpu("h200"))


def config(fast: bool) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                                  max_model_len=4096),
        cache=CacheConfig(block_size=16, num_blocks=4000), fast_forward=fast)


def sparse_trace(seed: int) -> Trace:
    """Azure-like: arrivals sparse enough that the engine is sometimes idle."""
    arrivals = ArrivalProcess(request_rate=15.0, burstiness=1.0, seed=seed)
    return random_trace(60, RandomLengths(200, 60, range_ratio=0.9), arrivals)


def test_wake_times_are_those_of_a_process_sleeping_until_each_hand_over() -> None:
    """`server_wakes` is the event loop's time at each hand-over of a process doing
    `timeout(h - now)`: equal floats, rounding included (a hand-over far from the last
    wake is not always reached exactly), and no sleep when h is not ahead."""
    rng = random.Random(5)
    handovers = [1e-3]  # gaps of 2.5-4x the time so far: h - now is not always exact
    for _ in range(60):
        handovers.append(handovers[-1] * rng.uniform(2.5, 4.0))
    handovers[30:30] = [handovers[29]] * 3  # handed over together: no sleep
    env = simpy.Environment()
    woken: list[float] = []

    def server() -> Generator[simpy.Event, object, None]:
        for handover in handovers:
            if handover > env.now:
                yield env.timeout(handover - env.now)
            woken.append(env.now)

    env.process(server())
    env.run()
    assert server_wakes(handovers) == woken
    assert woken != handovers  # the rounding this reproduces does occur


@pytest.mark.parametrize("seed", [1, 2])
def test_the_event_loop_runs_only_the_idle_engines_sleeps(seed: int) -> None:
    """Events processed: the engine's start and one sleep per idle period (the base had a
    timeout per hand-over and one per step or run), with the records of stepping."""
    trace = sparse_trace(seed)
    sim = _Simulation(trace, config(True), COST, None)
    events = 0
    step = sim.env.step

    def counted() -> None:
        nonlocal events
        events += 1
        step()

    sim.env.step = counted  # type: ignore[method-assign]
    sim.run_to_end(0.0)
    idle = sum(1 for start, end in zip(sim.core.recorder.step_columns["end_s"][:-1],
                                       sim.core.recorder.step_columns["start_s"][1:],
                                       strict=True) if start < end)
    assert events <= idle + 4 < len(trace)
    fast, slow = simulate(trace, config(True), COST), simulate(trace, config(False), COST)
    assert [s.to_row() for s in fast.steps] == [s.to_row() for s in slow.steps]
    assert [r.to_row() for r in fast.requests] == [r.to_row() for r in slow.requests]


@pytest.mark.skipif(is_compiled(runtime.block_pool) or is_compiled(runtime.steady),
                    reason="compiled callers do not see methods patched on compiled classes")
@pytest.mark.parametrize("seed", [1, 3])
def test_own_named_fills_wait_for_the_member_to_leave(monkeypatch: pytest.MonkeyPatch,
                                                      seed: int) -> None:
    """Steady decodes of a plain trace (every block under its request's own name) make no
    registration call in the steps in which they fill blocks (`cache_each`: never; the
    base made one per fast-forwarded run or stepped step): each member registers its fills
    in one call when it leaves or finishes (`SteadyDecodes._materialise`). Records are
    stepping one by one's."""
    calls = {"cache_each": 0, "materialised": 0}
    cache_each, materialise = BlockPool.cache_each, SteadyDecodes._materialise

    def counting(name, method):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return method(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(BlockPool, "cache_each", counting("cache_each", cache_each))
    monkeypatch.setattr(SteadyDecodes, "_materialise", counting("materialised", materialise))
    trace = sparse_trace(seed)
    fast = simulate(trace, config(True), COST)
    assert calls["cache_each"] == 0 and 0 < calls["materialised"] <= len(trace)
    slow = simulate(trace, config(False), COST)
    assert [s.to_row() for s in fast.steps] == [s.to_row() for s in slow.steps]
    assert [r.to_row() for r in fast.requests] == [r.to_row() for r in slow.requests]


class QuarterSecond:
    """Every step takes 0.25 s (exact in binary, so a hand-over can fall on a step's end)."""

    def step_time(self, features: object) -> float:
        return 0.25

    def describe(self) -> dict[str, str]:
        return {"kind": "quarter-second"}


def test_a_request_handed_over_at_a_step_end_enters_the_next_step() -> None:
    """The tie rule: a hand-over at exactly a step's end (`due <= clock`) is in the next
    step's schedule, as for a request that arrives while vLLM's engine core finishes a step.
    (The base's server process, sleeping across the step, entered it one step later: c's
    first token at 1.0 s. Found by review; the fleet's lock-step path still does that.)"""
    from sim.cost.api_server import ApiServerCost

    free = ApiServerCost(per_request_s=0.0, per_prompt_token_s=0.0)
    tie = SimConfig(scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                                              max_model_len=4096),
                    cache=CacheConfig(block_size=16, num_blocks=400), fast_forward=False,
                    api_server=free)
    # steps [0, .25), [.25, .5), ...: "b" handed over inside the second step, "c" at its end
    trace = Trace([TraceRequest(request_id=rid, arrival_s=t, prompt_len=32, output_len=8)
                   for rid, t in (("a", 0.0), ("b", 0.3), ("c", 0.5))])
    first = {r.request_id: r.first_token_s for r in
             simulate(trace, tie, QuarterSecond()).requests}  # type: ignore[arg-type]
    assert first == {"a": 0.25, "b": 0.75, "c": 0.75}
