"""rt fidelity's simulated side and the flags of calibration and fidelity.

`twin_simulations` runs a real replay's trace in the simulator with the real engine's resolved
scheduler and KV pool (its twin), K times with step-noise seeds seed, seed + 1, ...
`fleet_twin` simulates the fleet `rt fidelity --fleet` runs for real: N replicas of the engine
`rt serve --simulate` runs (same flags, model, GPU, profile and seed) behind the same router
policy, refresh interval and the router's measured routing latency, with the serving stack's
own time fitted on a calibration replay (`sim.serving_stack`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime import CacheConfig, SchedulerConfig
from runtime.config import EngineFlags
from runtime.flags import flag
from runtime.records import RequestRecord, RunResult, ttft_by_request
from runtime.router import make_policy
from sim.cost.api_server import ApiServerCost
from sim.endpoint_warmup import WARMUP_REQUESTS
from sim.engine_args import (
    EngineArgs,
    SimSetup,
    args_from_configs,
    build_setup,
    with_noise_seed,
)
from sim.fleet import FleetResult, simulate_fleet
from sim.fleet_config import FleetFlags
from sim.profile import load_profile
from sim.serving_stack import (
    MeasuredReplay,
    StackFit,
    StackNotFitted,
    draw_delays,
    drawn_summary,
    fit_on_twins,
    warm_requests,
)
from sim.simulator import simulate
from workloads import Trace

CALIBRATION_PANEL = "Calibration"


@dataclass(frozen=True, slots=True)
class CalibrationFlags:
    """How a profile is fitted (`rt calibrate`, and `rt fidelity` when it calibrates)."""

    quick: bool = flag(False, "--quick", "A small grid with few repeats (seconds; for tests).",
                       CALIBRATION_PANEL)
    time_limit: float | None = flag(None, "--time-limit", "Seconds of grid at most (default: "
                                    "300; --quick 30).", CALIBRATION_PANEL)
    step_drift: bool = flag(
        False, "--step-drift", "Fit the step-time scatter as a per-step factor times a slow "
        "drift per 0.25 s window (the machine's slow and fast periods) instead of i.i.d. per "
        "step. Off by default: on this project's CPU VM it did not beat i.i.d. scatter "
        "(docs/results.md).", CALIBRATION_PANEL)


# `rt fidelity --help`'s description of the command, beside its flags.
FIDELITY_HELP = """\
Replay TRACE on the real backend and simulate it with the profile under the same
engine flags and KV pool (blocks), then report the simulator's error: per metric (mean,
p50, p90, p99 of TTFT, ITL, TPOT, E2E; throughput), per step, per request (TTFT).

