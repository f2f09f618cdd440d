"""The fleet `rt fidelity --fleet` runs for real, simulated (`fleet_twin`): N replicas of the
engine `rt serve --simulate` runs (same flags, model, GPU, profile and seed) behind the same
router policy, refresh interval and the router's measured routing latency, with the serving
stack's own time fitted on the calibration windows (`sim.serving_stack`) and the noise floor
those windows measure (each window's fit predicting the other).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.config import EngineFlags
from runtime.records import RequestRecord, ttft_by_request
from runtime.router import make_policy
from sim.cost.api_server import ApiServerCost
from sim.engine_args import EngineArgs, SimSetup, build_setup
from sim.fleet import FleetResult, simulate_fleet
from sim.fleet_config import FleetFlags
from sim.serving_stack import (
    MeasuredReplay,
    StackFit,
    StackNotFitted,
    draw_delays,
    drawn_summary,
    fit_on_twins,
    warm_requests,
)
from workloads import Trace

_SERVED = "~served"  # request-id suffix: see served_outputs


def served_outputs(trace: Trace) -> Trace:
    """`trace` as a server replays it: each request generates tokens of its own, not the
    trace's. A multi-turn trace's next prompt holds the earlier turn's output as the stream
    `o:<request id>` (`workloads.tokens`), which the simulator emits as that turn's output, so
    the blocks holding it are prefix-cache hits; a real server (and `rt serve --simulate`)
    generates other tokens and misses them. Renaming each request (id + "~served") renames
    its output stream only: prompts given as segments keep their tokens (others keep unique
    ones), so routing and the prompts' sharing are unchanged."""
    return Trace(tuple(dataclasses.replace(r, request_id=r.request_id + _SERVED)
                       for r in trace), trace.name)


def _router_timing(fleet: FleetFlags, overheads: Mapping[str, Any]) -> tuple[float, float]:
    """(refresh, routing latency) of the simulated router, seconds, from the real router's
    measured overheads: its mean routing latency (0 when none was observed), and, for a
    policy that reads scraped gauges (the real scrape period is the refresh), a refresh of
    twice the mean scrape age its decisions saw (a tick every R gives R / 2 on average)."""
    latency, age, period = (float(overheads.get(k, math.nan)) for k in (
        "routing_latency_mean_s", "scrape_age_mean_s", "scrape_period_s"))
    latency = latency if latency >= 0 else 0.0  # NaN: none observed
    refresh = fleet.router_refresh_ms / 1e3
    if refresh > 0 and math.isclose(period, refresh) and age > 0:
        refresh = 2 * age
    return refresh, latency


def _twin_run(trace: Trace, fleet: FleetFlags, setup: SimSetup, seed: int,
              timing: tuple[float, float], delays: Mapping[str, float] | None = None
              ) -> FleetResult:
    """`trace` through the twin fleet of `setup`s (a fresh policy; `timing`: the router's
    (refresh, routing latency); outputs served; request ids and arrivals as in `trace`).
    With `delays` (seconds by request id, `sim.serving_stack.draw_delays`), each request,
    routed at its arrival, reaches its replica's core that much later: its TTFT includes
    that time, recorded as API-server time."""
    policy = make_policy(fleet.router, fleet.router_arg or [], seed)
    served = served_outputs(trace)
    stack = None if delays is None else {rid + _SERVED: d for rid, d in delays.items()}
    result = simulate_fleet(served, [setup] * fleet.replicas, policy, *timing,
                            stack_delay_s=stack)
    for record in result.requests:
        record.request_id = record.request_id.removesuffix(_SERVED)
    return result


def _with_api_server(setup: SimSetup, api: ApiServerCost) -> SimSetup:
    return dataclasses.replace(setup, config=dataclasses.replace(setup.config, api_server=api))


def _setup(engine: EngineFlags, model: str, gpu: str, profile: Path | None, seed: int
           ) -> SimSetup:
    return build_setup(EngineArgs(**dataclasses.asdict(engine)), model, gpu,
                       None if profile is None else str(profile), seed)


def stack_free_twin(trace: Trace, fleet: FleetFlags, engine: EngineFlags, model: str, gpu: str,
                    profile: Path | None, seed: int, overheads: Mapping[str, Any]
                    ) -> FleetResult:
    """`fleet_twin`'s fleet with no serving-stack cost (the replicas' API-server cost 0):
    what a calibration replay's TTFTs are compared with to fit that cost."""
    setup = _stack_free(_setup(engine, model, gpu, profile, seed))
    return _twin_run(trace, fleet, setup, seed, _router_timing(fleet, overheads))


