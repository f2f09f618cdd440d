"""The serving stack's own time in the fleet's twin (`sim.serving_stack`, `sim.fidelity`):
the robust line fit, its recovery of known costs from a calibration replay whose real side
is the stack-free twin plus those costs, and the twin with a fitted stack shifting each TTFT
by exactly its cost. Deterministic: no process, no clock."""

from __future__ import annotations

import dataclasses
import math
import tracemalloc
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from runtime.config import EngineFlags
from sim.fleet_config import FleetFlags
from sim.fleet_twin import fleet_twin, stack_free_twin
from sim.serving_stack import (
    ServingStack,
    StackNotFitted,
    draw_delays,
    fit_serving_stack,
    theil_sen,
    ttft_by_request,
    warm_requests,
)
from workloads import Trace, TraceRequest, resample_like
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
                                  OVERHEADS, () if calibration is None else (calibration,))
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


def test_theil_sen_memory_is_linear_not_quadratic() -> None:
    """3,000 points would be 4.5 M pairs (~180 MB; ~8 GB at 20,000): a seeded sample of
    `MAX_PAIRS` instead, still exact on a line; the same seed gives the same fit."""
    n = 3000
    x = [float(10 + i % 500) for i in range(n)]
    y = [0.01 + 2e-6 * v for v in x]
    tracemalloc.start()
    fitted = theil_sen(x, y, seed=5)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 20e6, f"theil_sen peak {peak / 1e6:.0f} MB for {n} points"
    assert fitted == pytest.approx((0.01, 2e-6), rel=1e-9)
    noisy = [v + 1e-3 * ((i * 7919) % 13) for i, v in enumerate(y)]
    assert theil_sen(x, noisy, seed=5) == theil_sen(x, noisy, seed=5)
    assert theil_sen(x, noisy, seed=5) != theil_sen(x, noisy, seed=6)


TEN = [100 * k for k in range(1, 11)]  # prompt lengths of ten requests


def test_the_fit_reports_the_gap_and_what_the_line_leaves() -> None:
    # ten requests, the last one queued 40 ms for a CPU
    real = [0.010 + 1e-5 * v + (0.04 if v == 1000 else 0.0) for v in TEN]
    fit = fit_serving_stack(TEN, real, [0.005] * 10)
    assert fit.stack.per_prompt_token_s == pytest.approx(1e-5)
    assert fit.stack.per_request_s == pytest.approx(0.005)
    assert fit.requests == 10 and fit.residual_p50_s == pytest.approx(0.0)
    assert fit.residual_p90_s > 1e-3 and fit.gap_p90_s > fit.gap_p50_s
    assert fit.clamped == ()


def test_negative_costs_are_clamped_and_named() -> None:
    falling = fit_serving_stack(TEN, [0.010 - 1e-6 * v for v in TEN], [0.0] * 10)
    assert falling.stack.per_request_s == pytest.approx(0.010 - 1e-6 * 550)  # the median
    assert falling.stack.per_prompt_token_s == 0.0
    assert falling.clamped == ("per_prompt_token_s",)
    faster = fit_serving_stack(TEN, [0.001] * 10, [0.003] * 10)
    assert faster.stack == ServingStack(0.0, 0.0)
    assert faster.clamped == ("per_request_s", "per_prompt_token_s")
    with pytest.raises(ValueError, match="non-negative"):
        ServingStack(-1e-3, 0.0)


def test_clamping_a_negative_intercept_refits_the_slope() -> None:
    """gap = 10 us/token * x - 5 ms over x in [1000, 2000): Theil-Sen's intercept is -5 ms;
    keeping its slope with the intercept clamped to 0 would shift every prediction up by
    5 ms; the slope refitted through the origin (median of gap / x) keeps the line centred."""
    x = list(range(1000, 2000, 10))
    fit = fit_serving_stack(x, [1e-5 * v - 0.005 for v in x], [0.0] * len(x))
    assert fit.clamped == ("per_request_s",)
    assert fit.stack.per_request_s == 0.0
    assert abs(fit.residual_p50_s) < 1e-4, fit.residual_p50_s


