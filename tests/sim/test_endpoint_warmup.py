"""`rt fidelity --endpoint`'s warm-up (`sim.endpoint_warmup`) against a fake endpoint whose
client ITL median per window is given: where it stops, what it reports, its bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.client_steps import ClientRun
from sim.endpoint_fidelity import EndpointFidelityPlan
from sim.endpoint_warmup import (
    WARMUP_REQUESTS,
    Warmup,
    itl_median_ms,
    run_warmup,
    window_size,
)
from sim.fidelity import FidelityFlags
from workloads import ArrivalProcess, Trace
from workloads.synthetic import RandomLengths, random_trace

TRACE = random_trace(100, RandomLengths(200, 16, 0.5), ArrivalProcess(8.0, 1.0, 1))


class Endpoint:
    """Window k streams every request's chunks `itl_ms[k]` apart (ms); remembers the calls
    (directory name, requests, token seed)."""

    def __init__(self, itl_ms: list[float]) -> None:
        self.itl_ms = itl_ms
        self.calls: list[tuple[str, int, int]] = []

    def replay(self, trace: Trace, path: Path, token_seed: int) -> None:
        self.calls.append((path.name, len(trace), token_seed))

    def read(self, path: Path, trace: Trace) -> ClientRun:
        gap = self.itl_ms[len(self.calls) - 1] / 1e3
        times = {r.request_id: tuple(r.arrival_s + 0.01 + gap * k for k in range(3))
                 for r in trace}
        return ClientRun(path.name, trace, times, {})


def test_the_warm_up_stops_after_the_first_window_within_the_tolerance() -> None:
    endpoint = Endpoint([3.0, 3.2, 2.6, 2.5, 2.45])  # +6.7%, -18.8%, -3.8%: steady at the 4th
    warmup, next_seed = run_warmup(TRACE, 100, 5, 40, Path("root"), endpoint.replay,
                                   endpoint.read)
    assert endpoint.calls == [("warmup", 20, 40), ("warmup-2", 20, 41), ("warmup-3", 20, 42),
                              ("warmup-4", 20, 43)]
    assert next_seed == 44 and warmup.requests == 80 and warmup.stable
    assert [w.itl_median_ms for w in warmup.windows] == pytest.approx([3.0, 3.2, 2.6, 2.5])
    assert warmup.drift == pytest.approx(2.5 / 2.6 - 1)
    assert warmup.lines() == ["warm-up: 80 requests in 4 windows, client ITL p50 3.00 / 3.20 / "
                              "2.60 / 2.50 ms; last window's drift -3.8% within the 5% "
                              "tolerance: steady"]
    out = warmup.to_json_dict()
    assert out["requests"] == 80 and out["stable"] and out["budget"] == 100
    assert out["windows"][3] == {"path": "root/warmup-4", "requests": 20,
                                 "itl_median_ms": pytest.approx(2.5)}


def test_the_warm_up_runs_to_its_bound_while_the_server_speeds_up() -> None:
    """The per-window medians of a fresh CPU engine's first 100 requests (2026-12-01)."""
    endpoint = Endpoint([3.05, 3.24, 2.64, 2.39, 1.99, 1.0])
    warmup, next_seed = run_warmup(TRACE, 100, 5, 0, Path("root"), endpoint.replay,
                                   endpoint.read)
    assert len(endpoint.calls) == 5 and warmup.requests == 100 and next_seed == 5
    assert not warmup.stable and warmup.drift == pytest.approx(1.99 / 2.39 - 1)
    assert warmup.lines()[0].endswith("last window's drift -16.7% outside the 5% tolerance: "
                                      "stopped at the --warmup-requests bound 100")


