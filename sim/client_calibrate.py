"""Calibration from client-side timings (`rt calibrate --from-run`, `rt fidelity --endpoint`):
a profile for a deployment that can be sent traffic but not instrumented.

A client sees, per request, when it sent the POST and when each streamed chunk arrived. The
fit has two stages, each linear given the other:

1. Step costs. `sim.client_steps` reconstructs the engine's steps from the chunk times (all
   streams' chunks cluster at step ends) and each step's batch (decodes from the streams
   that got a chunk, prefills from the first chunks, split by vLLM's token budget). Every
   step the engine ran back to back after the previous one gives a row

       end_m - end_{m-1} = f_m·c + d·(n_m - n_{m-1})

   f_m: the step's features (1, prefill tokens, decode tokens, sequences, prefill attention
   pairs, decode KV tokens), c: the six step coefficients (`ProfileCoefficients`), n_m: the
   tokens step m delivered, d: the front end's output cost per delivered token (a step's
   chunks leave d·n_m after it ends, so consecutive ends differ by the change of that
   delay). Non-negative least squares in seconds, each row weighted by the square root of
   its decodes so each ITL gap counts once; then once more without the steps more than 4
   robust σ off (stalls, bunched reads). Disturbed periods (windows of steps far slower
   than the runs' usual, `sim.client_noise.disturbed_windows`) are judged on that fit and
   left out, with the requests running then, and stage 1 refitted. The residuals give
   the step-time noise (`sim.client_noise.step_scatter`): a scatter table on every step
   and additive stalls with their probability.
2. Front-end input costs a (per request) and b (per prompt token). The run's arrivals are
   simulated (`sim.simulator.simulate`) under the server's engine flags with the step costs
   of stage 1 and their noise (as the twin will be: waiting for a step in progress takes
   E[S](1 + CV²)/2, longer than with exact steps); each request's simulated TTFT is
   a + b·p_r plus what the engine and the queues add, so a, b are refitted on observed
   TTFT - (simulated TTFT - a - b·p_r) (least squares in seconds, non-negative, over the
   requests within 4 robust standard deviations: the mean TTFT is matched; relative
   weights had pulled a to the short requests, p50 TTFT -14% on the loopback truth; each
   run simulated with `FRONT_END_SEEDS` noise seeds, pooled) and again, a few times; the
   iterate whose simulated TTFT p50 and p90 are closest to the observed ones is kept.

ITL and E2E are matched by stage 1 (E2E is TTFT plus the gaps), TTFT by stage 2.
Identification: a term the run does not excite (an all-zero column) or cannot separate from
the terms taken before it (its column within 3% of their span, e.g. per_seq_s when no step
mixes a prefill in, where sequences equal decode tokens; b when every prompt has one length)
is not fitted: it is 0 in the profile and listed in `unidentified` with the reason, instead
of an invented split. The error per term is its standard error in the linear solve
(σ² (AᵀA)⁻¹ over the identified terms), relative to its value.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from runtime import CacheConfig, SchedulerConfig
from sim.calibrate import COEFFICIENT_NAMES, nnls
from sim.client_noise import (
    Disturbance,
    StepScatter,
    disturbed_windows,
    noise_lines,
    step_scatter,
)
from sim.client_steps import ClientRun, ObservedSteps, observed_steps
from sim.cost.api_server import ApiServerCost
from sim.cost.profile_model import ProfileCoefficients, ProfileCostModel
from sim.engine_args import with_noise_seed
from sim.profile import Profile
from sim.simulator import SimConfig, SimResult, simulate
from sim.step_noise import StepNoise

FRONT_END_NAMES = ("per_request_s", "per_prompt_token_s", "per_output_token_s")
TERMS = (*COEFFICIENT_NAMES, *FRONT_END_NAMES)
# Which terms are taken first when two cannot be told apart (the later is left out).
PRIORITY = ("constant_s", "per_decode_token_s", "per_prefill_token_s", "per_decode_kv_token_s",
            "per_request_s", "per_prompt_token_s", "per_output_token_s", "per_seq_s",
            "per_prefill_attention_pair_s")
SEPARABLE = 0.03  # a column whose part outside the kept terms' span is below this is left out
STEP_TERMS = (*COEFFICIENT_NAMES, "per_output_token_s")  # stage 1's unknowns
FRONT_END_ITERATIONS = 6
FRONT_END_SEEDS = 4  # each run simulated with this many step-noise seeds per iteration
PERCENTILES = (50.0, 90.0)  # stage 2 keeps the iterate whose TTFT percentiles match best
TRIM_SIGMAS = 4.0  # stage 1 leaves out steps this far off (chunks read late, bunched)


def _identify(a: np.ndarray, terms: Sequence[str]) -> tuple[list[int], dict[str, str]]:
    """The columns of `a` (named `terms`) to fit, in `PRIORITY` order, and why the others
    are not (see the module docstring): all zero, or within `SEPARABLE` of the span of those
    kept before."""
    kept: list[int] = []
    basis: list[np.ndarray] = []
    reasons: dict[str, str] = {}
    for name in (p for p in PRIORITY if p in terms):
        j = terms.index(name)
        v = a[:, j]
        norm = float(np.linalg.norm(v))
        if norm == 0.0:
            reasons[name] = "not excited by these runs (its feature is 0 in every interval)"
            continue
        r = v / norm
        for q in basis:
            r = r - q * float(q @ r)
        if float(np.linalg.norm(r)) < SEPARABLE:
            names = ", ".join(terms[i] for i in kept)
            reasons[name] = f"not separable from {names} in these runs (left at 0)"
            continue
        kept.append(j)
        basis.append(r / float(np.linalg.norm(r)))
    return sorted(kept), reasons


@dataclass(frozen=True, slots=True)
class ClientFit:
    """The fitted costs and how well they explain the client's times.

    Attributes:
        coefficients, api_server: the costs (unidentified terms 0).
        unidentified: term -> why it was not fitted.
        relative_se: identified term -> its standard error / value (None when 0).
        objective: stage 2's score per iteration (`_percentile_gap` of its simulation's
            TTFTs; lower is better), and `best` the kept one's index.
        in_sample: p50/p90 of observed and simulated TTFT and ITL (ms) with the relative
            error, the kept iterate's simulation of the calibration runs.
        scatter: the step-time scatter and stalls (`sim.client_noise.step_scatter`), or
            None with too few steps.
        counts: requests, steps reconstructed and timed, streams split, requests skipped.
        disturbed: the disturbed windows left out (`sim.client_noise.disturbed_windows`).
    """

    coefficients: ProfileCoefficients
    api_server: ApiServerCost
    unidentified: dict[str, str]
    relative_se: dict[str, float | None]
    objective: list[float]
    best: int
    in_sample: dict[str, dict[str, float]]
    scatter: StepScatter | None
    counts: dict[str, int]
    disturbed: tuple[Disturbance, ...] = ()

    def describe(self) -> dict[str, Any]:
        """JSON-ready: the profile's "fit" section."""
        return {"objective": "client", "iterations": self.objective, "best_iteration":
                self.best, "unidentified": self.unidentified, "relative_se": self.relative_se,
                "in_sample": self.in_sample,
                **(self.scatter.describe() if self.scatter is not None else {}),
                "disturbed": [asdict(d) for d in self.disturbed], **self.counts}

    def lines(self) -> list[str]:
        """What to tell the user: each term with its error, the unidentified ones, and the
        in-sample percentiles."""
        c = self.counts
        out = [f"client-side fit: {c['requests']} requests, {c['steps']} steps reconstructed "
               f"from their chunk times, {c['timed_steps']} timed back to back; front end: "
               f"best of {len(self.objective)} simulations (#{self.best + 1})"]
        values = {**asdict(self.coefficients), **asdict(self.api_server)}
        for name in TERMS:
            if name in self.unidentified:
                out.append(f"  {name:<30} -            {self.unidentified[name]}")
            else:
                se = self.relative_se.get(name)
                err = f"± {se:.1%}" if se is not None else "(fitted 0)"
                out.append(f"  {name:<30} {values[name]:<12.4g} {err}")
        out += noise_lines(self.scatter, self.disturbed)
        for key, row in self.in_sample.items():
            out.append(f"  in sample {key}: observed {row['observed']:.3f} ms, simulated "
                       f"{row['simulated']:.3f} ms ({row['error']:+.1%})")
        return out


