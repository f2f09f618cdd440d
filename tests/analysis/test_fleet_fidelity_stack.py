"""`rt fidelity --fleet`'s report of the serving stack (`analysis.fleet_fidelity`): the
model the twin used, the real TTFT's split (from the real run.json) and the simulated one's
(from the sim run's columns), in the JSON and on the console."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from analysis.fleet_fidelity import serving_stack, stack_lines
from analysis.rundir import Run

FIT = {"fitted": True, "per_request_ms": 6.2, "per_prompt_token_us": 2.5,
       "fitted_on": "calibration replay", "requests": 160, "gap_p50_ms": 7.0,
       "gap_p90_ms": 12.0, "residual_p50_ms": 0.0, "residual_p90_ms": 4.5, "clamped": []}
SPLIT = {"client_ttft_mean_ms": 21.0, "routing_mean_ms": 1.0, "hops_mean_ms": 5.0,
         "api_ipc_mean_ms": 5.0, "engine_mean_ms": 10.0, "serve_ttft_mean_ms": 15.0}


def runs(model: dict[str, object], split: dict[str, float | None] | None) -> tuple[Run, Run]:
    sim = pd.DataFrame({"arrival_s": [0.0, 1.0], "first_token_s": [0.020, 1.022],
                        "routing_s": [0.001, 0.001], "api_server_s": [0.007, 0.007]})
    router = {} if split is None else {"router": {"ttft_split": split}}
    return (Run(Path("real"), pd.DataFrame(), pd.DataFrame(), router),
            Run(Path("sim"), sim, pd.DataFrame(), {"fleet": {"serving_stack": model}}))


def test_the_report_carries_the_fit_and_both_splits() -> None:
    section = serving_stack(*runs(FIT, SPLIT))
    assert section["model"] == FIT and section["real_split"] == SPLIT
    sim = section["sim_split"]
    assert sim["ttft_mean_ms"] == pytest.approx(21.0)
    assert sim["routing_mean_ms"] == pytest.approx(1.0)
    assert sim["serving_stack_mean_ms"] == pytest.approx(7.0)
    assert sim["engine_mean_ms"] == pytest.approx(13.0)
    lines = stack_lines(section)
    assert lines[0].startswith("serving stack (fitted on a calibration replay of 160 other "
                               "requests): 6.20 ms per request + 2.50 us per prompt token")
    assert ("after the fit (in-sample, the calibration replay) p50 +0.00 / p90 +4.50 ms"
            in lines[0])
    assert lines[1] == ("real TTFT mean 21.00 ms = routing 1.00 + HTTP hops and client 5.00 "
                        "+ API server and IPC 5.00 + engine 10.00 (the replicas' histograms)")
    assert lines[2] == ("sim TTFT mean 21.00 ms = routing 1.00 + serving stack 7.00 + "
                        "engine 13.00")


def test_an_unfitted_twin_and_an_older_real_run_still_report() -> None:
    model = {"fitted": False, "api_server": {"per_request_s": 0.0005,
                                             "per_prompt_token_s": 1e-6,
                                             "per_output_token_s": 0.0}}
    section = serving_stack(*runs(model, None))
    assert section["real_split"] == {}
    lines = stack_lines(section)
    assert lines[0] == ("serving stack: not fitted (the profile's API-server cost, 0.50 ms "
                        "per request)")
    assert len(lines) == 2 and lines[1].startswith("sim TTFT mean 21.00 ms")


def test_a_stack_not_fitted_says_why() -> None:
    model = {"fitted": False, "not_fitted": "9 requests of the calibration replay finished",
             "api_server": {"per_request_s": 0.0005}}
    assert stack_lines(serving_stack(*runs(model, None)))[0] == (
        "serving stack: not fitted (9 requests of the calibration replay finished; the "
        "profile's API-server cost, 0.50 ms per request)")


SPREAD = {"fitted": "residuals", "residuals": 160,
          "quantiles_ms": {"p1": -3.1, "p10": -2.5, "p25": -1.2, "p50": 0.0, "p75": 2.8,
                           "p90": 11.5, "p99": 33.4}}
DRAWN = {"requests": 160, "p50_ms": 7.1, "p90_ms": 18.9, "p99_ms": 40.2, "at_zero": 2}


def test_the_spread_and_the_drawn_delays_are_on_the_console() -> None:
    lines = stack_lines(serving_stack(*runs({**FIT, "spread": SPREAD, "drawn": DRAWN},
                                            SPLIT)))
    assert lines[1] == ("  spread around the line (160 residuals, one drawn per request): "
                        "p1 -3.10 / p10 -2.50 / p25 -1.20 / p50 +0.00 / p75 +2.80 / p90 "
                        "+11.50 / p99 +33.40 ms")
    assert lines[2] == ("  delays drawn for the trace: p50 7.10 / p90 18.90 / p99 40.20 ms "
                        "(2 at 0), after the routing decision")
    assert lines[3].startswith("real TTFT mean")


def test_a_split_with_parts_not_measured_still_renders() -> None:
    """run.json's nulls (`backends.route.fleet_fidelity._replay_once`): the router's
    /metrics unread leaves the routing and hence the hops unknown; a replica's, every part
    from the histograms. Each unknown part reads n/a (it was a TypeError)."""
    router_unread = {**SPLIT, "routing_mean_ms": None, "hops_mean_ms": None}
    assert stack_lines(serving_stack(*runs(FIT, router_unread)))[1] == (
        "real TTFT mean 21.00 ms = routing n/a + HTTP hops and client n/a + API server and "
        "IPC 5.00 + engine 10.00 (the replicas' histograms)")
    replica_unread = {**dict.fromkeys(SPLIT), "client_ttft_mean_ms": 21.0,
                      "routing_mean_ms": 1.0}
    assert stack_lines(serving_stack(*runs(FIT, replica_unread)))[1] == (
        "real TTFT mean 21.00 ms = routing 1.00 + HTTP hops and client n/a + API server and "
        "IPC n/a + engine n/a (the replicas' histograms)")
    nan = {**SPLIT, "client_ttft_mean_ms": math.nan}  # no request got a first token
    assert stack_lines(serving_stack(*runs(FIT, nan)))[1].startswith("real TTFT mean n/a ms")


FLOOR = {"measured": True, "p50_ttft": 0.05, "p90_ttft": 0.125, "windows": [
    {"window": "before", "requests": 77, "per_request_ms": 6.0, "per_prompt_token_us": 1.0,
     "gap_p50_ms": 6.5, "gap_p90_ms": 11.0,
     "predicts_other": {"p50_ttft": -0.05, "p90_ttft": -0.125}},
    {"window": "after", "requests": 80, "per_request_ms": 7.5, "per_prompt_token_us": 0.5,
     "gap_p50_ms": 8.0, "gap_p90_ms": 14.0,
     "predicts_other": {"p50_ttft": 0.04, "p90_ttft": 0.1}}]}


def test_two_windows_and_their_noise_floor_are_on_the_console() -> None:
    model = {**FIT, "windows": 2, "cold_left_out": 3, "noise_floor": FLOOR}
    lines = stack_lines(serving_stack(*runs(model, SPLIT)))
    assert lines[0].startswith(
        "serving stack (fitted on 2 calibration windows (before and after the measured "
        "replay, pooled) of 160 other requests, 3 arriving before the first one's first "
        "token left out (cold)): 6.20 ms")
    assert "after the fit (in-sample, the calibration windows) p50 +0.00" in lines[0]
    assert lines[1:4] == [
        "  noise floor (real against real: one calibration window's fit predicting the "
        "other's TTFT): p50 5.0% / p90 12.5%",
        "    before window: 77 requests, 6.00 ms + 1.00 us per token, real - twin p50 6.50 / "
        "p90 11.00 ms; predicts the other p50 -5.0% / p90 -12.5%",
        "    after  window: 80 requests, 7.50 ms + 0.50 us per token, real - twin p50 8.00 / "
        "p90 14.00 ms; predicts the other p50 +4.0% / p90 +10.0%"]


def test_the_windows_same_requests_paired_are_on_the_console() -> None:
    same = {"requests": 77, "after_minus_before_p50_ms": 0.25, "slower_after": 41}
    model = {**FIT, "windows": 2, "noise_floor": {**FLOOR, "same_requests": same}}
    lines = stack_lines(serving_stack(*runs(model, SPLIT)))
    assert lines[4] == ("    the same 77 requests after against before: real TTFT +0.25 ms "
                        "(median, each against itself), slower after in 41")


def test_a_floor_not_measured_says_why() -> None:
    model = {**FIT, "noise_floor": {"measured": False, "why": "1 calibration window(s), not 2"}}
    lines = stack_lines(serving_stack(*runs(model, SPLIT)))
    assert lines[1] == "  noise floor: not measured (1 calibration window(s), not 2)"