def test_a_fit_clamped_at_0_draws_no_delay_the_real_fleet_never_had() -> None:
    """Every real request 2-8 ms faster than its twin: the line is clamped at 0, and its
    residuals (all below it) stay where they are, so no delay comes out (re-centred on the
    line, half the draws were up to 3.4 ms over it)."""
    lens = [100 * k for k in range(1, 41)]
    gaps = -0.002 - np.random.default_rng(0).uniform(0.0, 0.006, len(lens))
    fit = fit_serving_stack(lens, list(0.05 + gaps), [0.05] * len(lens))
    assert fit.clamped == ("per_request_s", "per_prompt_token_s")
    assert fit.stack == ServingStack(0.0, 0.0)
    assert fit.spread.residuals_s == pytest.approx(sorted(gaps), abs=1e-15)  # as they are
    trace = Trace(tuple(TraceRequest(str(i), 0.0, n, 1) for i, n in enumerate(lens * 25)))
    assert set(draw_delays(trace, fit.stack, fit.spread, seed=0).values()) == {0.0}


def test_too_few_requests_or_failed_ones_are_not_fitted() -> None:
    with pytest.raises(StackNotFitted, match="calibration replay.*needs 10"):
        fit_serving_stack([], [], [])
    real = [0.010 + 1e-5 * v for v in TEN]
    failed = [*real[:9], math.nan]  # the last request failed: dropped, then too few
    with pytest.raises(StackNotFitted, match="^9 requests"):
        fit_serving_stack(TEN, failed, [0.0] * 10)
    fit = fit_serving_stack([*TEN, 50], [*real, math.nan], [0.0] * 11)
    assert fit.requests == 10 and fit.stack.per_request_s == pytest.approx(0.010)


def test_the_twin_recovers_known_costs_from_a_calibration_replay() -> None:
    _, describe = twin(conversations(), calibration_with(ServingStack(PER_REQUEST_S,
                                                                      PER_TOKEN_S)))
    stack = describe["fleet"]["serving_stack"]
    assert stack["fitted"] and stack["clamped"] == []
    assert stack["per_request_ms"] == pytest.approx(PER_REQUEST_S * 1e3, rel=1e-9)
    assert stack["per_prompt_token_us"] == pytest.approx(PER_TOKEN_S * 1e6, rel=1e-9)
    assert stack["residual_p90_ms"] == pytest.approx(0.0, abs=1e-9)
    # the first request and the one arriving 1.3 ms after it, before its first token: cold
    assert stack["requests"] == 46 and stack["cold_left_out"] == 2
    assert stack["applied_as"].startswith("a delay per request after the routing")
    assert describe["api_server"] == {"per_request_s": 0.0, "per_prompt_token_s": 0.0,
                                      "per_output_token_s": 0.0}  # as in the fit


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


def test_too_short_a_calibration_replay_leaves_the_stack_unfitted() -> None:
    calibration = calibration_with(ServingStack(PER_REQUEST_S, PER_TOKEN_S))
    short = dataclasses.replace(calibration, ttft_s=dict(list(calibration.ttft_s.items())[:9]))
    _, describe = twin(conversations(), short)
    stack = describe["fleet"]["serving_stack"]
    assert not stack["fitted"] and stack["not_fitted"].startswith("7 requests")  # 9 - 2 cold
    assert stack["api_server"] == describe["api_server"] == twin(conversations())[1][
        "api_server"]


def test_the_stack_s_delay_is_the_records_api_server_time() -> None:
    """Arrivals as in the trace, the delay a part of E2E of its own (routing + the parts
    sum to E2E), as `analysis.fleet_fidelity`'s split reads it."""
    trace = conversations()
    result, _ = fleet_twin(trace, FLEET, ENGINE, "llama-3.1-8b", "h200", None, 0, OVERHEADS,
                           (calibration_with(ServingStack(PER_REQUEST_S, PER_TOKEN_S)),))
    arrivals = {r.request_id: (r.arrival_s, r.prompt_len) for r in trace}
    for record in result.requests:
        arrival, prompt_len = arrivals[record.request_id]
        assert record.arrival_s == arrival
        assert record.api_server_s == pytest.approx(PER_REQUEST_S + PER_TOKEN_S * prompt_len,
                                                    abs=1e-12)