@dataclass(frozen=True, slots=True)
class StepRows:
    """Stage 1's rows, one per step timed back to back: a [m, 7] (`STEP_TERMS`), y the
    observed durations (s), w the row weights (the square root of the step's decodes),
    follows whether the row before is the step just before (the two share a step end),
    run the run's index and end_s the step's end on that run's clock (s)."""

    a: np.ndarray
    y: np.ndarray
    w: np.ndarray
    follows: np.ndarray
    run: np.ndarray
    end_s: np.ndarray

    def without(self, drop: np.ndarray) -> StepRows:
        """The rows not in `drop` (a row whose predecessor is dropped no longer follows)."""
        ok = ~drop
        follows = self.follows & np.roll(ok, 1)
        return StepRows(self.a[ok], self.y[ok], self.w[ok], follows[ok], self.run[ok],
                        self.end_s[ok])


def _step_rows(steps: Sequence[ObservedSteps]) -> StepRows:
    """Stage 1's rows over every back-to-back step of every run."""
    rows, durations, weights, follows, index, ends = [], [], [], [], [], []
    for i, run in enumerate(steps):
        previous = -2
        for m in np.flatnonzero(run.busy):
            rows.append(np.append(run.features[m], run.sampled[m] - run.sampled[m - 1]))
            durations.append(run.end_s[m] - run.end_s[m - 1])
            weights.append(math.sqrt(max(run.decodes[m], 1.0)))
            follows.append(m == previous + 1)
            index.append(i)
            ends.append(run.end_s[m])
            previous = m
    if len(rows) < len(STEP_TERMS):
        raise ValueError(f"{len(rows)} steps timed back to back in these runs (chunk times "
                         f"of streams running together), at least {len(STEP_TERMS)} are needed")
    return StepRows(np.vstack(rows), np.asarray(durations), np.asarray(weights),
                    np.asarray(follows), np.asarray(index), np.asarray(ends))


