"""Calibration from client-side timings (`sim.client_steps`, `sim.client_calibrate`): a
simulated run with known costs, read as a client would see it, gives the costs back."""

from __future__ import annotations

from dataclasses import replace

import pytest

from runtime import CacheConfig, SchedulerConfig
from sim.client_calibrate import fit_client_runs
from sim.client_steps import ClientRun, client_run, observed_steps
from sim.cost.api_server import ApiServerCost
from sim.cost.profile_model import ProfileCoefficients, ProfileCostModel
from sim.simulator import SimConfig, simulate
from workloads import ArrivalProcess, Trace, TraceRequest
from workloads.synthetic import RandomLengths, random_trace

TRUE = ProfileCoefficients(constant_s=4e-3, per_prefill_token_s=20e-6,
                           per_decode_token_s=150e-6, per_seq_s=0.0,
                           per_prefill_attention_pair_s=0.0, per_decode_kv_token_s=0.5e-6)
FRONT = ApiServerCost(per_request_s=1e-3, per_prompt_token_s=2e-6, per_output_token_s=30e-6)
SCHED = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=4096)
CACHE = CacheConfig(block_size=16, num_blocks=4000)


def _client_view(num_prompts: int = 120) -> ClientRun:
    trace = random_trace(num_prompts, RandomLengths(300, 32, 0.8), ArrivalProcess(12.0, 1.0, 1))
    result = simulate(trace, SimConfig(SCHED, CACHE, api_server=FRONT), ProfileCostModel(TRUE))
    return ClientRun("sim", trace, {r.request_id: tuple(r.token_times_s)
                                    for r in result.requests}, {})


def test_noise_free_client_times_give_the_true_costs_back() -> None:
    fit = fit_client_runs([_client_view()], SCHED, CACHE)
    c = fit.coefficients
    assert c.constant_s == pytest.approx(TRUE.constant_s, rel=0.02)
    assert c.per_prefill_token_s == pytest.approx(TRUE.per_prefill_token_s, rel=0.05)
    assert c.per_decode_token_s == pytest.approx(TRUE.per_decode_token_s, rel=0.05)
    assert c.per_decode_kv_token_s == pytest.approx(TRUE.per_decode_kv_token_s, rel=0.05)
    assert fit.api_server.per_output_token_s == pytest.approx(30e-6, rel=0.1)
    for key in ("p50_ttft", "p90_ttft", "p50_itl", "p90_itl"):
        assert abs(fit.in_sample[key]["error"]) < 0.03, (key, fit.in_sample[key])
    # sequences equal decodes except in the few mixed steps: not told apart, not invented
    assert "per_seq_s" in fit.unidentified
    assert c.per_seq_s == 0.0


def test_steps_are_reconstructed_from_chunk_times() -> None:
    run = _client_view(40)
    steps = observed_steps(run, SCHED)
    assert steps.split_streams == 0
    assert steps.busy.sum() > 0.9 * len(steps.end_s)


def test_a_step_read_with_a_gap_stays_one_step() -> None:
    # streams a and b run together, a chunk every 10 ms; b's second chunk is read 4 ms late
    # (past the 3 ms cluster gap) but before a's next one: still the step of a's 10 ms chunk
    trace = Trace((TraceRequest("a", 0.0, 8, 4), TraceRequest("b", 0.0, 8, 4)))
    times = {"a": (0.010, 0.020, 0.030, 0.040), "b": (0.0105, 0.024, 0.0305, 0.0405)}
    steps = observed_steps(ClientRun("late", trace, times, {}), SCHED)
    assert len(steps.end_s) == 4 and steps.split_streams == 0
    assert list(steps.decodes) == [0, 2, 2, 2]


def test_a_run_without_token_times_is_refused_with_the_reason() -> None:
    columns = {"request_id": ["0"], "arrival_s": [0.0], "prompt_len": [8], "output_len": [4],
               "status": ["FINISHED_LENGTH_CAPPED"], "token_times_s": [[]]}
    with pytest.raises(ValueError, match="no request has per-request token times"):
        client_run("RUN", columns)
    del columns["token_times_s"]
    with pytest.raises(ValueError, match="RUN: no token_times_s column"):
        client_run("RUN", columns)


def _warped(run: ClientRun, start_s: float, end_s: float, slowdown: float) -> ClientRun:
    """`run` as if everything (server and client) had run `slowdown` times slower from
    `start_s` to `end_s` of its clock: a disturbed period."""
    def warp(t: float) -> float:
        if t < start_s:
            return t
        return start_s + slowdown * (min(t, end_s) - start_s) + max(t - end_s, 0.0)

    trace = Trace(tuple(replace(r, arrival_s=warp(r.arrival_s)) for r in run.trace))
    times = {rid: tuple(warp(t) for t in ts) for rid, ts in run.token_times_s.items()}
    return ClientRun(run.name, trace, times, {})


def test_a_disturbed_period_is_left_out_and_the_costs_still_come_back() -> None:
    clean = _client_view(240)  # ~20 s at 12 req/s
    fit = fit_client_runs([_warped(clean, 8.0, 10.0, 2.5)], SCHED, CACHE)
    # 8-10 s of the server's time last 8-13 s on the warped clock: whole windows in it
    # flagged at 2.5x (a window of fewer than 20 timed steps is not judged)
    assert [(w.start_s, w.end_s) for w in fit.disturbed][:2] == [(8.0, 9.0), (9.0, 10.0)]
    assert all(8.0 <= w.start_s and w.end_s <= 13.0 for w in fit.disturbed)
    assert all(w.slowdown == pytest.approx(2.5, rel=0.01) for w in fit.disturbed)
    assert fit.counts["disturbed_requests"] > 0
    c = fit.coefficients
    assert c.constant_s == pytest.approx(TRUE.constant_s, rel=0.05)
    assert c.per_decode_token_s == pytest.approx(TRUE.per_decode_token_s, rel=0.05)
    # the steps straddling the disturbance's edges look like stalls (0.4% here)
    assert fit.scatter is not None and fit.scatter.stall_probability < 0.01
    assert clean.token_times_s == _client_view(240).token_times_s  # (deterministic)
    undisturbed = fit_client_runs([clean], SCHED, CACHE)
    assert undisturbed.disturbed == () and undisturbed.counts["disturbed_requests"] == 0


def test_a_request_the_server_configuration_cannot_run_is_named() -> None:
    # max_model_len = the longest prompt: that request leaves no room for output and is
    # ignored by the simulated scheduler, so it has no simulated TTFT (once float(None): a
    # TypeError traceback from `rt calibrate --from-run --max-model-len`)
    run = _client_view()
    longest = max(run.trace, key=lambda r: r.prompt_len)  # the first of the longest
    assert sorted(r.prompt_len for r in run.trace)[-3:] == [529, 531, 531]  # (the seed's)
    message = (f"sim: request {longest.request_id!r} does not run under the server's "
               "configuration: prompt of 531 tokens leaves no room for output within "
               "max_model_len=531")
    with pytest.raises(ValueError) as err:
        fit_client_runs([run], replace(SCHED, max_model_len=531), CACHE)
    assert str(err.value) == message
