"""The serving stack's own time in the fleet's twin (`sim.serving_stack`, `sim.fidelity`):
the robust line fit, its recovery of known costs from a calibration replay whose real side
is the stack-free twin plus those costs, and the twin with a fitted stack shifting each TTFT
by exactly its cost. Deterministic: no process, no clock."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from runtime.config import EngineFlags
from sim.fidelity import fleet_twin, stack_free_twin
from sim.fleet_config import FleetFlags
from sim.serving_stack import ServingStack, fit_serving_stack, theil_sen, ttft_by_request
from workloads import Trace, resample_like
from workloads.flags import WorkloadFlags, load_workload

ENGINE = EngineFlags(max_model_len=4096)
FLEET = FleetFlags(replicas=2, router="prefix-aware")
OVERHEADS = {"routing_latency_mean_s": 0.0008, "scrape_age_mean_s": math.nan,
             "scrape_period_s": 0.5}
PER_REQUEST_S, PER_TOKEN_S = 0.0062, 2.5e-6


def conversations(spacing_s: float | None = None) -> Trace:
    """12 four-turn conversations; with `spacing_s`, the same requests that far apart (no
    two in an engine at once)."""
    flags = WorkloadFlags(dataset_name="multi_turn", num_prompts=48, input_len=96,
                          output_len=6, turns=4, turn_gap_s=0.5, request_rate=8.0, seed=3)
    trace = load_workload(flags).trace
    if spacing_s is None:
        return trace
    return Trace(tuple(dataclasses.replace(r, arrival_s=i * spacing_s)
                       for i, r in enumerate(trace)), trace.name)


@dataclass(frozen=True)
class FakeCalibration:
    """A calibration replay whose real TTFTs are given (`sim.serving_stack.MeasuredReplay`)."""

    trace: Trace
    ttft_s: Mapping[str, float]
    overheads: Mapping[str, Any]


def twin(trace: Trace, calibration: FakeCalibration | None = None
         ) -> tuple[dict[str, float], dict[str, Any]]:
    result, describe = fleet_twin(trace, FLEET, ENGINE, "llama-3.1-8b", "h200", None, 0,
                                  OVERHEADS, calibration)
    return ttft_by_request(result.requests), describe


def stack_free(trace: Trace) -> dict[str, float]:
    return ttft_by_request(stack_free_twin(trace, FLEET, ENGINE, "llama-3.1-8b", "h200",
                                           None, 0, OVERHEADS).requests)


def calibration_with(stack: ServingStack) -> FakeCalibration:
    """A calibration replay (other requests) whose real TTFT is the stack-free twin's plus
    `stack`'s cost: what a real fleet with exactly that stack would measure."""
    trace = resample_like(conversations(), 11)
    base = stack_free(trace)
    lens = {r.request_id: r.prompt_len for r in trace}
    return FakeCalibration(trace, {rid: t + stack.per_request_s + stack.per_prompt_token_s
                                   * lens[rid] for rid, t in base.items()}, OVERHEADS)


def test_theil_sen_is_exact_on_a_line_and_ignores_a_tail() -> None:
    x = [100.0, 250.0, 400.0, 700.0, 900.0, 1300.0, 50.0]
    y = [0.004 + 3e-6 * v for v in x]
    assert theil_sen(x, y) == pytest.approx((0.004, 3e-6), rel=1e-12)
    # two of seven requests queued for a CPU far longer: the fit does not move
    tailed = [*y[:5], y[5] + 0.2, y[6] + 0.09]
    assert theil_sen(x, tailed) == pytest.approx((0.004, 3e-6), rel=1e-9)
    assert theil_sen([5.0, 5.0, 5.0], [1.0, 2.0, 9.0]) == (2.0, 0.0)  # no distinct x


def test_the_fit_reports_the_gap_and_what_the_line_leaves() -> None:
    # five requests, the last one queued 40 ms for a CPU
    fit = fit_serving_stack([100, 200, 300, 400, 500], [0.011, 0.012, 0.013, 0.014, 0.055],
                            [0.005] * 5)
    assert fit.stack.per_prompt_token_s == pytest.approx(1e-5)
    assert fit.stack.per_request_s == pytest.approx(0.005)
    assert fit.requests == 5 and fit.residual_p50_s == pytest.approx(0.0)
    assert fit.residual_p90_s > 0.01 and fit.gap_p90_s > fit.gap_p50_s
    assert fit.clamped == ()


def test_negative_costs_are_clamped_and_named() -> None:
    falling = fit_serving_stack([100, 200, 300], [0.009, 0.008, 0.007], [0.0, 0.0, 0.0])
    assert falling.stack == ServingStack(0.008, 0.0)  # the median gap, no token term
    assert falling.clamped == ("per_prompt_token_s",)
    faster = fit_serving_stack([100, 200], [0.001, 0.001], [0.003, 0.003])
    assert faster.stack == ServingStack(0.0, 0.0) and faster.clamped == ("per_request_s",)
    with pytest.raises(ValueError, match="no request finished"):
        fit_serving_stack([], [], [])
    with pytest.raises(ValueError, match="non-negative"):
        ServingStack(-1e-3, 0.0)


def test_the_twin_recovers_known_costs_from_a_calibration_replay() -> None:
    _, describe = twin(conversations(), calibration_with(ServingStack(PER_REQUEST_S,
                                                                      PER_TOKEN_S)))
    stack = describe["fleet"]["serving_stack"]
    assert stack["fitted"] and stack["clamped"] == []
    assert stack["per_request_ms"] == pytest.approx(PER_REQUEST_S * 1e3, rel=1e-9)
    assert stack["per_prompt_token_us"] == pytest.approx(PER_TOKEN_S * 1e6, rel=1e-9)
    assert stack["residual_p90_ms"] == pytest.approx(0.0, abs=1e-9)
    assert stack["requests"] == 48
    assert describe["api_server"] == {"per_request_s": pytest.approx(PER_REQUEST_S),
                                      "per_prompt_token_s": pytest.approx(PER_TOKEN_S),
                                      "per_output_token_s": 0.0}


def test_the_fitted_stack_shifts_each_ttft_by_exactly_its_cost() -> None:
    spaced = conversations(spacing_s=1.0)
    lens = {r.request_id: r.prompt_len for r in spaced}
    base = stack_free(spaced)
    fitted, _ = twin(spaced, calibration_with(ServingStack(PER_REQUEST_S, PER_TOKEN_S)))
    assert fitted.keys() == base.keys() == lens.keys()
    for rid, ttft in fitted.items():
        assert ttft - base[rid] == pytest.approx(PER_REQUEST_S + PER_TOKEN_S * lens[rid],
                                                 abs=1e-12)
    zero, _ = twin(spaced, calibration_with(ServingStack()))
    assert zero == base


def test_without_calibration_the_twin_keeps_the_profile_s_api_server() -> None:
    _, describe = twin(conversations())
    stack = describe["fleet"]["serving_stack"]
    assert stack == {"fitted": False, "api_server": describe["api_server"]}
