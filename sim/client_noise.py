"""The step-time noise of a client-timed fit (`sim.client_calibrate`'s stage 1 residuals):
disturbed periods screened out, then a scatter on every step plus rare additive stalls.

A fitted profile is the twin of the server in its usual state. Two things in the observed
step durations are not that state's scatter, and a table of ratios fitted around the mean
reproduces both badly (on a quiet machine against vLLM, in sample: p50 ITL +8%, p90 ITL -16%):

* *Disturbed periods.* For a second or more something else takes the machine and every step
  is slow (a calibration replay against vLLM had 3 s at 1.6-2.4x the usual step time, 20-28%
  of its steps stalled, where its other 10 s and the real replays around it ran at 0.8-1.45x
  per second).
  `disturbed_windows` splits each run into `WINDOW_S` windows, takes each window's median
  ratio observed / predicted, and flags the windows slower than the runs' typical window by
  more than `SIGMAS` robust standard deviations of the windows' log medians and by at least
  `MIN_SLOWDOWN`; their steps and the requests running then are left out of the fit and
  reported. When more than `MAX_DISTURBED` of the windows would be flagged, slowness is the
  machine's usual state and nothing is left out.
* *Stalls.* The machine takes the CPU from the server for a few milliseconds now and then:
  an additive delay, the same on a 1.7 ms decode step as on an 8 ms prefill. As a factor on
  whole steps a stall either is clipped away (then the table is scaled up to keep the busy
  time: every step a little slower, the median too high and the tail too low) or, drawn
  onto a prefill step, multiplies it several times.

`step_scatter` therefore splits stage 1's timed steps (after the trim at 4 robust σ) into
the body, the steps the trim kept, whose ratios observed / predicted give the scatter table
(no clip: the trim already dropped the outliers), and the stalls, the steps the trim left
out on the slow side that are also `STALL_RATIO` times their prediction or more after what
the next step gives back (`_given_back`: then it was a late read, not a stall): the stall
probability is their share, and their excess seconds give the stall table. The body's
table is then scaled so that the busy time is unbiased: predicted · E[Q] plus the stalls'
seconds equals the observed busy span. Identified from the residuals: the
probability (a count), the stall sizes' distribution (with 2 or more stalls) and the body's
quantiles; with no stall the profile has none.

*Late reads stay in the body, as pairs, their short halves floored.* A chunk delivered or
read late (the server's output path or the client: a client cannot tell which) lands beside
its stream's next chunk: the client sees one ITL gap of about two steps and one of ~0.1 ms,
and the cluster of that step splits into a long and a short duration (`late_pairs`: a step
followed by one under `CLUSTER_FRACTION` of the median). The twin predicts the client's
times, so such pairs are scatter: 3.6-4.5% of a vLLM replay's timed steps (3.2-4.0% of its
client ITL gaps under 0.3x the median), 14-16% of the steps above the observed p90. Left out
(before 2026-12-02), the in-sample p90 ITL was 5-7.5% low against vLLM in all six quiet-slot
runs (docs/calibration.md, "p90 ITL against vLLM"). The trim decides per pair, by its long
half: both halves in the body or neither (a pair whose long step is left out and given back
is no stall, only in the busy span). The table multiplies every step, prefill steps too, so
a short step's ratio (a short half's 0.01-0.2x: the client's bunching, not the engine's
speed) is raised to the smallest ratio of a step that is not short (`bounded_ratios`); the
long halves stay (up to ~2.3x: an 8 ms prefill drawn there takes ~18 ms, where a late read
adds one decode step's time, ~2 ms). Modelling the pair as an additive delay given back by
the next step (as a stall is added) would remove that too; not done (review 17, finding 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sim.client_steps import CLUSTER_FRACTION
from sim.step_noise import ratio_quantiles

WINDOW_S = 1.0  # disturbance windows, seconds of a run's clock
MIN_WINDOW_STEPS = 20  # windows with fewer timed steps are not judged
SIGMAS = 4.0  # a window this many robust σ slower than the typical one is disturbed ...
MIN_SLOWDOWN = 1.5  # ... and at least this many times slower (σ is ~0 on a quiet server)
MAX_DISTURBED = 0.25  # more flagged windows than this share: slowness is the usual state
STALL_RATIO = 1.5  # a trimmed slow step is a stall when observed >= this x predicted
TABLE_POINTS = 101


@dataclass(frozen=True, slots=True)
class Disturbance:
    """One disturbed window: the run's index, its start and end (seconds of the run's
    clock) and its median observed / predicted step time relative to the typical window."""

    run: int
    start_s: float
    end_s: float
    slowdown: float


def disturbed_windows(run: np.ndarray, end_s: np.ndarray, observed_s: np.ndarray,
                      predicted_s: np.ndarray) -> tuple[np.ndarray, list[Disturbance]]:
    """The timed steps in disturbed windows (a mask over the rows) and the windows (module
    docstring). `run`: each row's run index; `end_s`: its end on that run's clock."""
    ratio = observed_s / np.maximum(predicted_s, 1e-12)
    window = np.floor(end_s / WINDOW_S).astype(np.int64)
    keys, of_row = np.unique(np.stack([run, window], axis=1), axis=0, return_inverse=True)
    of_row = of_row.reshape(-1)
    counts = np.bincount(of_row, minlength=len(keys))
    judged = np.flatnonzero(counts >= MIN_WINDOW_STEPS)
    none: tuple[np.ndarray, list[Disturbance]] = (np.zeros(len(ratio), dtype=bool), [])
    if len(judged) < 4:
        return none
    medians = np.log([float(np.median(ratio[of_row == k])) for k in judged])
    centre = float(np.median(medians))
    sigma = 1.4826 * float(np.median(np.abs(medians - centre)))
    excess = medians - centre
    flagged = excess > max(SIGMAS * sigma, math.log(MIN_SLOWDOWN))
    if not flagged.any() or flagged.sum() > MAX_DISTURBED * len(judged):
        return none
    windows = [Disturbance(int(keys[k][0]), float(keys[k][1]) * WINDOW_S,
                           float(keys[k][1] + 1) * WINDOW_S, float(math.exp(e)))
               for k, e in zip(judged[flagged], excess[flagged], strict=True)]
    return np.isin(of_row, judged[flagged]), windows


@dataclass(frozen=True, slots=True)
class StepScatter:
    """`step_scatter`'s result: the body's quantile table (mean: the busy-time scale), the
    stall probability and the stalls' quantile table in seconds (None: no stall observed)."""

    quantiles: tuple[float, ...]
    stall_probability: float
    stall_quantiles_s: tuple[float, ...] | None
    steps: int = 0  # body steps and stalls the probability was counted over

    def describe(self) -> dict[str, float | int | None]:
        """JSON-ready summary for the profile's fit section."""
        q = self.quantiles
        stalls = self.stall_quantiles_s
        return {"scatter_p10": q[len(q) // 10], "scatter_p50": q[len(q) // 2],
                "scatter_p90": q[-1 - len(q) // 10],
                "stall_probability": self.stall_probability, "stall_steps": self.steps,
                "stall_p50_ms": stalls[len(stalls) // 2] * 1e3 if stalls else None,
                "stall_p90_ms": stalls[-1 - len(stalls) // 10] * 1e3 if stalls else None}


def noise_lines(scatter: StepScatter | None, disturbed: Sequence[Disturbance]) -> list[str]:
    """The scatter, the stalls and the disturbed windows left out, in words."""
    out = []
    if scatter is not None:
        d = scatter.describe()
        out.append(f"  step scatter (x fitted time): p10/p50/p90 {d['scatter_p10']:.3f}/"
                   f"{d['scatter_p50']:.3f}/{d['scatter_p90']:.3f}")
        p, n = scatter.stall_probability, max(scatter.steps, 1)
        out.append(f"  stalls: {p:.2%} ± {math.sqrt(p * (1 - p) / n):.2%} of {n} steps, + p50/p90 "
                   f"{d['stall_p50_ms']:.2f}/{d['stall_p90_ms']:.2f} ms"
                   if d["stall_p50_ms"] is not None else "  stalls: none observed")
    for w in disturbed:
        out.append(f"  left out (disturbed): run {w.run + 1} {w.start_s:.0f}-{w.end_s:.0f} s, "
                   f"steps {w.slowdown:.2f}x the usual")
    return out


def _given_back(residual: np.ndarray, follows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each step's excess seconds less what the next step gives back, and that part: a
    chunk read late lengthens one observed duration and shortens the next by as much (the
    engine did not stop), where an engine stall delays every later step and the next
    duration is as usual. Against a loaded loopback server 37% of the slow steps were
    followed by a step short by half their excess or more, against vLLM on a quiet
    machine 6%."""
    following = np.append(np.where(follows[1:], residual[1:], 0.0), 0.0)
    given_back = np.clip(-following, 0.0, np.maximum(residual, 0.0))
    return residual - given_back, given_back


def late_pairs(short: np.ndarray, follows: np.ndarray) -> np.ndarray:
    """The long halves of late-read pairs (a mask): steps followed by their next step, a
    `short` one (under `CLUSTER_FRACTION` of the median duration: a chunk read late beside
    its stream's next one); the short half is the row after."""
    return np.append(short[1:] & follows[1:], False)


def step_scatter(y: np.ndarray, predicted: np.ndarray, follows: np.ndarray, keep: np.ndarray
                 ) -> StepScatter | None:
    """The body's scatter and the stalls (module docstring) of the timed steps: observed
    durations `y`, their predictions, whether the row before is the step just before, and
    the steps stage 1's trim kept. A late read's pair (a long duration and a short one) is
    decided as one: both halves are scatter when the trim keeps the long one, else neither
    is (only in the busy span). In the table a short step's ratio is raised to the floor
    of the steps that are not short (`bounded_ratios`). None with fewer than 2 body steps."""
    short = y < CLUSTER_FRACTION * float(np.median(y))
    long_half = late_pairs(short, follows)
    short_half = np.append(False, long_half[:-1])
    keep = np.where(short_half, np.append(False, keep[:-1]), keep)
    excess, given_back = _given_back(y - predicted, follows)
    slow = ~keep & (y >= STALL_RATIO * predicted)
    stall = slow & (excess >= (STALL_RATIO - 1.0) * predicted)
    body = keep & ~np.append(False, (slow & (given_back > 0))[:-1])
    if body.sum() < 2:
        return None
    seconds = excess[stall]
    ratios = bounded_ratios(y[body] / np.maximum(predicted[body], 1e-12), short[body])
    table = np.asarray(ratio_quantiles(ratios, np.ones(len(ratios)), TABLE_POINTS, trim=0.0))
    if float(seconds.sum()) >= float(y.sum()):  # degenerate: keep the busy span, no stalls
        seconds = seconds[:0]
    scale = float(y.sum() - seconds.sum()) / float(predicted.sum())
    stalls = (tuple(float(v) for v in np.quantile(seconds, np.linspace(0, 1, TABLE_POINTS)))
              if len(seconds) else None)
    probability = float(len(seconds) / (body.sum() + len(seconds))) if stalls else 0.0
    return StepScatter(tuple(float(v) for v in scale * table), probability, stalls,
                       int(body.sum() + len(seconds)))


def bounded_ratios(ratios: np.ndarray, short: np.ndarray) -> np.ndarray:
    """The body's ratios observed / predicted, each short step's (under `CLUSTER_FRACTION`
    of the median duration: a late pair's short half, or a chunk bunched otherwise) raised
    to the smallest ratio of a step that is not short. A short duration is the client's
    bunching, not the engine's speed (it did not run that step in 0.1 ms), and the table
    multiplies every step: drawn onto an 8 ms prefill a 0.01x factor made it 0.08 ms. The
    floor is the fastest the engine was seen to run a step; the long halves stay (they carry
    the p90 ITL). Unchanged when every step or none is short."""
    if short.all() or not short.any():
        return ratios
    return np.where(short, np.maximum(ratios, float(ratios[~short].min())), ratios)
