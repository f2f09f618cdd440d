"""Synthetic arrival times, identical to `vllm bench serve` for the same flags and seed.

vLLM (`vllm/benchmarks/serve.py`, `get_request`, no ramp-up) seeds the global numpy state with
`np.random.seed(seed)` and, for each of the N requests, draws one inter-arrival delay:

* `request_rate == inf`: every delay is 0, so every request arrives at t = 0;
* `burstiness == inf`: every delay is 1 / rate (a constant-rate process);
* otherwise `np.random.gamma(shape=burstiness, scale=1 / (rate * burstiness))`
  (burstiness 1 is a Poisson process; the gaps' coefficient of variation is 1/sqrt(burstiness)).

The delays are summed cumulatively, and if the last sum is non-zero every arrival is multiplied
by `(N / rate) / last`, so the last request arrives at exactly N / rate seconds. The first request
therefore arrives after one (rescaled) gap, not at 0. This module reproduces that sequence with
a private `numpy.random.RandomState(seed)`, which yields the same draws as the seeded global
state (vLLM's random dataset samples lengths from its own generator, so nothing else consumes
the global state before `get_request`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workloads.errors import TraceError
from workloads.trace import MAX_ARRIVAL_S

# The largest --seed: numpy's RandomState (and vLLM's np.random.seed(seed)) takes 0..2^32-1;
# -1 or 2^64 once failed as an OverflowError deep in the simulator.
MAX_SEED = 2**32 - 1


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    """vLLM's arrival process: `request_rate` in requests/s (inf allowed), Gamma shape
    `burstiness` (> 0, inf allowed), and the integer `seed` of `--seed`."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if math.isnan(self.request_rate) or self.request_rate <= 0:
            raise TraceError("must be > 0 requests/s or inf", column="--request-rate",
                             value=self.request_rate)
        if math.isnan(self.burstiness) or self.burstiness <= 0:
            raise TraceError("must be > 0 (1 = Poisson) or inf", column="--burstiness",
                             value=self.burstiness)

    def arrival_times(self, num_requests: int) -> np.ndarray:
        """Arrival times in seconds (float64, non-decreasing) of `num_requests` requests; the
        last at num_requests / request_rate, which must be <= `MAX_ARRIVAL_S`."""
        span = num_requests / self.request_rate
        if span > MAX_ARRIVAL_S:
            raise TraceError(f"{num_requests} requests at this rate span {span:.4g} s, past the "
                             f"{MAX_ARRIVAL_S:,.0f} s (194 days) a trace may span",
                             column="--request-rate", value=self.request_rate)
        return vllm_arrival_times(num_requests, self.request_rate, self.burstiness, self.seed)


def vllm_arrival_times(num_requests: int, request_rate: float, burstiness: float,
                       seed: int) -> np.ndarray:
    """Cumulative arrival times (s) exactly as `vllm bench serve` computes its delays."""
    if num_requests < 0:
        raise TraceError("must be >= 0", column="--num-prompts", value=num_requests)
    if num_requests == 0:
        return np.zeros(0, dtype=np.float64)
    if math.isinf(request_rate):
        return np.zeros(num_requests, dtype=np.float64)
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        theta = 1.0 / (request_rate * burstiness)
        gaps = np.random.RandomState(seed).gamma(burstiness, theta, size=num_requests)
    times = np.cumsum(gaps)
    if times[-1] != 0:
        # vLLM multiplies each cumulative delay by (target / last) in Python floats
        factor = (num_requests / request_rate) / times[-1]
        times = times * factor
    return times
