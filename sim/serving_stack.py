"""The serving stack's own time per request in a fleet, fitted on a calibration replay.

The simulated fleet models the engines (the cost model) and the router's measured routing
latency; a real request also crosses the client, the HTTP hops (client -> router -> the
replica's API process -> its engine process over ZeroMQ, and the stream back) and the API
server's parsing. `ServingStack` names that time as a cost per request and one per prompt
token, and `fit_serving_stack` measures it out of sample: the real fleet replays other
requests (calibration windows, one before and one after the measured replay, pooled by
`fit_on_twins`), the fleet's twin replays the same requests with no serving-stack cost, and
per request

    d_i = real TTFT_i - twin TTFT_i ~ per_request_s + per_prompt_token_s * prompt_len_i.

The line is fitted robustly (Theil-Sen: the median of the pairwise slopes, at most
`MAX_PAIRS` of them, then the median intercept), so the CPU queueing of a loaded machine, a
long tail of d that grows with load, does not enter the fixed cost. What the line leaves,
the residuals r_i = d_i - line_i (in-sample), is the spread of the hops and the client
around their median: `Spread` keeps them as they are (their median is 0 on the line; a
line clamped at 0 leaves them below it), and each simulated request draws its delay as
line + a residual (`draw_delays`: the residuals' empirical quantile function at a uniform
draw from a stream of the seed's own; never below 0). In the twin the delay is
spent after the routing decision, between the router and the engine (`sim.fleet`'s
`stack_delay_s`): real requests are routed in arrival order and tokenized in the replica
after routing. Times are seconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from runtime.records import RequestRecord, ttft_by_request
from sim.cost.base import _check_number
from workloads import Trace, TraceRequest


class MeasuredReplay(Protocol):
    """A calibration replay through the real fleet (`backends.route.fleet_fidelity`'s
    `CalibrationReplay`): the trace replayed, each finished request's client-side TTFT
    (seconds, by request id), and the router's measured overheads during it
    (`RouterOverheads` as a mapping)."""

    @property
    def trace(self) -> Trace: ...

    @property
    def ttft_s(self) -> Mapping[str, float]: ...

    @property
    def overheads(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ServingStack:
    """The serving stack's time before the engine sees a request: `per_request_s` +
    `per_prompt_token_s` * prompt tokens (the client, the HTTP hops, the API server and the
    engine IPC; the router's routing latency is modelled apart): its median, the fitted
    line. In the simulated fleet it is a plain delay of each request between the routing
    decision and the engine, not a queue: most of it is client and HTTP-hop latency that
    real requests spend concurrently, and the fit (one line per request) cannot tell a
    serial part from it."""

    per_request_s: float = 0.0
    per_prompt_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_request_s", "per_prompt_token_s"):
            _check_number("ServingStack", name, getattr(self, name), positive=False)

    def delay_s(self, prompt_len: int) -> float:
        """Seconds a request of `prompt_len` prompt tokens spends in the stack (median)."""
        return self.per_request_s + self.per_prompt_token_s * prompt_len


SPREAD_QUANTILES = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)  # reported of a `Spread`


@dataclass(frozen=True, slots=True)
class Spread:
    """The in-sample residuals of the fit (seconds, sorted): real requests' stack time
    around the fitted line, as they are. Their median is 0 around a Theil-Sen line (its
    intercept is the median of d - slope * x); around a line clamped at 0 it is where the
    real requests put it (below 0 when the real fleet was not slower than the twin: such
    draws come out at 0, not re-centred onto the line). A draw is their empirical quantile
    function (linear between order statistics, `numpy.quantile`'s default) at a uniform u:
    bounded by the smallest and largest residual seen. Empty: no spread (every draw 0)."""

    residuals_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        values = self.residuals_s
        if any(not math.isfinite(v) for v in values):
            raise ValueError("Spread: residuals must be finite")
        if list(values) != sorted(values):
            raise ValueError("Spread: residuals must be sorted")

    @classmethod
    def of(cls, residuals: Sequence[float]) -> Spread:
        """The spread of `residuals` (seconds, any order)."""
        return cls(tuple(sorted(float(v) for v in residuals)))

    def draw(self, u: np.ndarray) -> np.ndarray:
        """The residuals' quantiles at `u` (values in [0, 1]; seconds)."""
        if not self.residuals_s:
            return np.zeros(len(u))
        return np.asarray(np.quantile(np.asarray(self.residuals_s), u), dtype=float)

    def describe(self) -> dict[str, Any]:
        """fleet_fidelity's `spread` section (milliseconds)."""
        q = self.draw(np.asarray(SPREAD_QUANTILES)) * 1e3
        return {"fitted": "the fit's in-sample residuals around its line; each request "
                          "draws one by their empirical quantile function",
                "residuals": len(self.residuals_s),
                "quantiles_ms": {f"p{round(p * 100)}": float(v)
                                 for p, v in zip(SPREAD_QUANTILES, q, strict=True)}}


# Each use of a run's seed draws from a stream of its own, `default_rng([seed, STREAM])`:
# `default_rng(seed)` is the random dataset's (`workloads.synthetic`), and with the same
# `--seed` the delays would be the trace's lengths in other units.
DELAY_STREAM = 1  # `draw_delays`' uniforms
PAIR_STREAM = 2  # Theil-Sen's sample of pairs (`_pairs`)


def draw_delays(trace: Trace, stack: ServingStack, spread: Spread, seed: int
                ) -> dict[str, float]:
    """Each request's stack time (seconds, by request id): `stack.delay_s(prompt_len)` + a
    residual drawn from `spread` with uniforms from `seed`'s `DELAY_STREAM` (one per
    request, in trace order), at least 0 (a real TTFT is not faster than the engine's)."""
    u = np.random.default_rng([seed, DELAY_STREAM]).random(len(trace))
    line = np.array([stack.delay_s(r.prompt_len) for r in trace], dtype=float)
    delays = np.maximum(line + spread.draw(u), 0.0)
    return {r.request_id: float(d) for r, d in zip(trace, delays, strict=True)}


@dataclass(frozen=True, slots=True)
class StackFit:
    """A fitted `ServingStack`, the spread around it and how well the line fits.

    Attributes:
        stack: the fitted costs (each clamped at 0).
        spread: the residuals around the line (the hops' and the client's spread).
        requests: requests fitted on (finished in both the real replay and its twin).
        gap_p50_s, gap_p90_s: p50/p90 of d (real - twin TTFT) before the fit.
        residual_p50_s, residual_p90_s: p50/p90 of d minus the fitted line: what the fixed
            costs leave (at p90: queueing for a CPU, which grows with the machine's load).
        clamped: the terms that came out negative and were set to 0.
        cold_left_out: calibration requests left out as cold (`warm_requests`).
        windows: calibration windows pooled (`fit_on_twins`).
    """

    stack: ServingStack
    spread: Spread
    requests: int
    gap_p50_s: float
    gap_p90_s: float
    clamped: tuple[str, ...] = ()
    cold_left_out: int = 0
    windows: int = 1

    @property
    def residual_p50_s(self) -> float:
        return float(self.spread.draw(np.array([0.5]))[0])

    @property
    def residual_p90_s(self) -> float:
        return float(self.spread.draw(np.array([0.9]))[0])

    def describe(self) -> dict[str, Any]:
        """run.json's `serving_stack` section (milliseconds and microseconds per token)."""
        return {"per_request_ms": self.stack.per_request_s * 1e3,
                "per_prompt_token_us": self.stack.per_prompt_token_s * 1e6,
                "fitted_on": ("calibration windows (other requests) before and after the "
                              "measured replay, pooled" if self.windows > 1 else
                              "a calibration replay (other requests)"),
                "windows": self.windows,
                "requests": self.requests, "gap_p50_ms": self.gap_p50_s * 1e3,
                "gap_p90_ms": self.gap_p90_s * 1e3,
                "residual_p50_ms": self.residual_p50_s * 1e3,
                "residual_p90_ms": self.residual_p90_s * 1e3, "clamped": list(self.clamped),
                "cold_left_out": self.cold_left_out, "spread": self.spread.describe()}


MAX_PAIRS = 200_000  # Theil-Sen's pairs at most (a seeded sample beyond): memory O(pairs)
MIN_REQUESTS = 10  # requests a fit needs (fewer: `StackNotFitted`)


class StackNotFitted(ValueError):
    """Too few requests in the calibration replay to fit the serving stack (the reason)."""


def _pairs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i, j) of n points: all i < j when there are at most `MAX_PAIRS`, else
    `MAX_PAIRS` pairs drawn uniformly (with replacement, i != j) from `seed`'s
    `PAIR_STREAM`."""
    if n * (n - 1) // 2 <= MAX_PAIRS:
        return np.triu_indices(n, k=1)
    rng = np.random.default_rng([seed, PAIR_STREAM])
    i = rng.integers(0, n, MAX_PAIRS)
    j = (i + rng.integers(1, n, MAX_PAIRS)) % n  # != i
    return i, j


def theil_sen(x: Sequence[float], y: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """(intercept, slope) of y ~ intercept + slope * x: the slope the median of the slopes
    of the pairs with distinct x (all pairs up to `MAX_PAIRS`, else a sample drawn from
    `seed`; 0 when there is none), the intercept the median of y - slope * x. Exact on
    points on one line."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = _pairs(len(xs), seed)
    dx = xs[j] - xs[i]
    keep = dx != 0
    slope = float(np.median((ys[j] - ys[i])[keep] / dx[keep])) if keep.any() else 0.0
    return float(np.median(ys - slope * xs)), slope


def fit_serving_stack(prompt_lens: Sequence[int], real_ttft_s: Sequence[float],
                      twin_ttft_s: Sequence[float], seed: int = 0) -> StackFit:
    """The `ServingStack` of requests with these prompt lengths, real TTFTs and their
    twin's TTFTs (without serving-stack cost), matched by position; requests whose gap is
    not finite (a failed request) are dropped. A negative per-request term is clamped to 0
    and the slope refitted through the origin (the median of gap / prompt tokens); the
    spread is the residuals around the line so clamped (`Spread`).
    `StackNotFitted` when fewer than `MIN_REQUESTS` remain; ValueError when the lengths
    differ."""
    if not len(prompt_lens) == len(real_ttft_s) == len(twin_ttft_s):
        raise ValueError("fit_serving_stack: prompt_lens, real and twin TTFTs differ in length")
    x = np.asarray(prompt_lens, dtype=float)
    gap = np.asarray(real_ttft_s, dtype=float) - np.asarray(twin_ttft_s, dtype=float)
    finite = np.isfinite(gap)
    x, gap = x[finite], gap[finite]
    if len(x) < MIN_REQUESTS:
        raise StackNotFitted(f"{len(x)} requests of the calibration replay finished in both "
                             f"it and its twin; the serving stack's fit needs {MIN_REQUESTS}")
    intercept, slope = theil_sen(x.tolist(), gap.tolist(), seed)
    clamped = []
    if intercept < 0:  # through the origin: the slope alone
        clamped.append("per_request_s")
        intercept, slope = 0.0, float(np.median(gap[x > 0] / x[x > 0])) if (x > 0).any() else 0.0
    if slope < 0:  # the fixed cost alone, as the median
        clamped.append("per_prompt_token_s")
        intercept, slope = max(float(np.median(gap)), 0.0), 0.0
    residual = gap - (intercept + slope * x)
    p50, p90 = np.quantile(gap, [0.5, 0.9])
    return StackFit(ServingStack(intercept, slope), Spread.of(residual.tolist()), len(x),
                    float(p50), float(p90), tuple(clamped))


def warm_requests(calibration: MeasuredReplay) -> list[TraceRequest]:
    """The calibration replay's requests, by arrival, that arrived once the first request
    with a TTFT had its first token. A fresh fleet's first request is cold (real - twin
    TTFT 119-335 ms measured, docs/route.md), and the requests arriving before its first
    token wait behind that cold start (29-130 ms over the twin, against a median of 6-10 ms,
    in fid16's replays); the measured replay after them runs on warm replicas. Those are
    left out of the fit, the first request with them."""
    ttft = calibration.ttft_s  # the trace is in arrival order (`Trace` checks it)
    first = next((r for r in calibration.trace if r.request_id in ttft), None)
    if first is None:
        return []
    warm_at = first.arrival_s + ttft[first.request_id]
    return [r for r in calibration.trace if r.arrival_s >= warm_at]


def _fit_rows(window: MeasuredReplay, twin: Sequence[RequestRecord], fresh: bool
              ) -> tuple[list[TraceRequest], list[tuple[int, float, float]]]:
    """The window's requests kept (`warm_requests` when it ran on a fresh fleet, else all)
    and, of those with a TTFT in both it and `twin`, (prompt_len, real TTFT, twin TTFT)."""
    sim = ttft_by_request(twin)
    kept = warm_requests(window) if fresh else list(window.trace)
    return kept, [(r.prompt_len, window.ttft_s[r.request_id], sim[r.request_id])
                  for r in kept if r.request_id in sim and r.request_id in window.ttft_s]


def fit_on_twins(windows: Sequence[tuple[MeasuredReplay, Sequence[RequestRecord]]],
                 seed: int = 0, fresh: bool = True) -> StackFit:
    """`fit_serving_stack` on calibration windows pooled, each against its twin (its trace
    through the fleet's twin without serving-stack cost): the requests with a TTFT in both.
    With `fresh`, the first window ran on a fresh fleet: only its `warm_requests` (the
    others counted in `cold_left_out`); later windows run on the warm fleet, as the measured
    replay does, and keep every request. `seed` draws Theil-Sen's pairs of a long replay."""
    rows: list[tuple[int, float, float]] = []
    cold = 0
    for k, (window, twin) in enumerate(windows):
        kept, window_rows = _fit_rows(window, twin, fresh and k == 0)
        cold += len(window.trace) - len(kept)
        rows += window_rows
    fit = fit_serving_stack([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                            seed)
    return replace(fit, cold_left_out=cold, windows=len(windows))


def drawn_summary(delays: Mapping[str, float]) -> dict[str, Any]:
    """run.json's summary of the delays drawn for the trace (milliseconds): p50, p90, p99
    (linear between order statistics, as the spread's), and how many came out at 0 (a
    residual below minus the line)."""
    values = np.fromiter(delays.values(), dtype=float, count=len(delays))
    if not len(values):
        return {"requests": 0}
    q = np.quantile(values, [0.5, 0.9, 0.99]) * 1e3
    return {"requests": len(values),
            **{f"p{p}_ms": float(v) for p, v in zip((50, 90, 99), q, strict=True)},
            "at_zero": int((values == 0.0).sum())}