def test_small_and_zero_budgets() -> None:
    endpoint = Endpoint([2.0])
    warmup, next_seed = run_warmup(TRACE, 0, 5, 9, Path("root"), endpoint.replay,
                                   endpoint.read)
    assert endpoint.calls == [] and next_seed == 9 and warmup.requests == 0
    assert warmup.lines() == ["warm-up: none (--warmup-requests 0)"]
    warmup, next_seed = run_warmup(TRACE, 8, 5, 9, Path("root"), endpoint.replay,
                                   endpoint.read)
    assert endpoint.calls == [("warmup", 8, 9)] and next_seed == 10
    assert warmup.drift is None and not warmup.stable
    assert warmup.lines()[0].endswith("one window: no drift measured: stopped at the "
                                      "--warmup-requests bound 8")
    # 25 requests: windows of 10, the last one shorter
    endpoint = Endpoint([2.0, 3.0, 4.0])
    warmup, _ = run_warmup(TRACE, 25, 5, 0, Path("root"), endpoint.replay, endpoint.read)
    assert [n for _, n, _ in endpoint.calls] == [10, 10, 5] and warmup.requests == 25
    assert [window_size(n) for n in (1, 8, 10, 49, 50, 100, 101, 1000)] == \
        [1, 8, 10, 10, 10, 20, 21, 200]


def test_itl_median_over_all_requests_and_none_without_gaps() -> None:
    trace = Trace(TRACE.requests[:2])
    a, b = (r.request_id for r in trace)
    run = ClientRun("r", trace, {a: (0.0, 0.001, 0.003), b: (0.5, 0.504)}, {})
    assert itl_median_ms(run) == pytest.approx(2.0)  # gaps 1, 2, 4 ms
    assert itl_median_ms(ClientRun("r", trace, {a: (0.1,), b: (0.2,)}, {})) is None
    assert Warmup((), 0).drift is None


def test_a_negative_warm_up_is_refused_naming_the_flag() -> None:
    message = "--warmup-requests must be >= 0, got -1"
    with pytest.raises(ValueError, match=message):
        FidelityFlags(warmup_requests=-1).check(False, True, True)
    with pytest.raises(ValueError, match=message):
        EndpointFidelityPlan((("real", 0),), 0, "m", warmup_requests=-1,
                             profile=Path("p.json"))
    with pytest.raises(ValueError, match=message):
        run_warmup(TRACE, -1, 0, 0, Path("root"), Endpoint([]).replay, Endpoint([]).read)
    assert FidelityFlags().warmup_requests == WARMUP_REQUESTS == 100


def test_a_trace_shorter_than_a_window_still_fills_the_windows() -> None:
    """Each window resamples as many requests as it takes from the trace's lengths: a
    3-request trace gives the 5 windows of 20 its 100-request budget says, not 34 of 3."""
    endpoint = Endpoint([3.0, 2.0, 1.5, 1.2, 1.0])
    short = Trace(TRACE.requests[:3], "short")
    warmup, next_seed = run_warmup(short, 100, 5, 0, Path("root"), endpoint.replay,
                                   endpoint.read)
    assert [n for _, n, _ in endpoint.calls] == [20] * 5 and warmup.requests == 100
    assert next_seed == 5 and not warmup.stable


def test_a_window_in_which_no_request_streamed_has_no_median() -> None:
    """A cold server failing a whole window: no ITL to compare, the warm-up goes on."""
    endpoint = Endpoint([2.0, 2.0, 2.0])

    def read(path: Path, trace: Trace) -> ClientRun:
        run = endpoint.read(path, trace)
        if path.name == "warmup":
            raise ValueError(f"{path}: no request has per-request token times")
        return run

    warmup, _ = run_warmup(TRACE, 100, 5, 0, Path("root"), endpoint.replay, read)
    assert [w.itl_median_ms for w in warmup.windows] == [None, pytest.approx(2.0),
                                                        pytest.approx(2.0)]
    assert warmup.stable and warmup.requests == 60


def test_the_warm_up_flag_needs_an_endpoint() -> None:
    FidelityFlags().check(False, True, False)  # the default: nothing to refuse
    with pytest.raises(ValueError, match="--warmup-requests 40 needs --endpoint"):
        FidelityFlags(warmup_requests=40).check(False, True, False)
    FidelityFlags(warmup_requests=40).check(False, True, True)
