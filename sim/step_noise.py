"""Step-time noise: real steps of equal features do not take equal times.

A cost model predicts a step's mean time. Real steps scatter around it (on the CPU backend
the measured/predicted ratio has a coefficient of variation of 0.25-0.30), and the scatter
is not neutral for latency: a request that arrives during a step waits for the rest of it,
and it is more likely to arrive during a long step than a short one (the inspection
paradox), so the mean wait for the step boundary is E[S]·(1 + CV²)/2, not E[S]/2. A
simulator with deterministic steps therefore underestimates the tails of TTFT.

`StepNoise` multiplies the predicted time of step k by Q(u_k), where Q is the empirical
quantile function of measured/predicted ratios of calibration steps (normalised to mean 1,
so busy time is unbiased), and u_k in [0, 1) is a hash of (seed, k). Because the factor is
a function of the step's index, not of a random stream, stepping one by one and
fast-forwarding a run of decode steps give the same durations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A 64-bit mixing function (SplitMix64's finaliser): well-spread outputs for
    consecutive inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def ratio_quantiles(measured_s: Sequence[float], predicted_s: Sequence[float],
                    points: int = 101, trim: float = 0.01) -> tuple[float, ...]:
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
    if points < 2 or not 0 <= trim < 0.5:
        raise ValueError(f"need points >= 2 and 0 <= trim < 0.5, got {points}, {trim}")
    ratios = measured[timed] / predicted[timed]
    clipped = np.clip(ratios, *np.quantile(ratios, [trim, 1 - trim]))
    table = np.quantile(clipped, np.linspace(0.0, 1.0, points)) / clipped.mean()
    return tuple(float(q) for q in table)


@dataclass(frozen=True, slots=True)
class StepNoise:
    """Attributes:
        quantiles: Q at evenly spaced probabilities from 0 to 1 (>= 2 values, positive,
            non-decreasing); the factor's distribution.
        seed: the run's seed.
    """

    quantiles: tuple[float, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        q = self.quantiles
        if len(q) < 2:
            raise ValueError(f"StepNoise.quantiles needs >= 2 values, got {len(q)}")
        if not all(math.isfinite(v) and v > 0 for v in q):
            raise ValueError("StepNoise.quantiles must be finite and > 0")
        if any(b < a for a, b in zip(q, q[1:], strict=False)):
            raise ValueError("StepNoise.quantiles must be non-decreasing")

    def uniform(self, step: int) -> float:
        """u in [0, 1) for step index `step`, a pure function of (seed, step)."""
        return _splitmix64((self.seed * 0x100000001B3) ^ step) / 2.0**64

    def factor(self, step: int) -> float:
        """Q(u(step)): the multiplier of step `step`'s predicted time."""
        q = self.quantiles
        x = self.uniform(step) * (len(q) - 1)
        lo = int(x)
        return q[lo] + (q[lo + 1] - q[lo]) * (x - lo) if lo + 1 < len(q) else q[-1]

