"""Step-time noise: real steps of equal features do not take equal times.

A cost model predicts a step's mean time. Real steps scatter around it (on the CPU backend
the measured/predicted ratio has a coefficient of variation of 0.25-0.30), and the scatter
is not neutral for latency: a request that arrives during a step waits for the rest of it,
and it is more likely to arrive during a long step than a short one (the inspection
paradox), so the mean wait for the step boundary is E[S]·(1 + CV²)/2, not E[S]/2. A
simulator with deterministic steps therefore underestimates the tails of TTFT.

The scatter is not i.i.d. either: on a shared machine (noisy neighbours: other VMs on the
host, shared caches, frequency) there are slow and fast periods of ~0.1-0.5 s. On this
machine's real replays, log(measured/predicted) has a lag-1 autocorrelation of 0.7, lag-10
0.4, lag-100 ~0.1, so slow steps come in runs, and runs of slow steps delay more tokens
than the same slow steps spread out. A profile may therefore carry a drift table too
(`rt calibrate --from-steps ... --step-drift`), and the factor is then a product of two
independent parts:

    factor(k, t) = Q(u_k) · D(v_w),   w = floor(t / drift_window_s)

Q is the empirical quantile function of the fast (within-window) ratios and D that of the
windows' speed factors (`fit_step_noise`), normalised so busy time is unbiased: Q to
mean 1 (it multiplies steps), D to harmonic mean 1 (it stretches windows of fixed length:
a window with factor D does 1/D of its predicted work, so the work done per second is
E[1/D], which must be 1; scaling D to arithmetic mean 1 instead ran the simulator 3-8%
fast, found in review); u_k in [0, 1) is a hash of (seed, step index k) and v_w in [0, 1) a hash of
(seed, window w) on an independent stream, where t is the step's start (seconds). Without
a drift table the factor is Q(u_k). Because the factor is a function of the step's index
and start, not of a random stream, stepping one by one and fast-forwarding a run of
decode steps give the same durations.

Stalls (optional, `rt calibrate --from-run`): besides the scatter a step may stall, an
additive delay independent of its size (the OS deschedules the server; a 5 ms stall hits a
1.7 ms decode step as it does an 8 ms prefill), drawn with probability `stall_probability`
from the quantile table `stall_quantiles_s` (seconds) on a third independent stream:

    duration(k, t) = predicted · factor(k, t) + [w_k < p] · S(w_k / p)

Measured (README, "Calibration and fidelity"): over six 8-run sets on this project's CPU VM
the drift did not beat i.i.d. scatter (mean |error| of p50/p90 TTFT and ITL 3.3% vs 1.6%
in-sample), so profiles are fitted without it unless asked.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_MASK = (1 << 64) - 1
_SEED_MULTIPLIER = 0x100000001B3  # spreads the seed over the 64-bit key (FNV-1a's prime)
_DRIFT_SALT = 0xD6E8FEB86659FD93  # separates the window stream v from the step stream u
_STALL_SALT = 0x8CB92BA72F3D8DD7  # separates the stall stream w from u and v
MIN_DRIFT_WINDOW_S = 1e-6  # drift windows shorter than a microsecond are a malformed profile

# Seconds, one entry per step: a list or a 1-D float array.
StepSeconds = Sequence[float] | np.ndarray
# One run's steps for `fit_step_noise`: (start_s, measured_s, predicted_s), equal lengths.
RunSteps = tuple[StepSeconds, StepSeconds, StepSeconds]


def _splitmix64(x: int) -> int:
    """A 64-bit mixing function (SplitMix64's finaliser): well-spread outputs for
    consecutive inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=64)
def _stream_key(seed: int, salt: int) -> int:
    """The key of seed `seed`'s stream salted with `salt` (drift, stalls): computed once per
    seed, not once per draw."""
    return _splitmix64((seed * _SEED_MULTIPLIER) ^ salt)


def _interpolate(table: tuple[float, ...], u: float) -> float:
    """The quantile function tabulated at evenly spaced probabilities 0..1, at u in [0, 1):
    linear between neighbouring entries."""
    x = u * (len(table) - 1)
    lo = int(x)
    return table[lo] + (table[lo + 1] - table[lo]) * (x - lo) if lo + 1 < len(table) \
        else table[-1]


