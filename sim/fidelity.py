"""rt fidelity's simulated side and the flags of calibration and fidelity.

`twin_simulations` runs a real replay's trace in the simulator with the real engine's resolved
scheduler and KV pool (its twin), K times with step-noise seeds seed, seed + 1, ...
`rt fidelity --fleet`'s twin is `sim.fleet_twin`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from runtime import CacheConfig, SchedulerConfig
from runtime.flags import check_bounds, flag
from runtime.records import RunResult
from sim.endpoint_warmup import WARMUP_REQUESTS
from sim.engine_args import SimSetup, args_from_configs, build_setup, with_noise_seed
from sim.profile import load_profile
from sim.simulator import simulate
from workloads import Trace

CALIBRATION_PANEL = "Calibration"
MAX_RUNS = 1000  # --repeats / --sim-runs at most (each real replay takes the trace's span)


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

    def __post_init__(self) -> None:
        if self.time_limit is not None and not 0 < self.time_limit < math.inf:
            raise ValueError(f"--time-limit must be a finite number of seconds > 0, got "
                             f"{self.time_limit}")  # NaN: the grid was never cut


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
        "is from itself.", bounds=(1, MAX_RUNS))
    sim_runs: int = flag(
        8, "--sim-runs", "Simulations of TRACE, step-time noise drawn from seeds SEED, SEED+1, "
        "...; 'sim' is their mean (as 'real' is of the real runs). One run when simulated "
        "steps are deterministic (--no-step-noise).", CALIBRATION_PANEL,
        bounds=(1, MAX_RUNS))
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
        if self.fleet and endpoint:
            raise ValueError("--fleet starts its own rt serve replicas behind rt route: give "
                             "--fleet or --endpoint, not both")
        check_bounds(self)
        if self.max_error is not None and not self.max_error >= 0:  # NaN: no run ever failed
            raise ValueError(f"--max-error must be a fraction >= 0, got {self.max_error}")
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
        if self.profile is not None and str(self.profile) != "calibrated":
            load_profile(self.profile)  # a bad one: once refused after the real replay


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