def _nnls_fit(a: np.ndarray, y: np.ndarray, w: np.ndarray, terms: Sequence[str]
              ) -> tuple[np.ndarray, dict[str, str], dict[str, float | None]]:
    """Weighted NNLS over the identified columns: the solution (0 for the others), why the
    others were left out, and each fitted term's relative standard error."""
    aw, yw = a * w[:, None], y * w
    kept, reasons = _identify(aw, terms)
    x = np.zeros(a.shape[1])
    x[kept] = nnls(aw[:, kept], yw)
    residual = yw - aw @ x
    scale = np.linalg.norm(aw[:, kept], axis=0)
    gram = (aw[:, kept] / scale).T @ (aw[:, kept] / scale)
    sigma2 = float(residual @ residual) / max(1, len(yw) - len(kept))
    cov = sigma2 * np.linalg.pinv(gram) / np.outer(scale, scale)
    se = {terms[j]: (float(math.sqrt(max(cov[i, i], 0.0)) / x[j]) if x[j] > 0 else None)
          for i, j in enumerate(kept)}
    return x, reasons, se


Skip = Sequence[frozenset[str]]  # per run, the requests the fit leaves out (disturbed)


def _disturbed_requests(runs: Sequence[ClientRun], windows: Sequence[Disturbance]) -> Skip:
    """Per run, the requests running (sent to last chunk) during one of its disturbed
    windows."""
    out = []
    for i, run in enumerate(runs):
        spans = [(w.start_s, w.end_s) for w in windows if w.run == i]
        out.append(frozenset(r.request_id for r in run.trace if any(
            r.arrival_s < end and run.token_times_s[r.request_id][-1] >= start
            for start, end in spans)))
    return out


def _ttfts(runs: Sequence[ClientRun], sims: Sequence[SimResult], skip: Skip
           ) -> Iterator[tuple[float, float, int]]:
    """(observed TTFT, simulated TTFT, prompt length) of every request not in `skip`,
    seconds. ValueError naming a request the simulated server never ran (a prompt that
    leaves no room under max_model_len or outgrows the KV pool)."""
    for run, sim, left_out in zip(runs, sims, skip, strict=True):
        for record in sim.requests:
            if record.request_id in left_out:
                continue
            if record.first_token_s is None:  # ignored by the scheduler: never ran
                raise ValueError(f"{run.name}: request {record.request_id!r} does not run "
                                 "under the server's configuration: "
                                 f"{record.stop_reason or record.status}")
            observed = run.token_times_s[record.request_id][0]
            arrival = record.arrival_s
            yield (observed - arrival, record.first_token_s - arrival, record.prompt_len)