def _check_table(name: str, table: tuple[float, ...], zero_ok: bool = False) -> None:
    """ValueError naming `name` unless `table` is >= 2 finite non-decreasing values, each
    > 0 (>= 0 with `zero_ok`)."""
    if len(table) < 2:
        raise ValueError(f"{name} needs >= 2 values, got {len(table)}")
    if not all(math.isfinite(v) and (v > 0 or zero_ok and v == 0) for v in table):
        raise ValueError(f"{name} must be finite and {'>=' if zero_ok else '>'} 0")
    if any(b < a for a, b in zip(table, table[1:], strict=False)):
        raise ValueError(f"{name} must be non-decreasing")


def check_stalls(probability: float, table: tuple[float, ...] | None, owner: str) -> None:
    """A probability in [0, 1] and, when it is > 0, a stall table: >= 2 finite values >= 0,
    non-decreasing (seconds)."""
    if not (isinstance(probability, int | float) and 0.0 <= probability <= 1.0):
        raise ValueError(f"{owner}.stall_probability must be in [0, 1], got {probability!r}")
    if probability > 0 and table is None:
        raise ValueError(f"{owner}.stall_probability > 0 needs stall_quantiles_s")
    if table is not None:
        _check_table(f"{owner}.stall_quantiles_s", table, zero_ok=True)


def _check_drift(drift_quantiles: tuple[float, ...] | None, drift_window_s: float | None,
                 owner: str) -> None:
    """Both drift fields set (a valid table, a finite window > 0) or both None."""
    if (drift_quantiles is None) != (drift_window_s is None):
        raise ValueError(f"{owner}.drift_quantiles and {owner}.drift_window_s must be set "
                         "together (both or neither)")
    if drift_quantiles is not None and drift_window_s is not None:
        _check_table(f"{owner}.drift_quantiles", drift_quantiles)
        if not (math.isfinite(drift_window_s) and drift_window_s >= MIN_DRIFT_WINDOW_S):
            raise ValueError(f"{owner}.drift_window_s must be finite and >= "
                             f"{MIN_DRIFT_WINDOW_S:g} s, got {drift_window_s}")


def _quantile_table(ratios: np.ndarray, points: int, trim: float,
                    harmonic: bool = False) -> tuple[float, ...]:
    """Q at probabilities 0, 1/(points-1), ..., 1 of `ratios` (>= 2 values), each clipped to
    [its `trim` quantile, its 1 - `trim` quantile], then scaled so that the mean is 1 (with
    `harmonic`, the harmonic mean: E[1/Q] = 1)."""
    clipped = np.clip(ratios, *np.quantile(ratios, [trim, 1 - trim]))
    scale = 1.0 / np.mean(1.0 / clipped) if harmonic else clipped.mean()
    table = np.quantile(clipped, np.linspace(0.0, 1.0, points)) / scale
    return tuple(float(q) for q in table)


def _check_table_args(points: int, trim: float) -> None:
    if points < 2 or not 0 <= trim < 0.5:
        raise ValueError(f"need points >= 2 and 0 <= trim < 0.5, got {points}, {trim}")


def ratio_quantiles(measured_s: StepSeconds, predicted_s: StepSeconds, points: int = 101,
                    trim: float = 0.01) -> tuple[float, ...]:
    """Q at probabilities 0, 1/(points-1), ..., 1 of measured/predicted over the steps with
    both times > 0, each ratio clipped to [its `trim` quantile, its 1 - `trim` quantile],
    then scaled so that the mean ratio is 1. The clip keeps the scatter and drops the rare
    machine stalls (a 20x step once in 1,500 on this VM), which, drawn i.i.d. into random
    steps, made the simulated p90 TTFT swing by +-50% from seed to seed. ValueError with
    fewer than 2 such steps."""
    measured = np.asarray(measured_s, dtype=np.float64)
    predicted = np.asarray(predicted_s, dtype=np.float64)
    if measured.shape != predicted.shape:
        raise ValueError(f"{measured.size} measured step times but {predicted.size} predicted")
    timed = (measured > 0) & (predicted > 0)
    if timed.sum() < 2:
        raise ValueError(f"step-time noise needs 2 or more timed steps, got {timed.sum()}")
    _check_table_args(points, trim)
    return _quantile_table(measured[timed] / predicted[timed], points, trim)


