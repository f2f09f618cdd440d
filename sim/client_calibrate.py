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
   delay). Non-negative least squares in seconds (a chunk read late shortens one gap and
   lengthens the next by as much, so the errors cancel in the sum), each row weighted by the
   square root of its decodes so each ITL gap counts once; then once more without the steps
   more than 4 robust standard deviations off (bunched reads, a cluster split by jitter).
2. Front-end input costs a (per request) and b (per prompt token). The run's arrivals are
   simulated (`sim.simulator.simulate`) under the server's engine flags with the step costs
   of stage 1 and their scatter (as the twin will be: waiting for a step in progress
   takes E[S](1 + CV²)/2, longer than with exact steps); each request's simulated TTFT is
   a + b·p_r plus what the engine and the queues add, so a, b are refitted on observed
   TTFT - (simulated TTFT - a - b·p_r) (least squares in seconds, non-negative, over the
   requests within 4 robust standard deviations: the mean TTFT is matched; relative
   weights had pulled a to the short requests, p50 TTFT -14% on the loopback truth) and
   the run simulated again, a few times; the iterate whose simulated TTFT p50 and p90 are
   closest to the observed ones is kept.

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
from sim.client_steps import CLUSTER_FRACTION, ClientRun, ObservedSteps, observed_steps
from sim.cost.api_server import ApiServerCost
from sim.cost.profile_model import ProfileCoefficients, ProfileCostModel
from sim.profile import Profile
from sim.simulator import SimConfig, SimResult, simulate
from sim.step_noise import StepNoise, ratio_quantiles

FRONT_END_NAMES = ("per_request_s", "per_prompt_token_s", "per_output_token_s")
TERMS = (*COEFFICIENT_NAMES, *FRONT_END_NAMES)
# Which terms are taken first when two cannot be told apart (the later is left out).
PRIORITY = ("constant_s", "per_decode_token_s", "per_prefill_token_s", "per_decode_kv_token_s",
            "per_request_s", "per_prompt_token_s", "per_output_token_s", "per_seq_s",
            "per_prefill_attention_pair_s")
SEPARABLE = 0.03  # a column whose part outside the kept terms' span is below this is left out
STEP_TERMS = (*COEFFICIENT_NAMES, "per_output_token_s")  # stage 1's unknowns
FRONT_END_ITERATIONS = 6
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
        step_time_quantiles: the scatter of the observed step durations around the fit
            without the delivery jitter (`_scatter`), or None with too few.
        counts: requests, steps reconstructed and timed, streams split, requests skipped.
    """

    coefficients: ProfileCoefficients
    api_server: ApiServerCost
    unidentified: dict[str, str]
    relative_se: dict[str, float | None]
    objective: list[float]
    best: int
    in_sample: dict[str, dict[str, float]]
    step_time_quantiles: tuple[float, ...] | None
    counts: dict[str, int]
    scatter_shrink: float | None = None  # `_scatter`'s; None: not estimated

    def describe(self) -> dict[str, Any]:
        """JSON-ready: the profile's "fit" section."""
        return {"objective": "client", "iterations": self.objective, "best_iteration":
                self.best, "unidentified": self.unidentified, "relative_se": self.relative_se,
                "in_sample": self.in_sample, "scatter_shrink": self.scatter_shrink,
                **self.counts}

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
        for key, row in self.in_sample.items():
            out.append(f"  in sample {key}: observed {row['observed']:.3f} ms, simulated "
                       f"{row['simulated']:.3f} ms ({row['error']:+.1%})")
        return out