def _stack_free(setup: SimSetup) -> SimSetup:
    """`setup` with no serving-stack cost (the replicas' API-server cost 0)."""
    return _with_api_server(setup, ApiServerCost(0.0, 0.0, 0.0))


def _known(overheads: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """`overheads` with each figure not measured (NaN: that replay's router /metrics could
    not be read) taken from `other`, the other replay's through the same fleet."""
    return {k: other.get(k, v) if isinstance(v, float) and math.isnan(v) else v
            for k, v in overheads.items()}


def _fitted_stack(setup: SimSetup, fleet: FleetFlags, seed: int,
                  windows: Sequence[MeasuredReplay], overheads: Mapping[str, Any]
                  ) -> tuple[StackFit | None, dict[str, Any]]:
    """The serving stack fitted on the calibration `windows` pooled, each against its
    stack-free twin (with the router's overheads during it; a figure its router could not
    give, the measured replay's `overheads`), and run.json's description of it, with the
    noise floor the windows measure (`_noise_floor`); (None, why) when too few requests
    finished to fit it."""
    zero = _stack_free(setup)
    timings = [_router_timing(fleet, _known(w.overheads, overheads)) for w in windows]
    bare = [_twin_run(w.trace, fleet, zero, seed, t).requests
            for w, t in zip(windows, timings, strict=True)]
    try:
        fit = fit_on_twins(list(zip(windows, bare, strict=True)), seed)
    except StackNotFitted as err:
        return None, {"fitted": False, "not_fitted": str(err),
                      "api_server": dataclasses.asdict(setup.config.api_server)}
    latency_ms = float(np.mean([t[1] for t in timings])) * 1e3
    twins = [_WindowTwin(w, b, t) for w, b, t in zip(windows, bare, timings, strict=True)]
    return fit, {"fitted": True, **fit.describe(), "applied_as": "a delay per request "
                 "after the routing decision, before the engine (not queued): the line + a "
                 "residual drawn from the spread (seed: the run's)",
                 "calibration_routing_latency_ms": latency_ms,
                 "noise_floor": _noise_floor(zero, fleet, seed, twins)}


@dataclass(frozen=True, slots=True)
class _WindowTwin:
    """A calibration window, its stack-free twin's records and the router timing of both."""

    window: MeasuredReplay
    bare: list[RequestRecord]
    timing: tuple[float, float]


WINDOW_NAMES = ("before", "after")  # the calibration windows, in replay order


def _noise_floor(zero: SimSetup, fleet: FleetFlags, seed: int, twins: Sequence[_WindowTwin]
                 ) -> dict[str, Any]:
    """Real against real: the stack fitted on one calibration window alone,
    its twin predicting the other window's p50/p90 TTFT (`_predicts`), both ways; the
    floor is the larger |error| of the two, per percentile: how far apart the machine was
    from itself around the measured replay, in the units of the comparison's errors; with
    it, the windows' common requests paired (`_paired_drift`).
    Not measured (and why) without two windows or when either is too short to fit."""
    if len(twins) != len(WINDOW_NAMES):
        return {"measured": False, "why": f"{len(twins)} calibration window(s), not 2"}
    fits = []
    for own, name in enumerate(WINDOW_NAMES):  # both fitted first: each predicts the other's
        try:  # fitted requests (10 or more, finished in both the window and its twin)
            fits.append(fit_on_twins([(twins[own].window, twins[own].bare)], seed,
                                     fresh=own == 0))
        except StackNotFitted as err:
            return {"measured": False, "why": f"the {name} window: {err}"}
    errors = [_predicts(zero, fleet, seed, fit, twins[1 - own], own == 1)
              for own, fit in enumerate(fits)]
    windows = [{"window": name, "requests": fit.requests,
                "per_request_ms": fit.stack.per_request_s * 1e3,
                "per_prompt_token_us": fit.stack.per_prompt_token_s * 1e6,
                "gap_p50_ms": fit.gap_p50_s * 1e3, "gap_p90_ms": fit.gap_p90_s * 1e3,
                "predicts_other": error}
               for name, fit, error in zip(WINDOW_NAMES, fits, errors, strict=True)]
    return {"measured": True, "windows": windows,
            **{key: max(abs(e[key]) for e in errors) for key in ("p50_ttft", "p90_ttft")},
            **_paired_drift(twins[0].window, twins[1].window)}


def _paired_drift(before: MeasuredReplay, after: MeasuredReplay) -> dict[str, Any]:
    """The requests both windows replayed (equal `TraceRequest`s; of the first window its
    `warm_requests`) with a TTFT in both: the real TTFT after minus before, each request
    against itself (milliseconds), the machine's drift across the measured replay with the
    requests' own stack times cancelled. Nothing when the windows share no request."""
    again = {r.request_id: r for r in after.trace}
    ids = [r.request_id for r in warm_requests(before) if again.get(r.request_id) == r
           and r.request_id in before.ttft_s and r.request_id in after.ttft_s]
    if not ids:
        return {}
    diff = np.array([after.ttft_s[i] - before.ttft_s[i] for i in ids]) * 1e3
    return {"same_requests": {"requests": len(ids),
                              "after_minus_before_p50_ms": float(np.median(diff)),
                              "slower_after": int((diff > 0).sum())}}


def _predicts(zero: SimSetup, fleet: FleetFlags, seed: int, fit: StackFit,
              other: _WindowTwin, fresh: bool) -> dict[str, float]:
    """(sim - real) / real of p50 and p90 TTFT (linear percentiles) of the `other`
    window's requests (its `warm_requests` when it ran on a `fresh` fleet, as in the fit)
    through the twin with `fit`'s stack, delays drawn from `seed`."""
    trace = other.window.trace
    delays = draw_delays(trace, fit.stack, fit.spread, seed)
    sim = ttft_by_request(_twin_run(trace, fleet, zero, seed, other.timing, delays).requests)
    kept = warm_requests(other.window) if fresh else list(trace)
    ids = [r.request_id for r in kept if r.request_id in sim and r.request_id in
           other.window.ttft_s]
    real_q = np.percentile([other.window.ttft_s[i] for i in ids], [50, 90])
    sim_q = np.percentile([sim[i] for i in ids], [50, 90])
    return {f"p{p}_ttft": float((s - r) / r)
            for p, s, r in zip((50, 90), sim_q, real_q, strict=True)}


def fleet_twin(trace: Trace, fleet: FleetFlags, engine: EngineFlags, model: str, gpu: str,
               profile: Path | None, seed: int, overheads: Mapping[str, Any],
               calibration: Sequence[MeasuredReplay] = ()
               ) -> tuple[FleetResult, dict[str, Any]]:
    """`trace` through `fleet.replicas` replicas of `rt serve --simulate --sim-model MODEL
    --gpu GPU [--profile P] --seed SEED` with `engine`'s flags (no step-time noise: the
    live executor has none), behind `fleet.router` (its arguments and seed), with the real
    router's measured overheads (`backends.route.overheads.RouterOverheads` as a mapping;
    `_router_timing`; a figure one replay's router could not give, the other replay's), so
    the simulated signals are as stale as the real ones. The replicas generate outputs of
    their own (`served_outputs`), as the real ones do. With `calibration` (windows of other
    requests replayed through the same real fleet, in replay order: before and after the
    measured replay), the serving stack's own time (`sim.serving_stack`) is fitted on them
    pooled against their twins without that time (and each window's fit predicts the
    other: the noise floor), and each request, routed at its arrival, reaches its replica's
    engine that time later (the fitted line plus a residual drawn from the fit's spread
    with `seed`; the replicas' API-server cost 0, as in the fit); without (or too few
    requests to fit), the setup's API-server cost (the profile's, or the default
    assumption). Returns the result (request ids as in `trace`) and run.json's description
    (its "fleet" section with the refresh,
    latency and serving stack used)."""
    setup = _setup(engine, model, gpu, profile, seed)
    stack: dict[str, Any] = {"fitted": False, "api_server": dataclasses.asdict(
        setup.config.api_server)}
    fit = None
    if calibration:  # either replay's router figures stand in for the other's
        fit, stack = _fitted_stack(setup, fleet, seed, calibration, overheads)
        for window in calibration:
            overheads = _known(overheads, window.overheads)
    timing = _router_timing(fleet, overheads)
    delays = None
    if fit is not None:
        setup = _stack_free(setup)
        delays = draw_delays(trace, fit.stack, fit.spread, seed)
        stack["drawn"] = drawn_summary(delays)
    result = _twin_run(trace, fleet, setup, seed, timing, delays)
    fleet_info = {**fleet.describe(None), "routing_latency_ms": timing[1] * 1e3,
                  "router_refresh_ms": timing[0] * 1e3,
                  "router_refresh_ms_flag": fleet.router_refresh_ms,
                  "outputs": "served (not the trace's)", "serving_stack": stack}
    return result, {**setup.describe(), "fleet": fleet_info}
