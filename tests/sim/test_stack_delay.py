"""The serving stack's time after the routing decision (`sim.fleet`'s `stack_delay_s`) and
its spread (`sim.serving_stack.Spread`, `draw_delays`): requests are routed at their arrival
in arrival order, then each enters its replica's core its own delay later, not queued behind
the others; the delays are the fitted line plus residuals drawn from a seed. Deterministic:
no process, no clock."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from runtime.router import make_policy
from sim.cost.api_server import ApiServerCost
from sim.fleet import FleetResult, simulate_fleet
from sim.fleet_twin import fleet_twin
from sim.serving_stack import (
    ServingStack,
    Spread,
    draw_delays,
    fit_serving_stack,
    warm_requests,
)
from tests.sim.fleet_support import Replica
from tests.sim.test_fleet import TRACES, config, rows
from tests.sim.test_serving_stack import (
    ENGINE,
    FLEET,
    OVERHEADS,
    FakeCalibration,
    stack_free,
    twin,
)
from workloads import Trace, TraceRequest, resample_like
from workloads.flags import WorkloadFlags, load_workload

FOUR = Trace(tuple(TraceRequest(str(i), i * 0.1, 100 * (i + 1), 4) for i in range(4)), "t")
SPREAD = Spread.of([0.003, -0.003, 0.0, 0.019, -0.002])  # median 0: on the line


def test_the_spread_is_the_residuals_sorted_as_they_are() -> None:
    assert SPREAD.residuals_s == (-0.003, -0.002, 0.0, 0.003, 0.019)
    q = SPREAD.describe()["quantiles_ms"]
    assert q["p50"] == 0.0 and q["p90"] == pytest.approx(12.6)
    assert q["p10"] == pytest.approx(-2.6)
    below = Spread.of([-0.001, -0.004, -0.002])  # a clamped line's: not re-centred
    assert below.residuals_s == (-0.004, -0.002, -0.001)
    assert Spread.of([]) == Spread() and list(Spread().draw(np.array([0.3]))) == [0.0]
    with pytest.raises(ValueError, match="sorted"):
        Spread((0.002, 0.001))
    with pytest.raises(ValueError, match="finite"):
        Spread((0.0, math.inf))


def test_delays_drawn_from_a_seed_are_exact_and_reproducible() -> None:
    stack = ServingStack(0.005, 2e-6)
    delays = draw_delays(FOUR, stack, SPREAD, seed=7)
    assert delays == {"0": 0.009489020864222344, "1": 0.0028477089772707374,
                      "2": 0.00335639093318851, "3": 0.0034398210462362002}
    assert draw_delays(FOUR, stack, SPREAD, seed=7) == delays
    assert draw_delays(FOUR, stack, SPREAD, seed=8) != delays
    assert draw_delays(FOUR, stack, Spread(), seed=7) == {
        r.request_id: stack.delay_s(r.prompt_len) for r in FOUR}  # no spread: the line


def test_many_draws_keep_the_line_as_their_median_and_are_never_negative() -> None:
    trace = Trace(tuple(TraceRequest(str(i), 0.0, 100, 1) for i in range(4001)), "t")
    stack = ServingStack(0.002, 0.0)
    delays = np.array(list(draw_delays(trace, stack, SPREAD, seed=1).values()))
    # the median of 4001 uniforms is 0.5 within 0.008 (one sd), which the residuals'
    # quantile function (12 ms per unit of u above 0.5) turns into 0.1 ms
    assert np.median(delays) == pytest.approx(0.002, abs=3e-4)
    assert delays.min() == 0.0  # line - 3 ms, clamped: a TTFT no faster than the engine's
    assert delays.max() <= 0.002 + 0.019
    assert np.quantile(delays, 0.9) == pytest.approx(0.002 + 0.0126, abs=1e-3)


def test_the_fit_keeps_its_residuals_as_the_spread() -> None:
    lens = [100 * k for k in range(1, 12)]
    extra = [0.0, 0.001, -0.001, 0.0, 0.03, 0.0, 0.002, -0.0005, 0.0, 0.0, 0.004]
    real = [0.010 + 1e-5 * x + e for x, e in zip(lens, extra, strict=True)]
    fit = fit_serving_stack(lens, real, [0.005] * 11)
    assert fit.stack.per_request_s == pytest.approx(0.005)
    assert fit.spread.residuals_s == pytest.approx(sorted(extra), abs=1e-12)
    assert fit.describe()["spread"]["residuals"] == 11


def test_routing_is_in_arrival_order_whatever_the_delays() -> None:
    """A per-token delay that used to reorder requests at the router (delayed before it,
    the short prompt arrived at the router first and took replica 0): routed at arrival,
    round-robin gives the long one replica 0, as the real router does."""
    mixed = Trace((TraceRequest("long", 0.0, 4000, 2), TraceRequest("short", 0.001, 10, 2)))
    delays = {"long": 4000e-6, "short": 10e-6}
    for policy in ("round-robin", "least-outstanding"):
        result = simulate_fleet(mixed, [Replica(config())] * 2, make_policy(policy),
                                stack_delay_s=delays)
        assert [(r.request_id, r.replica) for r in result.requests] == [("long", 0),
                                                                         ("short", 1)]


@pytest.mark.parametrize("policy", ["round-robin", "least-outstanding", "dynamo-kv"])
def test_a_shorter_delay_enters_the_core_first_not_queued(policy: str) -> None:
    """One replica (every kind: pre-routed, stepped, KV events; no API-server cost): A
    routed first with a 10 ms stack, B 1 ms later with none; B enters the core at its
    arrival, A 10 ms after its own, each delay exactly its API-server time, routing at the
    arrival."""
    pair = Trace((TraceRequest("A", 0.0, 64, 2), TraceRequest("B", 0.001, 64, 2)))
    free = dataclasses.replace(config(), api_server=ApiServerCost(0.0, 0.0, 0.0))
    result = simulate_fleet(pair, [Replica(free)], make_policy(policy), refresh_s=0.0,
                            routing_latency_s=0.0005, stack_delay_s={"A": 0.010, "B": 0.0})
    a, b = result.requests
    assert (a.arrival_s, a.routing_s, a.api_server_s) == (0.0, 0.0005, pytest.approx(0.010))
    assert (b.arrival_s, b.routing_s, b.api_server_s) == (0.001, 0.0005, 0.0)
    assert b.first_token_s is not None and a.first_token_s is not None
    assert b.first_token_s < a.first_token_s


def _free() -> Replica:
    """A replica whose API server costs nothing: a hand-over is its arrival + delays."""
    return Replica(dataclasses.replace(config(), api_server=ApiServerCost(0.0, 0.0, 0.0)))


@pytest.mark.parametrize("policy", ["least-outstanding", "dynamo-kv"])
def test_a_hand_over_whose_timeout_rounds_early_still_enters(policy: str) -> None:
    """A hand-over at h is a timeout of h - now, which fires at now + (h - now): for some
    arrivals a float's last bit before h. Its request enters all the same (it used to stay
    pending: "1 requests never finished")."""
    latency, delay = 0.001, 0.02
    arrival = next(a for a in (k * 1e-7 for k in range(1, 10**6))
                   if a + ((a + latency + delay) - a) < a + latency + delay)
    result = simulate_fleet(Trace((TraceRequest("x", arrival, 64, 2),)), [_free()],
                            make_policy(policy), refresh_s=0.0, routing_latency_s=latency,
                            stack_delay_s={"x": delay})
    assert [r.request_id for r in result.requests] == ["x"]


def _crossed_timeouts(latency: float) -> tuple[Trace, dict[str, float]]:
    """A routed first, B 0.3 ms later with a shorter delay that hands it over a float's
    last bit before A, yet both timeouts fire at one time (A's, set first, first)."""
    for k in range(1, 10**4):
        a, b = k * 1e-7, k * 1e-7 + 3e-4
        routed_b = a + (b - a)  # the event loop's time when B is routed
        h_a = 0.05 + k * 1e-9
        h_b = math.nextafter(h_a, 0.0)
        d_a, d_b = h_a - (a + latency), h_b - (b + latency)
        if ((a + latency) + d_a, (b + latency) + d_b) == (h_a, h_b) and \
                a + (h_a - a) == routed_b + (h_b - routed_b):
            trace = Trace((TraceRequest("A", a, 64, 2), TraceRequest("B", b, 64, 2)))
            return trace, {"A": d_a, "B": d_b}
    raise AssertionError("no such floats")


@pytest.mark.parametrize("policy", ["least-outstanding", "dynamo-kv"])
def test_hand_overs_whose_timeouts_fire_out_of_order_both_enter(policy: str) -> None:
    """B is due first but A's timeout fires first: A's takes both (taking only the head,
    B, would leave A to B's timeout, which is not due by A's time)."""
    trace, delays = _crossed_timeouts(0.001)
    result = simulate_fleet(trace, [_free()], make_policy(policy), refresh_s=0.0,
                            routing_latency_s=0.001, stack_delay_s=delays)
    assert sorted(r.request_id for r in result.requests) == ["A", "B"]


@pytest.mark.parametrize("policy", ["round-robin", "least-outstanding", "dynamo-kv"])
def test_no_delays_or_zero_delays_are_the_fleet_without_them(policy: str) -> None:
    trace = TRACES["prefix"]

    def run(delays: dict[str, float] | None) -> FleetResult:
        return simulate_fleet(trace, [Replica(config(num_blocks=150))] * 3,
                              make_policy(policy, seed=9), refresh_s=0.01,
                              routing_latency_s=0.002, stack_delay_s=delays)

    base = rows(simulate_fleet(trace, [Replica(config(num_blocks=150))] * 3,
                                  make_policy(policy, seed=9), refresh_s=0.01,
                                  routing_latency_s=0.002))
    assert rows(run(None)) == base
    assert rows(run({})) == base
    assert rows(run(dict.fromkeys((r.request_id for r in trace), 0.0))) == base


def test_a_negative_or_nan_delay_is_refused() -> None:
    for bad in (-1e-3, math.nan):
        with pytest.raises(ValueError, match=r"stack_delay_s\['x'\] must be a finite"):
            simulate_fleet(Trace((TraceRequest("x", 0.0, 8, 1),)), [Replica(config())],
                           make_policy("round-robin"), stack_delay_s={"x": bad})


def test_the_twin_draws_each_request_s_delay_from_the_fitted_spread() -> None:
    """A calibration replay whose real TTFT is the stack-free twin's + 6 ms + a residual
    of its own: the twin's records carry the line + a drawn residual as API-server time
    (those of `draw_delays` with the run's seed), arrivals as in the trace."""
    flags = WorkloadFlags(dataset_name="multi_turn", num_prompts=48, input_len=96,
                          output_len=6, turns=4, turn_gap_s=0.5, request_rate=8.0, seed=3)
    trace = load_workload(flags).trace
    calibration_trace = resample_like(trace, 11)
    base = stack_free(calibration_trace)
    rng = np.random.default_rng(2)
    real = {rid: t + 0.006 + float(rng.exponential(0.003)) for rid, t in base.items()}
    real[calibration_trace[0].request_id] += 0.3  # a fresh fleet's first request: cold
    calibration = FakeCalibration(calibration_trace, real, OVERHEADS)
    ttft, describe = twin(trace, calibration)
    stack = describe["fleet"]["serving_stack"]
    # the first request and the 7 arriving before its first token (0.31 s) left out
    assert stack["cold_left_out"] == 8
    assert stack["spread"]["residuals"] == 40 and stack["spread"]["quantiles_ms"]["p50"] == 0.0
    assert stack["spread"]["quantiles_ms"]["p90"] > 2.0  # the exponential's tail
    assert stack["spread"]["quantiles_ms"]["p99"] < 50.0  # not the cold request's 300 ms
    fitted = ServingStack(stack["per_request_ms"] / 1e3, stack["per_prompt_token_us"] / 1e6)
    result, _ = fleet_twin(trace, FLEET, ENGINE, "llama-3.1-8b", "h200", None, 0,
                           OVERHEADS, (calibration,))
    assert stack["drawn"]["requests"] == len(trace)
    spread = Spread(tuple(_residuals(calibration, fitted)))
    expected = draw_delays(trace, fitted, spread, 0)
    arrivals = {r.request_id: r.arrival_s for r in trace}
    for record in result.requests:
        assert record.arrival_s == arrivals[record.request_id]
        assert record.api_server_s == pytest.approx(expected[record.request_id], abs=1e-9)
    assert ttft.keys() == arrivals.keys()


def _residuals(calibration: FakeCalibration, stack: ServingStack) -> list[float]:
    """The calibration's residuals around `stack`'s line but the cold requests'
    (`warm_requests`), sorted."""
    base = stack_free(calibration.trace)
    lens = {r.request_id: r.prompt_len for r in warm_requests(calibration)}
    return sorted(calibration.ttft_s[rid] - base[rid] - stack.delay_s(n)
                  for rid, n in lens.items())


def test_the_delay_draws_are_not_the_random_dataset_s_lengths() -> None:
    """The uniforms come from a stream of the seed's own: from `default_rng(seed)` itself,
    with `--seed` equal to the trace's, they were the bits vLLM's random dataset drew its
    lengths from (`workloads.synthetic`; correlation 1.0)."""
    trace = load_workload(WorkloadFlags(dataset_name="random", num_prompts=400, input_len=512,
                                        output_len=32, range_ratio=0.9, request_rate=10.0,
                                        seed=0)).trace
    u = np.array(list(draw_delays(trace, ServingStack(0.5, 0.0), Spread((-0.5, 0.5)),
                                  seed=0).values()))  # the line + the residual: u itself
    lens = np.array([r.prompt_len for r in trace], dtype=float)
    n = len(trace) // 2
    assert abs(np.corrcoef(u[:n], lens[1:2 * n:2])[0, 1]) < 0.3


@pytest.mark.parametrize("policy", ["round-robin", "least-outstanding", "dynamo-kv"])
def test_the_core_orders_by_the_api_servers_stamp_not_the_hand_over(policy: str) -> None:
    """Priority policy, one sequence at a time, 1 ms of API server per request: A and B
    arrive together while `busy` runs; A's stack takes 20 ms, so B enters the core first.
    vLLM stamps `arrival_time` as its API server starts on a request (A at 0.010, B at
    0.011, after A's 1 ms), so A is served first once `busy` ends. Stamped at the trace's
    arrival the two tied and add order put B first (review 24, item 6)."""
    trace = Trace((TraceRequest("busy", 0.0, 64, 20), TraceRequest("A", 0.010, 64, 2),
                   TraceRequest("B", 0.010, 64, 2)))
    base = config(max_num_seqs=1)
    one = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler,
                                                                  policy="priority"),
                              api_server=ApiServerCost(0.001, 0.0, 0.0))
    result = simulate_fleet(trace, [Replica(one)], make_policy(policy), refresh_s=0.0,
                            stack_delay_s={"A": 0.020})
    busy, a, b = result.requests
    assert a.api_server_s == pytest.approx(0.021) and b.api_server_s == pytest.approx(0.002)
    assert busy.finish_s is not None and a.first_token_s is not None
    assert b.first_token_s is not None and busy.finish_s < a.first_token_s
    assert a.first_token_s < b.first_token_s