def _step_rows(steps: Sequence[ObservedSteps]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stage 1's rows over every back-to-back step: A [m, 7] (`STEP_TERMS`), the observed
    durations, the row weights (the square root of the step's decodes) and whether the row
    before is the step just before (the two durations share a step end)."""
    rows, durations, weights, follows = [], [], [], []
    for run in steps:
        previous = -2
        for m in np.flatnonzero(run.busy):
            rows.append(np.append(run.features[m], run.sampled[m] - run.sampled[m - 1]))
            durations.append(run.end_s[m] - run.end_s[m - 1])
            weights.append(math.sqrt(max(run.decodes[m], 1.0)))
            follows.append(m == previous + 1)
            previous = m
    if len(rows) < len(STEP_TERMS):
        raise ValueError(f"{len(rows)} steps timed back to back in these runs (chunk times "
                         f"of streams running together), at least {len(STEP_TERMS)} are needed")
    return np.vstack(rows), np.asarray(durations), np.asarray(weights), np.asarray(follows)


def _scatter(y: np.ndarray, predicted: np.ndarray, follows: np.ndarray, keep: np.ndarray
             ) -> tuple[tuple[float, ...] | None, float | None]:
    """The step-time scatter without the delivery jitter, and the shrink applied.

    A chunk read late (the client, the server's output path) lands next to the following
    step's chunk of its stream, which splits its cluster: one observed duration far too
    long, the next one a fraction of a step. Such pairs (a duration under
    `CLUSTER_FRACTION` of the median, and the row before it) are left out. The rest: an
    observed duration is the step's time plus j_m - j_{m-1}, j_m the delay of step m's
    chunks after its end; with j i.i.d., consecutive durations covary by -Var(j), so the
    steps' own variance is Var(e) + 2 Cov(e_m, e_{m-1}) (e: residual seconds), and the
    ratios' quantiles (`ratio_quantiles`) are shrunk toward 1 by sqrt(that / Var(e)). As
    a factor on whole steps, the jitter made prefill steps up to 50x too short. Last, the
    table is scaled to mean Σ observed / Σ predicted over every timed step (the busy
    span, which late reads do not change): the trimmed fit and the clipped table leave
    out the long steps of a loaded machine, 29% of the busy time against vLLM at load 8."""
    bias = float(y.sum() / predicted.sum())
    short = y < CLUSTER_FRACTION * float(np.median(y))
    keep = keep & ~short & ~np.append(short[1:] & follows[1:], False)
    if keep.sum() < 2:
        return None, None
    table = np.asarray(ratio_quantiles(y[keep], predicted[keep]))
    pairs = np.flatnonzero(follows & keep & np.roll(keep, 1))
    centred = y - predicted - float((y - predicted)[keep].mean())
    var = float(np.mean(centred[keep] ** 2))
    if len(pairs) < 2 or var <= 0:
        return tuple(map(float, bias * table)), None
    cov = float(np.mean(centred[pairs] * centred[pairs - 1]))
    shrink = math.sqrt(max(var + 2.0 * min(cov, 0.0), 0.0) / var)
    return tuple(map(float, bias * (1.0 + shrink * (table - 1.0)))), shrink


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


def _ttfts(runs: Sequence[ClientRun], sims: Sequence[SimResult]
           ) -> Iterator[tuple[float, float, int]]:
    """(observed TTFT, simulated TTFT, prompt length) of every request, seconds."""
    for run, sim in zip(runs, sims, strict=True):
        for record in sim.requests:
            observed = run.token_times_s[record.request_id][0]
            arrival = record.arrival_s
            yield (observed - arrival, float(record.first_token_s) - arrival,
                   record.prompt_len)


def _front_end(runs: Sequence[ClientRun], config: SimConfig, coefficients: ProfileCoefficients,
               per_output_token_s: float
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
    for _ in range(FRONT_END_ITERATIONS):
        sims = [simulate(run.trace, replace(config, api_server=api), model) for run in runs]
        rows = np.asarray(list(_ttfts(runs, sims)))
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


def _percentiles(runs: Sequence[ClientRun], sims: Sequence[SimResult]
                 ) -> dict[str, dict[str, float]]:
    """p50/p90 of TTFT and ITL (ms), observed and simulated, and the relative error."""
    ttft = np.asarray([(o, s) for o, s, _ in _ttfts(runs, sims)])
    gaps_obs = [b - a for run in runs for t in run.token_times_s.values()
                for a, b in zip(t, t[1:], strict=False)]
    gaps_sim = [b - a for sim in sims for r in sim.requests
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


def fit_client_runs(runs: Sequence[ClientRun], scheduler: SchedulerConfig,
                    cache: CacheConfig, *, vocab_size: int = 32_000, seed: int = 0) -> ClientFit:
    """The estimator of the module docstring over the pooled runs. ValueError when the runs
    time too few steps to fit."""
    steps = [observed_steps(run, scheduler) for run in runs]
    a, y, w, follows = _step_rows(steps)
    x, reasons, se, keep = _fit_steps(a, y, w)
    coefficients = ProfileCoefficients(**dict(zip(COEFFICIENT_NAMES, map(float, x[:6]),
                                                  strict=True)))
    quantiles, shrink = _scatter(y, a @ x, follows, keep)
    noise = StepNoise(quantiles, seed) if quantiles is not None else None
    config = SimConfig(scheduler, cache, vocab_size=vocab_size, seed=seed, step_noise=noise)
    api, front_reasons, front_se, scores, best, sims = _front_end(runs, config, coefficients,
                                                                 float(x[6]))
    counts = {"requests": sum(len(run.token_times_s) for run in runs),
              "steps": sum(len(s.end_s) for s in steps), "timed_steps": len(y),
              "trimmed_steps": int(len(y) - keep.sum()),
              "split_streams": sum(s.split_streams for s in steps),
              "skipped_requests": sum(run.skipped for run in runs)}
    return ClientFit(coefficients, api, {**reasons, **front_reasons}, {**se, **front_se},
                     scores, best, _percentiles(runs, sims), quantiles, counts, shrink)


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
        step_time_quantiles=fit.step_time_quantiles,
        fit={**fit.describe(), "target": "client", "sources": [run.name for run in runs],
             "server_config": {"scheduler": asdict(scheduler), "cache": asdict(cache),
                               "from": dict(sources or {})}}), fit
