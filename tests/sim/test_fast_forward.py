"""Fast-forwarding runs of plain decode steps gives exactly the records of stepping one by
one: same step rows, same request rows, same floats."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

import runtime.engine
import sim.simulator
from runtime import CacheConfig, SchedulerConfig
from runtime.batch import BatchFeatures
from runtime.decode_run import decode_run_limit, run_decode_steps, steps_before_token_stop
from runtime.engine import EngineCore, _bulk_decode_times
from runtime.native import is_compiled
from sim.cost.api_server import ApiServerCost
from sim.cost.base import CostModel, DecodeRunTimes, decode_run_timer
from sim.cost.profile_model import ProfileCoefficients, ProfileCostModel
from sim.cost.roofline import RooflineCostModel
from sim.hardware import resolve_gpu
from sim.model_presets import resolve_model
from sim.simulator import SimConfig, simulate
from tests.runtime.helpers import make_request, make_scheduler, step
from workloads import (
    ArrivalProcess,
    MultiTurn,
    PrefixRepetition,
    RandomLengths,
    Trace,
    multi_turn_trace,
    prefix_repetition_trace,
    random_trace,
)

COST = RooflineCostModel(resolve_model("llama-3.1-8b"), resolve_gpu("h200"))


def traces() -> dict[str, Trace]:
    arrivals = ArrivalProcess(request_rate=40.0, burstiness=0.5, seed=7)
    return {
        "random": random_trace(120, RandomLengths(200, 60, range_ratio=0.9), arrivals),
        "prefix": prefix_repetition_trace(
            80, PrefixRepetition(prefix_len=96, suffix_len=40, num_prefixes=3, output_len=50),
            arrivals),
        "multi_turn": multi_turn_trace(
            30, MultiTurn(num_turns=3, turn_gap_s=0.05, lengths=RandomLengths(64, 24)),
            arrivals),
    }


@pytest.mark.parametrize("name", ["random", "prefix", "multi_turn"])
@pytest.mark.parametrize(("num_blocks", "max_num_seqs", "policy"),
                         [(4000, 16, "fcfs"), (60, 8, "fcfs"), (90, 4, "priority")])
def test_fast_forward_records_equal_one_by_one(name: str, num_blocks: int,
                                               max_num_seqs: int, policy: str) -> None:
    trace = traces()[name]
    results = []
    for fast in (False, True):
        config = SimConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=max_num_seqs,
                                      max_model_len=4096, policy=policy),  # type: ignore[arg-type]
            cache=CacheConfig(block_size=16, num_blocks=num_blocks),
            api_server=ApiServerCost(), fast_forward=fast, check_invariants=True)
        results.append(simulate(trace, config, COST))
    slow, fast_result = results
    assert [s.to_row() for s in fast_result.steps] == [s.to_row() for s in slow.steps]
    assert [r.to_row() for r in fast_result.requests] == [r.to_row() for r in slow.requests]
    assert fast_result.prefix_cache_hits == slow.prefix_cache_hits


def test_run_decode_steps_leaves_the_scheduler_as_one_by_one_steps() -> None:
    def scenario() -> tuple[object, dict[str, list[int]]]:
        s = make_scheduler(block_size=4, num_blocks=40, max_num_batched_tokens=64)
        for i, prompt_len in enumerate((5, 7, 8, 12)):
            s.add_request(make_request(f"r{i}", list(range(100, 100 + prompt_len)), 30))
        step(s)  # prefill: every request now decodes
        plan = {r.request_id: [500 + 10 * k + j for j in range(40)]
                for k, r in enumerate(s.running)}
        return s, plan

    slow, plan = scenario()
    fast, _ = scenario()
    upcoming = {r.request_id: plan[r.request_id][r.num_output_tokens:] for r in fast.running}
    limit = decode_run_limit(fast)
    assert limit == 28  # 30 outputs, 1 sampled already: the 29th token stops them
    assert steps_before_token_stop(fast, upcoming, limit) == 28
    run_decode_steps(fast, 12, upcoming)
    for _ in range(12):
        step(slow, plan=plan)
    fast.check_invariants()
    for a, b in zip(slow.running, fast.running, strict=True):
        assert (a.request_id, a.num_computed_tokens, a.output_token_ids, a.block_hashes) == \
            (b.request_id, b.num_computed_tokens, b.output_token_ids, b.block_hashes)
        assert slow.get_block_ids(a.request_id) == fast.get_block_ids(b.request_id)
    pool_a, pool_b = slow.kv_cache_manager.block_pool, fast.kv_cache_manager.block_pool
    assert pool_a.free_block_ids() == pool_b.free_block_ids()
    assert pool_a.cached_block_ids() == pool_b.cached_block_ids()


def test_decode_run_stops_before_a_preemption_would_be_needed() -> None:
    s = make_scheduler(block_size=4, num_blocks=5, max_num_batched_tokens=64)  # 4 blocks
    s.add_request(make_request("a", 4, 20))
    s.add_request(make_request("b", 4, 20))
    step(s)  # a: [1], b: [2]; both need a new block now, then every 4 steps
    assert decode_run_limit(s) == 4  # steps 0 and 4 need 2 blocks each: 2 free


def test_no_decode_run_with_an_admissible_waiting_request() -> None:
    s = make_scheduler(max_num_seqs=4)
    s.add_request(make_request("a", 4, 20))
    step(s)
    s.add_request(make_request("w", 4, 20))
    assert decode_run_limit(s) == 0


def test_decode_run_stops_before_an_eos_token() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 4, 20, ignore_eos=False, eos_token_id=2))
    s.add_request(make_request("b", 4, 20, stop_token_ids=(7,)))
    step(s)
    assert decode_run_limit(s) == 18
    tokens = {"a": [600, 601, 2, 603], "b": [600] * 10}
    assert steps_before_token_stop(s, tokens, 18) == 2  # a samples EOS in the third step
    tokens = {"a": [600] * 10, "b": [600, 7]}
    assert steps_before_token_stop(s, tokens, 18) == 1


class _PerStepCost:
    """The roofline without its bulk `decode_run_times`: decode runs are timed per step."""

    def step_time(self, features: BatchFeatures) -> float:
        return COST.step_time(features)

    def describe(self) -> dict[str, object]:
        return {}


@pytest.mark.parametrize("name", ["random", "prefix", "multi_turn"])
def test_bulk_decode_run_times_give_the_per_step_records(name: str) -> None:
    trace = traces()[name]
    config = SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                                  max_model_len=4096),
        cache=CacheConfig(block_size=16, num_blocks=4000), check_invariants=True)
    assert decode_run_timer(COST) is not None and decode_run_timer(_PerStepCost()) is None  # type: ignore[arg-type]
    bulk = simulate(trace, config, COST)
    per_step = simulate(trace, config, _PerStepCost())  # type: ignore[arg-type]
    assert [s.to_row() for s in bulk.steps] == [s.to_row() for s in per_step.steps]
    assert [r.to_row() for r in bulk.requests] == [r.to_row() for r in per_step.requests]


BULK_COSTS: list[CostModel] = [
    COST,
    RooflineCostModel(resolve_model("llama-3.1-70b"), resolve_gpu("h100-sxm"),
                      tensor_parallel_size=8),
    ProfileCostModel(ProfileCoefficients(
        constant_s=2.1e-3, per_prefill_token_s=7.5e-5, per_decode_token_s=3.0e-5,
        per_seq_s=4.0e-6, per_prefill_attention_pair_s=1.2e-9, per_decode_kv_token_s=2.5e-8)),
]


def test_bulk_decode_times_equal_per_step_ones_across_chunks() -> None:
    """`_bulk_decode_times` (chunks of 32, doubling) gives `_decode_times`'s ends and
    durations exactly, for runs spanning several chunks and horizons cutting any of them."""
    rng = random.Random(20261130)
    max_calls = 0
    many_chunks = 0
    for case in range(400):
        model = BULK_COSTS[case % len(BULK_COSTS)]
        timer = decode_run_timer(model)
        assert timer is not None
        calls: list[int] = []

        def run_times(num_seqs: int, kv: int, count: int, timer: DecodeRunTimes = timer,
                      calls: list[int] = calls) -> Sequence[float]:
            calls.append(count)
            return timer(num_seqs, kv, count)

        def step_time(features: BatchFeatures, start: float,
                      model: CostModel = model) -> float:
            return model.step_time(features)

        clock = rng.choice([0.0, rng.uniform(0.0, 5e3)])
        limit = rng.randint(1, 700)
        num_running = rng.randint(1, 64)
        kv_tokens = num_running * rng.randint(1, 4000)
        unbounded, _ = EngineCore._decode_times(clock, math.inf, step_time, limit,
                                                num_running, kv_tokens)
        kind = case % 4
        if kind == 0:
            horizon = math.inf
        elif kind == 1:  # exactly at a step's end: that step is the last one run
            horizon = rng.choice(unbounded)
        elif kind == 2:  # strictly between two ends (or before the first one)
            k = rng.randrange(len(unbounded))
            low = clock if k == 0 else unbounded[k - 1]
            horizon = low + (unbounded[k] - low) * rng.uniform(0.01, 0.99)
        else:  # tiny: the first step only, or none
            horizon = clock + rng.choice([0.0, 1e-12, (unbounded[0] - clock) / 2])
        expected = EngineCore._decode_times(clock, horizon, step_time, limit, num_running,
                                            kv_tokens)
        got = _bulk_decode_times(clock, horizon, run_times, limit, num_running, kv_tokens)
        assert got == expected, (case, clock, horizon, limit, num_running, kv_tokens)
        assert all(type(t) is float for t in got[0] + got[1])
        assert sum(calls) >= len(got[0])
        max_calls = max(max_calls, len(calls))
        many_chunks += len(calls) >= 3
    assert max_calls >= 5  # 32 + 64 + 128 + 256 < 700 steps
    assert many_chunks >= 50


@pytest.mark.skipif(is_compiled(sim.simulator) or is_compiled(runtime.engine),
                    reason="patches EngineCore.begin_step, which the compiled engine loop "
                           "calls directly")
@pytest.mark.parametrize("seed", range(3))
def test_only_admitting_steps_are_stepped_one_by_one(monkeypatch: pytest.MonkeyPatch,
                                                     seed: int) -> None:
    """With steady decodes a request joins them right after the step that completes its
    prefill, and the steps in which they finish end a fast-forwarded run: only steps that
    admit a request run one by one (Azure-like sparse arrivals), with the same records."""
    arrivals = ArrivalProcess(request_rate=15.0, burstiness=1.0, seed=seed)
    trace = random_trace(60, RandomLengths(200, 60, range_ratio=0.9), arrivals)
    stepped: list[int] = []
    begin_step = EngineCore.begin_step

    def counted(core: EngineCore, now: float):  # type: ignore[no-untyped-def]
        step = begin_step(core, now)
        if step is not None:
            stepped.append(core.recorder.num_steps)
        return step

    monkeypatch.setattr(EngineCore, "begin_step", counted)
    results = []
    for fast in (False, True):
        stepped.clear()
        config = SimConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16,
                                      max_model_len=4096),
            cache=CacheConfig(block_size=16, num_blocks=4000), fast_forward=fast,
            check_invariants=not fast)  # checking materialises the steady decodes
        results.append(simulate(trace, config, COST))
    slow, fast_result = results
    assert [s.to_row() for s in fast_result.steps] == [s.to_row() for s in slow.steps]
    assert [r.to_row() for r in fast_result.requests] == [r.to_row() for r in slow.requests]
    admitting = sum(1 for n in fast_result.step_columns["num_prefill_seqs"] if n)
    assert len(stepped) == admitting < len(trace) + 1
    assert sum(fast_result.step_columns["num_finished"]) == len(trace)  # finishes ran fast
