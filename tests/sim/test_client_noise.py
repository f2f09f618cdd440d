"""The step-time noise of a client-timed fit (`sim.client_noise`) and the stalls it adds to
`sim.step_noise.StepNoise`: a known scatter, stall rate and stall size are recovered, a
disturbed period is found and left out, and a simulation with the fitted noise reproduces the
known quantiles of the step times."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from runtime import CacheConfig, SchedulerConfig
from sim.client_noise import MIN_SLOWDOWN, disturbed_windows, step_scatter
from sim.cost.profile_model import ProfileCoefficients, ProfileCostModel
from sim.engine_args import EngineArgs, build_setup
from sim.profile import Profile, load_profile, write_profile
from sim.simulator import SimConfig, simulate
from sim.step_noise import StepNoise
from workloads import ArrivalProcess, Trace, TraceRequest
from workloads.synthetic import RandomLengths, random_trace

STEP_S = 2e-3  # predicted step time
STALL_P = 0.05  # stall probability
STALL_LO, STALL_HI = 3e-3, 7e-3  # stalls uniform in these seconds


def _known_steps(n: int = 20_000) -> tuple[np.ndarray, np.ndarray]:
    """Observed and predicted durations: factor uniform in 0.8-1.2 times STEP_S, plus a
    stall (uniform STALL_LO-STALL_HI) on a STALL_P share of the steps."""
    rng = np.random.default_rng(7)
    predicted = np.full(n, STEP_S)
    stall = np.where(rng.random(n) < STALL_P, rng.uniform(STALL_LO, STALL_HI, n), 0.0)
    return predicted * rng.uniform(0.8, 1.2, n) + stall, predicted


def test_a_known_scatter_and_stalls_are_recovered() -> None:
    y, predicted = _known_steps()
    residual = y - predicted
    sigma = 1.4826 * float(np.median(np.abs(residual)))
    keep = np.abs(residual) <= 4 * sigma  # stage 1's trim
    follows = np.ones(len(y), dtype=bool)
    fit = step_scatter(y, predicted, follows, keep)
    assert fit is not None and fit.stall_quantiles_s is not None
    assert fit.stall_probability == pytest.approx(STALL_P, rel=0.05)
    stalls = np.asarray(fit.stall_quantiles_s)
    # excess over the prediction: the stall plus the step's scatter (+-0.4 ms)
    assert stalls[50] == pytest.approx((STALL_LO + STALL_HI) / 2, rel=0.05)
    assert stalls[10] == pytest.approx(STALL_LO + 0.1 * (STALL_HI - STALL_LO), rel=0.1)
    body = np.asarray(fit.quantiles)
    for i, expected in ((10, 0.84), (50, 1.0), (90, 1.16)):  # uniform 0.8-1.2
        assert body[i] == pytest.approx(expected, abs=0.01), i
    # busy time unbiased: mean factor times the predictions plus the stalls' seconds
    busy = body.mean() * predicted.sum() + fit.stall_probability * len(y) * stalls.mean()
    assert busy == pytest.approx(y.sum(), rel=0.01)


def test_noise_free_steps_have_no_stalls_and_a_flat_scatter() -> None:
    predicted = np.full(500, STEP_S)
    y = predicted * (1 + 1e-9 * np.arange(500))
    fit = step_scatter(y, predicted, np.ones(500, dtype=bool), np.ones(500, dtype=bool))
    assert fit is not None
    assert fit.stall_probability == 0.0 and fit.stall_quantiles_s is None
    assert fit.quantiles[0] == pytest.approx(1.0) and fit.quantiles[-1] == pytest.approx(1.0)


def test_a_disturbed_period_is_found_and_nothing_on_a_steady_server() -> None:
    y, predicted = _known_steps(6_000)
    end_s = np.cumsum(y)  # one run, ~14 s
    run = np.zeros(len(y), dtype=np.int64)
    slow = (end_s >= 5.0) & (end_s < 7.0)
    disturbed_y = np.where(slow, 2.0 * y, y)
    drop, windows = disturbed_windows(run, end_s, disturbed_y, predicted)
    assert [(w.start_s, w.end_s) for w in windows] == [(5.0, 6.0), (6.0, 7.0)]
    assert all(w.slowdown > MIN_SLOWDOWN for w in windows)
    assert drop.sum() == slow.sum() and (drop == slow).all()
    drop, windows = disturbed_windows(run, end_s, y, predicted)
    assert windows == [] and not drop.any()


def test_stalls_are_drawn_with_their_probability_and_size() -> None:
    table = tuple(np.linspace(STALL_LO, STALL_HI, 101))
    noise = StepNoise((0.8, 1.2), seed=3, stall_probability=STALL_P, stall_quantiles_s=table)
    steps = np.asarray([noise.stall(k) for k in range(40_000)])
    assert (steps > 0).mean() == pytest.approx(STALL_P, rel=0.05)
    assert np.median(steps[steps > 0]) == pytest.approx((STALL_LO + STALL_HI) / 2, rel=0.03)
    # the stall stream is independent of the scatter's: same factors with or without stalls
    plain = StepNoise((0.8, 1.2), seed=3)
    assert [noise.factor(k, 0.0) for k in range(100)] == [plain.factor(k, 0.0)
                                                          for k in range(100)]
    assert noise.duration(STEP_S, 5, 0.0) == STEP_S * noise.factor(5, 0.0) + noise.stall(5)
    stalled = next(k for k in range(1000) if noise.stall(k) > 0)
    assert noise.duration(0.0, stalled, 0.0) == 0.0  # an empty step takes no time
    with pytest.raises(ValueError, match="stall_probability > 0 needs stall_quantiles_s"):
        StepNoise((1.0, 1.0), stall_probability=0.1)
    with pytest.raises(ValueError, match=r"stall_probability must be in \[0, 1\]"):
        StepNoise((1.0, 1.0), stall_probability=1.5, stall_quantiles_s=table)


def test_a_simulation_with_the_fitted_noise_reproduces_the_known_quantiles() -> None:
    """One long decode stream: every simulated step is a decode of one sequence, so the
    simulated step times are draws of the fitted model; their p50/p90/p99 match those of the
    known steps the model was fitted on."""
    y, predicted = _known_steps()
    residual = y - predicted
    keep = np.abs(residual) <= 4 * 1.4826 * float(np.median(np.abs(residual)))
    fit = step_scatter(y, predicted, np.ones(len(y), dtype=bool), keep)
    assert fit is not None
    noise = StepNoise(fit.quantiles, seed=11, stall_probability=fit.stall_probability,
                      stall_quantiles_s=fit.stall_quantiles_s)
    cost = ProfileCostModel(ProfileCoefficients(STEP_S, 0.0, 0.0, 0.0, 0.0, 0.0))
    config = SimConfig(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                       max_model_len=20_000),
                       CacheConfig(block_size=16, num_blocks=2_000),
                       vocab_size=512, step_noise=noise)
    result = simulate(Trace((TraceRequest("a", 0.0, 8, 12_000),)), config, cost)
    times = np.asarray(result.requests[0].token_times_s)
    gaps = np.diff(times)
    for q in (50, 90, 99):
        assert np.percentile(gaps, q) == pytest.approx(np.percentile(y, q), rel=0.03), q


def _profile(stalls: tuple[float, ...] | None, probability: float = 0.0) -> Profile:
    return Profile(device="endpoint", model="tiny", dtype="unknown", versions={},
                   date="2026-12-01", coefficients=ProfileCoefficients(STEP_S, 0, 0, 0, 0, 0),
                   step_time_quantiles=(0.8, 1.2), step_time_stall_probability=probability,
                   step_time_stall_quantiles_s=stalls)


def test_a_profile_carries_its_stalls_as_version_2_and_version_1_still_loads(
        tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    with_stalls = _profile((STALL_LO, STALL_HI), STALL_P)
    write_profile(with_stalls, path)
    data = json.loads(path.read_text())
    assert data["version"] == 2
    assert data["step_time_stalls"] == {"probability": STALL_P,
                                        "quantiles_s": [STALL_LO, STALL_HI]}
    assert load_profile(path) == with_stalls
    setup = build_setup(EngineArgs(num_gpu_blocks_override=200), "llama-3.1-8b", "h200",
                        str(path), seed=5, step_noise=True)
    assert setup.config.step_noise == StepNoise((0.8, 1.2), 5, None, None, STALL_P,
                                                (STALL_LO, STALL_HI))
    write_profile(_profile(None), path)  # no stalls: version 1, as before
    data = json.loads(path.read_text())
    assert data["version"] == 1 and "step_time_stalls" not in data
    assert load_profile(path) == _profile(None)
    data.update(version=2, step_time_stalls={"probability": 1.5, "quantiles_s": [0.0, 1.0]})
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"'step_time_stalls.probability' must be a number "
                       r"in \[0, 1\], got 1.5"):
        load_profile(path)
    data["step_time_stalls"] = {"probability": 0.1, "quantiles_s": [1.0, 0.5]}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'step_time_stalls.quantiles_s' must be a list"):
        load_profile(path)


def test_stalls_give_the_same_records_with_and_without_fast_forward() -> None:
    trace = random_trace(150, RandomLengths(300, 64, 0.8), ArrivalProcess(10.0, 1.0, 3))
    noise = StepNoise((0.8, 1.0, 1.2), 4, stall_probability=0.05,
                      stall_quantiles_s=(1e-3, 5e-3))
    config = SimConfig(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64,
                                       max_model_len=4096),
                       CacheConfig(block_size=16, num_blocks=4000), step_noise=noise)
    cost = ProfileCostModel(ProfileCoefficients(4e-3, 2e-5, 1.5e-4, 0.0, 0.0, 5e-7))
    fast = simulate(trace, config, cost)
    slow = simulate(trace, replace(config, fast_forward=False), cost)
    assert [list(r.token_times_s) for r in fast.requests] == [
        list(r.token_times_s) for r in slow.requests]
    plain = simulate(trace, replace(config, step_noise=StepNoise((0.8, 1.0, 1.2), 4)), cost)
    assert plain.requests[-1].finish_s < fast.requests[-1].finish_s  # the stalls cost time


def test_late_reads_stay_in_the_scatter_the_client_sees() -> None:
    """A chunk delivered late (beside its stream's next one) makes one observed duration
    long and the next short by as much; the client's ITL holds both, so the fitted noise
    draws them too: its p10/p50/p90 are those of the observed durations (leaving the pairs
    out gave a p90 5-6% low against vLLM)."""
    rng = np.random.default_rng(5)
    n = 20_000
    predicted = np.full(n, STEP_S)
    y = predicted * rng.uniform(0.5, 1.5, n)  # wide: the trim keeps the pairs
    late = np.flatnonzero(rng.random(n - 1) < 0.04)
    late = late[np.diff(late, prepend=-2) > 1]  # no overlapping pairs
    y[late] += 0.75 * STEP_S
    y[late + 1] -= 0.75 * STEP_S
    y = np.maximum(y, 0.05 * STEP_S)
    residual = y - predicted
    keep = np.abs(residual) <= 4 * 1.4826 * float(np.median(np.abs(residual)))
    fit = step_scatter(y, predicted, np.ones(n, dtype=bool), keep)
    assert fit is not None and keep[late].all()
    noise = StepNoise(fit.quantiles, seed=2, stall_probability=fit.stall_probability,
                      stall_quantiles_s=fit.stall_quantiles_s)
    drawn = np.asarray([noise.duration(STEP_S, k, 0.0) for k in range(n)])
    for q in (10, 50, 90, 99):
        assert np.percentile(drawn, q) == pytest.approx(np.percentile(y, q), rel=0.03), q


def test_a_late_pair_is_kept_or_left_out_whole_and_its_short_half_floored() -> None:
    """A narrow body (0.9-1.1x) with late pairs of +-0.9 step: a trim bound inside the pairs'
    spread keeps one half of some pairs and not the other. The fit decides by the long
    half, for both: the pairs whose long half is kept are in the table (long and short),
    the others are in neither part (not stalls). The short halves (0-0.2x: the client's
    bunching) are raised to the smallest ratio of a step in no pair."""
    rng = np.random.default_rng(7)
    n = 20_000
    predicted = np.full(n, STEP_S)
    y = predicted * rng.uniform(0.9, 1.1, n)
    late = np.flatnonzero(rng.random(n - 2) < 0.04)
    late = late[np.diff(late, prepend=-3) > 2]  # pairs apart: no short half is a long half
    y[late] += 0.9 * STEP_S
    y[late + 1] = np.maximum(y[late + 1] - 0.9 * STEP_S, 0.01 * STEP_S)
    keep = np.abs(y - predicted) <= 0.9 * STEP_S  # the trim's bound, inside the pairs' spread
    assert (keep[late] & ~keep[late + 1]).any() and (~keep[late] & keep[late + 1]).any()
    fit = step_scatter(y, predicted, np.ones(n, dtype=bool), keep)
    assert fit is not None and fit.stall_probability == 0.0
    whole = late[keep[late]]
    assert fit.steps == n - 2 * len(late) + 2 * len(whole)
    in_pair = np.zeros(n, dtype=bool)
    in_pair[late] = in_pair[late + 1] = True
    body_mean = (y[~in_pair].sum() + y[whole].sum() + np.maximum(
        y[whole + 1], y[~in_pair].min()).sum()) / (predicted[0] * fit.steps)
    scale = y.sum() / predicted.sum() / body_mean
    assert fit.quantiles[0] == pytest.approx(y[~in_pair].min() / STEP_S * scale, rel=1e-9)
    above = np.mean(np.asarray(fit.quantiles) > 1.5)  # the long halves kept
    assert above == pytest.approx(len(whole) / fit.steps, abs=0.011)