def _replay(arrivals: list[float], ttft_s: dict[str, float]) -> FakeCalibration:
    trace = Trace(tuple(TraceRequest(str(i), a, 64, 2) for i, a in enumerate(arrivals)))
    return FakeCalibration(trace, ttft_s, OVERHEADS)


def test_requests_arriving_before_the_first_one_s_first_token_are_cold() -> None:
    """The first request's first token at 0.0 + 0.25 s: requests 1 and 2 (0.1, 0.2 s)
    waited behind its cold start, 3 (0.25 s) did not. A first request that failed: the
    first with a TTFT sets the time."""
    replay = _replay([0.0, 0.1, 0.2, 0.25, 0.6], {"0": 0.25, "1": 0.2, "2": 0.09,
                                                   "3": 0.01, "4": 0.01})
    assert [r.request_id for r in warm_requests(replay)] == ["3", "4"]
    failed_first = dataclasses.replace(replay, ttft_s={"1": 0.11, "3": 0.01, "4": 0.01})
    assert [r.request_id for r in warm_requests(failed_first)] == ["3", "4"]  # 0.1 + 0.11
    assert warm_requests(dataclasses.replace(replay, ttft_s={})) == []


def test_requests_queued_behind_the_cold_start_stay_out_of_the_spread() -> None:
    """The calibration replay's first request is cold for 0.5 s and holds up every request
    arriving meanwhile (fid16's replays: requests 2-9, 0.18-0.42 s after the first, 30-130
    ms over the twin against a median of 6-10 ms); leaving out the first alone kept them in
    the spread (its p90 283 ms, p99 471 ms here)."""
    calibration_trace = resample_like(conversations(), 11)
    base = stack_free(calibration_trace)
    rng = np.random.default_rng(2)
    real = {rid: t + 0.006 + float(rng.exponential(0.003)) for rid, t in base.items()}
    order = sorted(calibration_trace, key=lambda r: r.arrival_s)
    warm_at = order[0].arrival_s + 0.5  # the first token of the first request
    held = [r for r in order if r.arrival_s < warm_at]
    assert len(held) == 9
    for r in held:
        real[r.request_id] = warm_at - r.arrival_s + (base[r.request_id] if r is not order[0]
                                                       else 0.0)
    _, describe = twin(conversations(), FakeCalibration(calibration_trace, real, OVERHEADS))
    stack = describe["fleet"]["serving_stack"]
    assert stack["cold_left_out"] == 9 and stack["requests"] == 39
    assert stack["spread"]["quantiles_ms"]["p99"] < 20.0, stack["spread"]


def test_either_replay_s_router_figures_stand_in_for_the_other_s() -> None:
    """The calibration replay's router /metrics unread (NaN): its twin takes the measured
    replay's routing latency, so the fit recovers the stack alone (with 0 latency it took
    the 0.8 ms routing into its line, and the twin added it twice). The measured replay's
    unread: the twin routes with the calibration's."""
    unread = dict.fromkeys(OVERHEADS, math.nan)
    known = calibration_with(ServingStack(PER_REQUEST_S, PER_TOKEN_S))
    _, describe = twin(conversations(), dataclasses.replace(known, overheads=unread))
    stack = describe["fleet"]["serving_stack"]
    assert stack["calibration_routing_latency_ms"] == pytest.approx(0.8)
    assert stack["per_request_ms"] == pytest.approx(PER_REQUEST_S * 1e3, rel=1e-9)
    _, describe = fleet_twin(conversations(), FLEET, ENGINE, "llama-3.1-8b", "h200", None, 0,
                             unread, (known,))
    assert describe["fleet"]["routing_latency_ms"] == pytest.approx(0.8)
    assert describe["fleet"]["serving_stack"]["per_request_ms"] == pytest.approx(
        PER_REQUEST_S * 1e3, rel=1e-9)
