"""The simulator on traces small enough to check by hand, with a constant-time cost model."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import BatchFeatures, CacheConfig, SchedulerConfig
from runtime.records import PART_COLUMNS
from sim.cost.api_server import ApiServerCost
from sim.simulator import SimConfig, SimResult, simulate
from workloads import Trace, TraceRequest

STEP_S = 0.010
NO_API_COST = ApiServerCost(per_request_s=0.0, per_prompt_token_s=0.0)


@dataclass(frozen=True)
class ConstantCost:
    """Every non-empty step takes `step_s` seconds."""

    step_s: float = STEP_S

    def step_time(self, features: BatchFeatures) -> float:
        return self.step_s if features.num_seqs else 0.0

    def describe(self) -> dict[str, object]:
        return {"kind": "constant", "step_s": self.step_s}


def trace(*rows: tuple[str, float, int, int]) -> Trace:
    return Trace(tuple(TraceRequest(rid, arrival, prompt, out) for rid, arrival, prompt, out
                       in rows))


def run(t: Trace, *, budget: int = 64, max_num_seqs: int = 8, num_blocks: int = 64,
        block_size: int = 4, api: ApiServerCost | None = None, **sched: object) -> SimResult:
    config = SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  max_model_len=256, **sched),  # type: ignore[arg-type]
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        api_server=api or ApiServerCost(per_request_s=0.001, per_prompt_token_s=0.0),
        check_invariants=True,
    )
    return simulate(t, config, ConstantCost())


def by_id(result: SimResult) -> dict[str, object]:
    return {r.request_id: r for r in result.requests}


def test_two_requests_by_hand() -> None:
    # A arrives at 0 (tokenized by 0.001), B at 0.005 (by 0.006, while step 1 runs).
    # Steps: [0.001, 0.011) A prefill -> A tok1; [0.011, 0.021) A decode + B prefill;
    # [0.021, 0.031) A decode (3rd token: done) + B decode (2nd token: done).
    result = run(trace(("A", 0.0, 4, 3), ("B", 0.005, 4, 2)))
    a, b = by_id(result)["A"], by_id(result)["B"]
    assert a.token_times_s == pytest.approx([0.011, 0.021, 0.031])
    assert b.token_times_s == pytest.approx([0.021, 0.031])
    assert (a.first_token_s, a.finish_s) == pytest.approx((0.011, 0.031))
    assert (a.api_server_s, a.step_boundary_s, a.prefill_s, a.decode_s) == pytest.approx(
        (0.001, 0.0, 0.010, 0.020))
    assert (b.api_server_s, b.step_boundary_s, b.prefill_s, b.decode_s) == pytest.approx(
        (0.001, 0.005, 0.010, 0.010))
    assert [s.num_seqs for s in result.steps] == [1, 2, 2]
    assert [s.start_s for s in result.steps] == pytest.approx([0.001, 0.011, 0.021])
    assert a.status == b.status == "FINISHED_LENGTH_CAPPED"
    assert (a.output_len, b.output_len) == (3, 2)


def test_seed_example_token_counts_and_times() -> None:
    # Budget 6: A and B decode while C's 10-token prompt is chunked 4, 4, 2.
    result = run(trace(("A", 0.0, 2, 5), ("B", 0.0, 2, 5), ("C", 0.0095, 10, 3)),
                 budget=6, max_num_seqs=4, api=NO_API_COST)
    steps = result.steps
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in steps] == [
        (4, 0), (4, 2), (4, 2), (2, 2), (0, 3), (0, 1)]
    c = by_id(result)["C"]
    assert c.first_token_s == pytest.approx(0.040)  # end of step 4
    assert c.prefill_s == pytest.approx(0.030)
    assert c.step_boundary_s == pytest.approx(0.0005)  # arrived 0.5 ms before step 2


def test_max_num_seqs_queue_time_is_attributed() -> None:
    result = run(trace(("A", 0.0, 4, 2), ("B", 0.0, 4, 2)), max_num_seqs=1,
                 api=NO_API_COST)
    b = by_id(result)["B"]
    assert b.queue_max_num_seqs_s == pytest.approx(0.020)  # A's two steps
    assert b.first_scheduled_s == pytest.approx(0.020)
    assert [s.wait_reason for s in result.steps] == ["max_num_seqs", "max_num_seqs", None,
                                                     None]


def test_idle_gap_costs_no_steps() -> None:
    result = run(trace(("A", 0.0, 4, 3), ("B", 100.0, 4, 3)))
    assert len(result.steps) == 6
    b = by_id(result)["B"]
    assert b.first_token_s == pytest.approx(100.011)
    assert b.step_boundary_s == 0.0


def test_api_server_is_one_fifo_server() -> None:
    # Three 100-token prompts at t=0, 1 ms + 10 us/token each: handed over at 2, 4, 6 ms.
    api = ApiServerCost(per_request_s=0.001, per_prompt_token_s=1e-5)
    result = run(trace(("A", 0.0, 100, 1), ("B", 0.0, 100, 1), ("C", 0.0, 100, 1)),
                 budget=512, api=api)
    assert [r.queued_s for r in result.requests] == pytest.approx([0.002, 0.004, 0.006])
    assert [r.api_server_s for r in result.requests] == pytest.approx([0.002, 0.004, 0.006])


def test_request_that_can_never_fit_is_reported_not_hung_on() -> None:
    result = run(trace(("big", 0.0, 200, 2), ("ok", 0.0, 4, 2)), num_blocks=10)
    big, ok = by_id(result)["big"], by_id(result)["ok"]
    assert big.status == "FINISHED_IGNORED" and "pool has 9" in big.stop_reason
    assert big.output_len == 0 and big.finish_s == pytest.approx(0.001)
    assert ok.status == "FINISHED_LENGTH_CAPPED"


def test_requests_are_recorded_in_trace_order_and_runs_are_deterministic() -> None:
    t = trace(*[(f"r{i}", 0.001 * i, 5 + i % 7, 1 + i % 5) for i in range(30)])
    first, second = run(t, num_blocks=12), run(t, num_blocks=12)
    assert [r.request_id for r in first.requests] == [f"r{i}" for i in range(30)]
    assert [r.to_row() for r in first.requests] == [r.to_row() for r in second.requests]
    assert [s.to_row() for s in first.steps] == [s.to_row() for s in second.steps]


@st.composite
def random_traces(draw: st.DrawFn) -> Trace:
    n = draw(st.integers(1, 25))
    gaps = draw(st.lists(st.floats(0, 0.05), min_size=n, max_size=n))
    arrivals = [round(sum(gaps[: i + 1]), 6) for i in range(n)]
    return Trace(tuple(
        TraceRequest(f"r{i}", arrivals[i], draw(st.integers(1, 40)), draw(st.integers(1, 12)))
        for i in range(n)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_traces(), st.integers(6, 30), st.sampled_from([1, 2, 4]),
       st.sampled_from(["fcfs", "priority"]))
def test_parts_sum_to_e2e_for_every_request(t: Trace, num_blocks: int, max_num_seqs: int,
                                            policy: str) -> None:
    result = run(t, budget=16, max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                 policy=policy)
    assert len(result.requests) == len(t)
    for r in result.requests:
        parts = math.fsum(getattr(r, c) for c in PART_COLUMNS)
        assert parts == pytest.approx(r.finish_s - r.arrival_s, abs=1e-9), r.request_id
        assert all(getattr(r, c) >= -1e-9 for c in PART_COLUMNS), r
        if r.status != "FINISHED_IGNORED":
            assert len(r.token_times_s) == r.output_len


def test_an_engine_whose_requests_are_all_refused_takes_no_steps() -> None:
    result = run(trace(("a", 0.0, 300, 2), ("b", 1.0, 300, 2)), num_blocks=10)
    assert [r.status for r in result.requests] == ["FINISHED_IGNORED"] * 2
    assert result.num_steps == 0