@dataclass(frozen=True, slots=True)
class StepNoise:
    """Attributes:
        quantiles: Q at evenly spaced probabilities from 0 to 1 (>= 2 values, positive,
            non-decreasing); the per-step (fast) factor's distribution.
        seed: the run's seed.
        drift_quantiles: D, the same kind of table for the slow factor shared by all steps
            that start in one time window; None: no drift (the factor is Q alone).
        drift_window_s: the drift windows' length, seconds (> 0); set with
            `drift_quantiles`, both or neither.
        stall_probability: the chance that a step stalls, in [0, 1] (0: never).
        stall_quantiles_s: the stall's quantile function (seconds, >= 0, evenly spaced
            probabilities 0..1), added to a stalling step's time; needed when
            `stall_probability` > 0.
    """

    quantiles: tuple[float, ...]
    seed: int = 0
    drift_quantiles: tuple[float, ...] | None = None
    drift_window_s: float | None = None
    stall_probability: float = 0.0
    stall_quantiles_s: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        _check_table("StepNoise.quantiles", self.quantiles)
        _check_drift(self.drift_quantiles, self.drift_window_s, "StepNoise")
        check_stalls(self.stall_probability, self.stall_quantiles_s, "StepNoise")

    def uniform(self, step: int) -> float:
        """u in [0, 1) for step index `step`, a pure function of (seed, step)."""
        return _splitmix64((self.seed * _SEED_MULTIPLIER) ^ step) / 2.0**64

    def drift_uniform(self, window: int) -> float:
        """v in [0, 1) for drift window number `window`, a pure function of (seed, window)
        on a stream independent of `uniform`'s (the seed's key is salted and mixed)."""
        return _splitmix64(_stream_key(self.seed, _DRIFT_SALT) ^ (window & _MASK)) / 2.0**64

    def window(self, start_s: float) -> int:
        """The drift window a step starting at `start_s` (seconds) falls in:
        floor(start_s / drift_window_s). ValueError without drift."""
        if self.drift_window_s is None:
            raise ValueError("StepNoise.window: this StepNoise has no drift")
        return math.floor(start_s / self.drift_window_s)

    def drift(self, start_s: float) -> float:
        """D(v(window)): the slow factor of a step starting at `start_s` (seconds); 1.0
        without drift."""
        if self.drift_quantiles is None:
            return 1.0
        return _interpolate(self.drift_quantiles, self.drift_uniform(self.window(start_s)))

    def factor(self, step: int, start_s: float) -> float:
        """Q(u(step)) · D(v(window of start_s)): the multiplier of the predicted time of step
        `step`, which starts at `start_s` seconds; Q(u(step)) alone without drift."""
        fast = _interpolate(self.quantiles, self.uniform(step))
        return fast if self.drift_quantiles is None else fast * self.drift(start_s)

    def stall(self, step: int) -> float:
        """Seconds step `step` stalls: S(w / p) when w < p, else 0; w in [0, 1) a pure
        function of (seed, step) on a stream independent of `uniform`'s and the drift's."""
        if self.stall_probability <= 0 or self.stall_quantiles_s is None:
            return 0.0
        w = _splitmix64(_stream_key(self.seed, _STALL_SALT) ^ (step & _MASK)) / 2.0**64
        if w >= self.stall_probability:
            return 0.0
        return _interpolate(self.stall_quantiles_s, w / self.stall_probability)

    def duration(self, predicted_s: float, step: int, start_s: float) -> float:
        """The noisy time of step `step` (starting at `start_s`) predicted to take
        `predicted_s` seconds: predicted · factor + stall (module docstring); an empty step
        (predicted 0) stays 0."""
        if predicted_s <= 0:
            return predicted_s
        return predicted_s * self.factor(step, start_s) + self.stall(step)


@dataclass(frozen=True, slots=True)
class StepNoiseFit:
    """What `fit_step_noise` measured: the tables of a `StepNoise`.

    Attributes:
        quantiles: the fast (within-window) factor's quantile table, mean 1; without drift,
            that of the raw measured/predicted ratios (`ratio_quantiles`).
        drift_quantiles: the windows' speed factors' quantile table, harmonic mean 1, or
            None.
        drift_window_s: the window length it was fitted with (seconds), or None.
    """

    quantiles: tuple[float, ...]
    drift_quantiles: tuple[float, ...] | None = None
    drift_window_s: float | None = None

    def __post_init__(self) -> None:
        _check_table("StepNoiseFit.quantiles", self.quantiles)
        _check_drift(self.drift_quantiles, self.drift_window_s, "StepNoiseFit")

    def step_noise(self, seed: int = 0) -> StepNoise:
        """A `StepNoise` drawing from these tables with `seed`."""
        return StepNoise(self.quantiles, seed, self.drift_quantiles, self.drift_window_s)


