"""Calibration windows before and after the measured replay (`rt fidelity --fleet`): the
serving stack fitted on both pooled (`sim.serving_stack.fit_on_twins`: the first window
alone loses its cold requests), and the noise floor, each window's fit predicting the
other's TTFT out of sample (`sim.fleet_twin`). Deterministic: no process, no clock."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sim.fleet_twin import fleet_twin
from sim.serving_stack import ServingStack, warm_requests
from tests.sim.test_serving_stack import (
    ENGINE,
    FLEET,
    OVERHEADS,
    PER_REQUEST_S,
    PER_TOKEN_S,
    FakeCalibration,
    conversations,
    stack_free,
)
from workloads import Trace, resample_like

STACK = ServingStack(PER_REQUEST_S, PER_TOKEN_S)
SLOWER = ServingStack(2 * PER_REQUEST_S, PER_TOKEN_S)  # the machine twice as slow after


def window(seed: int, stack: ServingStack) -> FakeCalibration:
    """A calibration window of other requests (resampled with `seed`), 1 s apart (no two in
    an engine at once: a delay shifts a TTFT by exactly itself), whose real TTFT is the
    stack-free twin's plus `stack`'s cost."""
    drawn = resample_like(conversations(), seed)
    trace = Trace(tuple(dataclasses.replace(r, arrival_s=float(i))
                        for i, r in enumerate(drawn)), drawn.name)
    lens = {r.request_id: r.prompt_len for r in trace}
    return FakeCalibration(trace, {rid: t + stack.delay_s(lens[rid])
                                   for rid, t in stack_free(trace).items()}, OVERHEADS)


def described(*windows: FakeCalibration) -> dict:
    _, describe = fleet_twin(conversations(), FLEET, ENGINE, "llama-3.1-8b", "h200", None, 0,
                             OVERHEADS, windows)
    return describe["fleet"]["serving_stack"]


def test_two_windows_are_pooled_and_only_the_first_loses_its_cold_requests() -> None:
    stack = described(window(11, STACK), window(12, STACK))
    assert stack["fitted"] and stack["windows"] == 2
    assert stack["per_request_ms"] == pytest.approx(PER_REQUEST_S * 1e3, rel=1e-9)
    assert stack["per_prompt_token_us"] == pytest.approx(PER_TOKEN_S * 1e6, rel=1e-9)
    # the first window's first request is cold; the second window ran on a warm fleet
    assert stack["cold_left_out"] == 1 and stack["requests"] == 47 + 48
    assert stack["fitted_on"].startswith("calibration windows (other requests) before and")


def test_a_steady_machine_has_a_noise_floor_of_0() -> None:
    floor = described(window(11, STACK), window(12, STACK))["noise_floor"]
    assert floor["measured"]
    assert [(w["window"], w["requests"]) for w in floor["windows"]] == [("before", 47),
                                                                        ("after", 48)]
    assert floor["p50_ttft"] == pytest.approx(0.0, abs=1e-12)
    assert floor["p90_ttft"] == pytest.approx(0.0, abs=1e-12)


def _error(real: dict[str, float], sim: dict[str, float], q: int) -> float:
    ids = list(real)
    r, s = (float(np.percentile([d[i] for i in ids], q)) for d in (real, sim))
    return (s - r) / r


def _with(w: FakeCalibration, stack: ServingStack, ids: list[str]) -> dict[str, float]:
    """`w`'s requests `ids` as a twin with `stack` (its line, no spread) would time them."""
    base = stack_free(w.trace)
    lens = {r.request_id: r.prompt_len for r in w.trace}
    return {rid: base[rid] + stack.delay_s(lens[rid]) for rid in ids}


def test_a_machine_that_moved_between_the_windows_shows_in_the_floor() -> None:
    """The stack's fixed cost doubles between the windows: the window before predicts the
    one after too fast, the one after predicts the warm requests before too slow, by
    exactly what their lines differ (each line exact: no residual to draw); the floor is
    the larger |error|; the pooled fit lies between the two."""
    before, after = window(11, STACK), window(12, SLOWER)
    stack = described(before, after)
    floor = stack["noise_floor"]
    warm = [r.request_id for r in warm_requests(before)]
    after_ids = [r.request_id for r in after.trace]
    expected = [{f"p{q}_ttft": _error(_with(after, SLOWER, after_ids),
                                      _with(after, STACK, after_ids), q) for q in (50, 90)},
                {f"p{q}_ttft": _error(_with(before, STACK, warm), _with(before, SLOWER, warm),
                                      q) for q in (50, 90)}]
    for got, want in zip([w["predicts_other"] for w in floor["windows"]], expected,
                         strict=True):
        assert got == pytest.approx(want, rel=1e-9)
    assert expected[0]["p50_ttft"] < 0 < expected[1]["p50_ttft"]
    assert floor["p50_ttft"] == pytest.approx(max(abs(e["p50_ttft"]) for e in expected))
    assert floor["p90_ttft"] == pytest.approx(max(abs(e["p90_ttft"]) for e in expected))
    assert [w["per_request_ms"] for w in floor["windows"]] == pytest.approx(
        [PER_REQUEST_S * 1e3, 2 * PER_REQUEST_S * 1e3])
    assert PER_REQUEST_S * 1e3 < stack["per_request_ms"] < 2 * PER_REQUEST_S * 1e3


def test_without_two_fittable_windows_the_floor_says_why() -> None:
    assert described(window(11, STACK))["noise_floor"] == {
        "measured": False, "why": "1 calibration window(s), not 2"}
    after = window(12, STACK)
    short = dataclasses.replace(after, ttft_s=dict(list(after.ttft_s.items())[:9]))
    floor = described(window(11, STACK), short)["noise_floor"]
    assert floor["measured"] is False
    assert floor["why"].startswith("the after window: 9 requests of the calibration replay")


def test_the_same_requests_in_both_windows_pair_each_against_itself() -> None:
    """Both windows replay the same requests (as `rt fidelity --fleet` does since fid15d):
    each warm request's real TTFT after minus before is exactly what the machine added
    (the fixed cost doubled: + PER_REQUEST_S each); windows of other requests pair none."""
    before = window(11, STACK)
    after = window(11, SLOWER)
    floor = described(before, after)["noise_floor"]
    warm = len(warm_requests(before))
    assert floor["same_requests"]["requests"] == warm == 47
    assert floor["same_requests"]["after_minus_before_p50_ms"] == pytest.approx(
        PER_REQUEST_S * 1e3, rel=1e-9)
    assert floor["same_requests"]["slower_after"] == warm
    other = window(12, STACK)  # other lengths; ids as "0".., so some draws equal by chance
    equal = sum(r == q for r, q in zip(before.trace, other.trace, strict=True)
                if r.request_id in {w.request_id for w in warm_requests(before)})
    paired = described(before, other)["noise_floor"]["same_requests"]
    assert 0 < paired["requests"] == equal < warm
    assert paired["after_minus_before_p50_ms"] == pytest.approx(0.0, abs=1e-9)
    moved = FakeCalibration(Trace(tuple(dataclasses.replace(r, arrival_s=r.arrival_s + 0.5)
                                        for r in other.trace), other.trace.name),
                            other.ttft_s, OVERHEADS)
    assert "same_requests" not in described(before, moved)["noise_floor"]