Without --profile it calibrates first, by default on replays of other requests like
TRACE's; with --repeats N it replays N times and reports against their mean, with the
real runs' own spread as the noise floor. With --endpoint, all of it against that
server, fitted on its client-side timings (the engine flags: the server's).
"""


@dataclass(frozen=True, slots=True)
class FidelityFlags:
    """`rt fidelity`'s procedure: which profile, how many real and simulated runs, the gate."""

    profile: Path | None = flag(None, "--profile", "Profile JSON (default: calibrate first, "
                                "on the same engine).")
    max_error: float | None = flag(None, "--max-error", "Exit 1 when |error| of p50/p90 TTFT "
                                   "or ITL exceeds this fraction (0.05 = 5%).")
    fit_on_replay: bool = flag(
        False, "--fit-on-replay", "No grid: fit the profile on the replay's own steps "
        "(in-sample; separates the simulator's structural error from calibration drift).",
        CALIBRATION_PANEL)
    calibrate_on: str = flag(
        "replay", "--calibrate-on", "Without --profile: 'grid' (the designed grid of batches) "
        "or 'replay' (a separate calibration replay of a trace resampled from TRACE: other "
        "requests and arrivals, the same lengths and mean rate; out of sample).",
        CALIBRATION_PANEL)
    repeats: int = flag(
        1, "--repeats", "Real replays of TRACE (with --calibrate-on replay, as many "
        "calibration replays, interleaved with them in the order C R R C C R ... so a linear "
        "drift of the machine's speed falls on both alike). With 2 or more, 'real' is their "
        "mean and 'noise' the largest deviation of one of them from it: how far this machine "
        "is from itself.")
    sim_runs: int = flag(
        8, "--sim-runs", "Simulations of TRACE, step-time noise drawn from seeds SEED, SEED+1, "
        "...; 'sim' is their mean (as 'real' is of the real runs). One run when simulated "
        "steps are deterministic (--no-step-noise).", CALIBRATION_PANEL)
    warmup_requests: int = flag(
        WARMUP_REQUESTS, "--warmup-requests", "With --endpoint: replay at most this many "
        "requests like TRACE's before any measured replay (0: none), in 5 windows of at least "
        "10, stopping after a window whose client ITL median is within 5% of the window "
        "before (the server is steady): a fresh server's first requests are slow.",
        CALIBRATION_PANEL)
    fleet: bool = flag(
        False, "--fleet", "Fidelity of a fleet instead: --replicas `rt serve --simulate` "
        "processes (model: --model, default llama-3.1-8b; --gpu, --profile, the engine flags) "
        "behind `rt route --router` on loopback, TRACE replayed through the router between "
        "two calibration windows (the same other requests, half as many, resampled from "
        "TRACE, before and again after, other prompt tokens each time), against `rt simulate "
        "--replicas` with the same policy, refresh, the router's measured routing latency "
        "and the serving stack's own time fitted on both windows; per-replica share, prefix "
        "hit rate, TTFT/ITL, errors, router overheads, the serving stack and a noise floor "
        "(each window's fit predicting the other) side by side (calibration/, real/, "
        "calibration-after/, sim/, fleet_fidelity.json).")

    def calibration_replays(self) -> bool:
        """Whether calibration replays (of traces resampled from TRACE) go with the real
        ones: no --profile, no --fit-on-replay, --calibrate-on replay."""
        return self.profile is None and not self.fit_on_replay and self.calibrate_on == "replay"

    def check(self, step_drift: bool, step_noise: bool, endpoint: bool) -> None:
        """ValueError for impossible combinations (before any model is loaded); `endpoint`:
        against an `--endpoint`."""
        if self.calibrate_on not in ("grid", "replay"):
            raise ValueError(f"--calibrate-on must be grid or replay, got {self.calibrate_on!r}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if self.sim_runs < 1:
            raise ValueError(f"--sim-runs must be >= 1, got {self.sim_runs}")
        if self.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {self.warmup_requests}")
        if self.warmup_requests != WARMUP_REQUESTS and not endpoint:
            raise ValueError(f"--warmup-requests {self.warmup_requests} needs --endpoint (the "
                             "real engine and --fleet replay without a warm-up)")
        unused = [name for name, given in (("--repeats", self.repeats != 1),
                                           ("--fit-on-replay", self.fit_on_replay),
                                           ("--max-error", self.max_error is not None))
                  if given]
        if self.fleet and unused:
            raise ValueError(f"--fleet does not take {unused[0]} (one real run against one "
                             "deterministic simulation)")
        fitted_on_replays = self.profile is None and (self.calibrate_on == "replay"
                                                      or self.fit_on_replay)
        if step_drift and not fitted_on_replays:
            raise ValueError("--step-drift needs a profile fitted here on replays "
                             "(--calibrate-on replay or --fit-on-replay, no --profile)")
        if step_drift and not step_noise:
            raise ValueError("--step-drift with --no-step-noise: the drift would be fitted "
                             "and not used")


@dataclass(frozen=True, slots=True)
class TwinRun:
    """One simulation of the twin: its name (sim, sim-2, ...), result and step-noise seed."""

    name: str
    result: RunResult
    noise_seed: int | None


def twin_simulations(trace: Trace, scheduler: SchedulerConfig, cache: CacheConfig,
                     model: str, profile: Path, seed: int, step_noise: bool, runs: int
                     ) -> tuple[SimSetup, list[TwinRun], list[str]]:
    """`runs` simulations of `trace` under exactly the real engine's configs (step-noise
    seeds seed, seed + 1, ...; token ids keep the replay's seed; one run when the steps are
    deterministic). Returns the setup, the runs and notes for the user (a profile without
    step-time scatter turns the noise off)."""
    notes = []
    if step_noise and load_profile(profile).step_time_quantiles is None:
        notes.append(f"{profile} has no step-time scatter: simulated steps take exactly the "
                     "fitted time")
        step_noise = False
    setup = build_setup(args_from_configs(scheduler, cache), model, "h200", str(profile), seed,
                        step_noise=step_noise)
    twins = [TwinRun(f"sim-{i + 1}" if i else "sim",
                     simulate(trace, with_noise_seed(setup.config, seed + i), setup.cost_model),
                     seed + i if step_noise else None)
             for i in range(runs if step_noise else 1)]
    return setup, twins, notes


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
    windows = [{"window": name, "requests": fit.requests,
                "per_request_ms": fit.stack.per_request_s * 1e3,
                "per_prompt_token_us": fit.stack.per_prompt_token_s * 1e6,
                "gap_p50_ms": fit.gap_p50_s * 1e3, "gap_p90_ms": fit.gap_p90_s * 1e3,
                "predicts_other": _predicts(zero, fleet, seed, fit, twins[1 - own], own == 1)}
               for own, (name, fit) in enumerate(zip(WINDOW_NAMES, fits, strict=True))]
    errors = [w["predicts_other"] for w in windows]
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