def _front_end(runs: Sequence[ClientRun], config: SimConfig, coefficients: ProfileCoefficients,
               per_output_token_s: float, skip: Skip
               ) -> tuple[ApiServerCost, dict[str, str], dict[str, float | None], list[float],
                          int, list[SimResult]]:
    """Stage 2 (module docstring): the front end's a and b, why either was not fitted, their
    relative standard errors, each iteration's score, the kept one and its simulations."""
    model = ProfileCostModel(coefficients)
    api = ApiServerCost(0.0, 0.0, per_output_token_s)
    scores: list[float] = []
    best: tuple[float, ApiServerCost, dict[str, str], dict[str, float | None],
                list[SimResult]] | None = None
    reasons: dict[str, str] = {}
    se: dict[str, float | None] = {}
    draws = FRONT_END_SEEDS if config.step_noise is not None else 1
    seeds = [config.seed + i // len(runs) for i in range(len(runs) * draws)]
    runs, skip = list(runs) * draws, list(skip) * draws
    for _ in range(FRONT_END_ITERATIONS):
        sims = [simulate(run.trace, with_noise_seed(replace(config, api_server=api), seed),
                         model) for run, seed in zip(runs, seeds, strict=True)]
        rows = np.asarray(list(_ttfts(runs, sims, skip)))
        observed, simulated, lens = rows[:, 0], rows[:, 1], rows[:, 2]
        residual = observed - simulated
        spread = 1.4826 * float(np.median(np.abs(residual - np.median(residual))))
        w = (np.abs(residual - np.median(residual)) <= TRIM_SIGMAS * spread
             if spread > 0 else np.ones(len(residual), bool)).astype(np.float64)
        scores.append(_percentile_gap(observed, simulated))
        if best is None or scores[-1] < best[0]:
            best = (scores[-1], api, reasons, se, sims)
        target = observed - simulated + api.per_request_s + api.per_prompt_token_s * lens
        a = np.stack([np.ones_like(lens), lens], axis=1)
        x, reasons, se = _nnls_fit(a, target, w, FRONT_END_NAMES[:2])
        api = ApiServerCost(float(x[0]), float(x[1]), per_output_token_s)
    assert best is not None
    _, api, reasons, se, sims = best
    return api, reasons, se, scores, scores.index(best[0]), sims


def _percentile_gap(observed: np.ndarray, simulated: np.ndarray) -> float:
    """Stage 2's score: mean |log(simulated / observed)| of the TTFT p50 and p90 (what
    fidelity is judged on; comparable from one iteration to the next, unlike a residual
    over the requests each iteration keeps)."""
    o = np.percentile(observed, PERCENTILES)
    s = np.percentile(simulated, PERCENTILES)
    return float(np.mean(np.abs(np.log(np.maximum(s, 1e-9) / np.maximum(o, 1e-9)))))


def _percentiles(runs: Sequence[ClientRun], sims: Sequence[SimResult], skip: Skip
                 ) -> dict[str, dict[str, float]]:
    """p50/p90 of TTFT and ITL (ms), observed and simulated, and the relative error, over
    the requests not in `skip`."""
    ttft = np.asarray([(o, s) for o, s, _ in _ttfts(runs, sims, skip)])
    gaps_obs = [b - a for run, left_out in zip(runs, skip, strict=True)
                for rid, t in run.token_times_s.items() if rid not in left_out
                for a, b in zip(t, t[1:], strict=False)]
    gaps_sim = [b - a for sim, left_out in zip(sims, skip, strict=True) for r in sim.requests
                if r.request_id not in left_out
                for a, b in zip(r.token_times_s, r.token_times_s[1:], strict=False)]
    out = {}
    for metric, observed, simulated in (("ttft", ttft[:, 0], ttft[:, 1]),
                                        ("itl", gaps_obs, gaps_sim)):
        if len(observed) == 0 or len(simulated) == 0:
            continue
        for q in (50, 90):
            o = float(np.percentile(observed, q)) * 1e3
            s = float(np.percentile(simulated, q)) * 1e3
            out[f"p{q}_{metric}"] = {"observed": o, "simulated": s,
                                     "error": (s - o) / o if o else math.nan}
    return out


def _fit_steps(a: np.ndarray, y: np.ndarray, w: np.ndarray
               ) -> tuple[np.ndarray, dict[str, str], dict[str, float | None], np.ndarray]:
    """Stage 1's solve, trimmed: fit, leave out the steps whose residual exceeds
    `TRIM_SIGMAS` robust standard deviations (1.4826 · median |residual|), fit again.
    Returns the solution, the unidentified terms, the errors and the steps kept."""
    x, _, _ = _nnls_fit(a, y, w, STEP_TERMS)
    residual = y - a @ x
    sigma = 1.4826 * float(np.median(np.abs(residual)))
    keep = np.abs(residual) <= TRIM_SIGMAS * sigma if sigma > 0 else np.ones(len(y), bool)
    x, reasons, se = _nnls_fit(a[keep], y[keep], w[keep], STEP_TERMS)
    return x, reasons, se, keep


def _screened_steps(rows: StepRows
                    ) -> tuple[StepRows, np.ndarray, dict[str, str], dict[str, float | None],
                               np.ndarray, list[Disturbance]]:
    """Stage 1 with the disturbed windows (`sim.client_noise`) judged on a first fit and
    left out: the rows kept, the solution, unidentified terms, errors, the trim's mask and
    the windows."""
    x, reasons, se, keep = _fit_steps(rows.a, rows.y, rows.w)
    drop, windows = disturbed_windows(rows.run, rows.end_s, rows.y, rows.a @ x)
    if windows:
        rows = rows.without(drop)
        x, reasons, se, keep = _fit_steps(rows.a, rows.y, rows.w)
    return rows, x, reasons, se, keep, windows


def fit_client_runs(runs: Sequence[ClientRun], scheduler: SchedulerConfig,
                    cache: CacheConfig, *, vocab_size: int = 32_000, seed: int = 0) -> ClientFit:
    """The estimator of the module docstring over the pooled runs. ValueError when the runs
    time too few steps to fit."""
    steps = [observed_steps(run, scheduler) for run in runs]
    rows, x, reasons, se, keep, windows = _screened_steps(_step_rows(steps))
    coefficients = ProfileCoefficients(**dict(zip(COEFFICIENT_NAMES, map(float, x[:6]),
                                                  strict=True)))
    scatter = step_scatter(rows.y, rows.a @ x, rows.follows, keep)
    noise = (StepNoise(scatter.quantiles, seed, stall_probability=scatter.stall_probability,
                       stall_quantiles_s=scatter.stall_quantiles_s)
             if scatter is not None else None)
    config = SimConfig(scheduler, cache, vocab_size=vocab_size, seed=seed, step_noise=noise)
    skip = _disturbed_requests(runs, windows)
    api, front_reasons, front_se, scores, best, sims = _front_end(
        runs, config, coefficients, float(x[6]), skip)
    counts = {"requests": sum(len(run.token_times_s) for run in runs),
              "steps": sum(len(s.end_s) for s in steps), "timed_steps": len(rows.y),
              "trimmed_steps": int(len(rows.y) - keep.sum()),
              "split_streams": sum(s.split_streams for s in steps),
              "skipped_requests": sum(run.skipped for run in runs),
              "disturbed_requests": sum(len(s) for s in skip)}
    draws = len(sims) // len(runs)  # the simulations pool `draws` noise seeds per run
    in_sample = _percentiles(list(runs) * draws, sims, list(skip) * draws)
    return ClientFit(coefficients, api, {**reasons, **front_reasons}, {**se, **front_se},
                     scores, best, in_sample, scatter, counts, tuple(windows))


def profile_from_client_runs(runs: Sequence[ClientRun], scheduler: SchedulerConfig,
                             cache: CacheConfig, *, model: str, date: str,
                             rt_version: str = "unknown",
                             sources: Mapping[str, str] | None = None,
                             seed: int = 0) -> tuple[Profile, ClientFit]:
    """`fit_client_runs` as a profile (device "endpoint"), the server's configs and where
    they came from in its fit section; and the fit itself."""
    fit = fit_client_runs(runs, scheduler, cache, seed=seed)
    return Profile(
        device="endpoint", model=model, dtype="unknown", versions={"rt": rt_version},
        date=date, coefficients=fit.coefficients, api_server=fit.api_server,
        step_time_quantiles=fit.scatter.quantiles if fit.scatter is not None else None,
        step_time_stall_probability=fit.scatter.stall_probability if fit.scatter else 0.0,
        step_time_stall_quantiles_s=fit.scatter.stall_quantiles_s if fit.scatter else None,
        fit={**fit.describe(), "target": "client", "sources": [run.name for run in runs],
             "server_config": {"scheduler": asdict(scheduler), "cache": asdict(cache),
                               "from": dict(sources or {})}}), fit