def _run_arrays(run: RunSteps, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One run's (start_s, measured_s, predicted_s) as float arrays of one shape, start
    times finite; ValueError naming the run otherwise."""
    if len(run) != 3:
        raise ValueError(f"run {index}: need (start_s, measured_s, predicted_s), "
                         f"got {len(run)} sequences")
    start, measured, predicted = (np.asarray(a, dtype=np.float64) for a in run)
    if start.ndim != 1 or not start.shape == measured.shape == predicted.shape:
        raise ValueError(f"run {index}: start_s, measured_s and predicted_s must be 1-D of "
                         f"one length, got {start.shape}, {measured.shape}, {predicted.shape}")
    if not np.isfinite(start).all():
        raise ValueError(f"run {index}: start_s must be finite")
    return start, measured, predicted


def _window_split(start: np.ndarray, measured: np.ndarray, predicted: np.ndarray,
                  window_s: float, min_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """One run's (speed factors of its windows with >= `min_steps` timed steps, the fast
    ratios r / D_w of those windows' steps). D_w = Σmeasured / Σpredicted over the window's
    timed steps (both times > 0): its busy time is exactly D_w times the predicted one."""
    timed = (measured > 0) & (predicted > 0)
    measured, predicted = measured[timed], predicted[timed]
    windows = np.floor(start[timed] / window_s)
    _, of_step, counts = np.unique(windows, return_inverse=True, return_counts=True)
    speeds = (np.bincount(of_step, weights=measured, minlength=len(counts))
              / np.bincount(of_step, weights=predicted, minlength=len(counts)))
    kept = counts >= min_steps
    in_kept = kept[of_step]
    fast = measured[in_kept] / predicted[in_kept] / speeds[of_step[in_kept]]
    return speeds[kept], fast


def fit_step_noise(runs: Sequence[RunSteps], window_s: float = 0.25, points: int = 101,
                   trim: float = 0.01, min_steps: int = 8) -> StepNoiseFit:
    """The fast and the drift tables of a `StepNoise` from measured replays.

    `runs`: per replay, (start_s, measured_s, predicted_s), seconds, one entry per step, in
    time order; only steps with both times > 0 count. Each run's steps are grouped into
    windows floor(start_s / `window_s`) (a run's own clock: windows of different runs are
    never merged). A window with >= `min_steps` steps has a speed factor D_w = Σmeasured /
    Σpredicted, and each of its steps a fast ratio (measured/predicted) / D_w; steps of
    smaller windows are left out of both. Drift table: the D_w of all runs; fast table: the
    fast ratios of all runs; both made like `ratio_quantiles`' (`points` probabilities, clipped
    at `trim` / 1 - `trim`), the fast table scaled to mean 1, the drift table to harmonic
    mean 1 (module docstring). Windows with fewer than `min_steps` steps are mostly slow or
    partly idle ones: leaving them out biases the drift table slightly towards fast windows.

    Why: the machine has slow and fast periods of ~0.1-0.5 s (noisy neighbours); measured
    log(measured/predicted) has autocorrelation 0.7 at lag 1, 0.4 at lag 10, ~0.1 at lag
    100, which i.i.d. per-step factors cannot reproduce.

    With fewer than 2 qualifying windows over all runs there is no drift to measure: the fit
    has no drift and `quantiles` = `ratio_quantiles` of all runs' raw ratios. ValueError on
    bad arguments, a malformed run, or fewer than 2 timed steps.
    """
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"fit_step_noise: window_s must be finite and > 0, got {window_s}")
    if min_steps < 1:
        raise ValueError(f"fit_step_noise: min_steps must be >= 1, got {min_steps}")
    _check_table_args(points, trim)
    arrays = [_run_arrays(run, i) for i, run in enumerate(runs)]
    splits = [_window_split(*a, window_s, min_steps) for a in arrays]
    speeds = np.concatenate([s for s, _ in splits]) if splits else np.empty(0)
    if len(speeds) < 2:
        measured = np.concatenate([m for _, m, _ in arrays]) if arrays else np.empty(0)
        predicted = np.concatenate([p for _, _, p in arrays]) if arrays else np.empty(0)
        return StepNoiseFit(ratio_quantiles(measured, predicted, points, trim))
    fast = np.concatenate([f for _, f in splits])
    return StepNoiseFit(_quantile_table(fast, points, trim),
                        _quantile_table(speeds, points, trim, harmonic=True), window_s)
