"""What a router's own /metrics say about its overheads (`rt route`'s `rt_router_*`).

Quantiles of a Prometheus histogram are estimated as Prometheus' `histogram_quantile` does:
linear interpolation inside the bucket that holds the rank (the upper bound of the last
finite bucket when the rank falls in +Inf). Times are seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

ROUTING = "rt_router_routing_latency_seconds"
AGE = "rt_router_decision_scrape_age_seconds"


@dataclass(frozen=True, slots=True)
class RouterOverheads:
    """The router's measured overheads over a run (NaN: nothing observed).

    Attributes:
        requests: dispatches per backend, in `--backend` order (retries count twice).
        routing_latency_*: request reaching the router -> dispatch (body read, parse,
            policy); mean, and p50/p99 estimated from the histogram's buckets.
        scrape_age_*: per decision, the mean age of the candidates' last /metrics scrape.
        scrape_period_s: the router's scrape period (the health-check period when the
            policy reads no gauge; NaN: not exported).
        retries, backend_errors, unroutable: counters (errors of every kind, scrapes too).
    """

    requests: tuple[float, ...]
    routing_latency_mean_s: float
    routing_latency_p50_s: float
    routing_latency_p99_s: float
    scrape_age_mean_s: float
    scrape_age_p50_s: float
    scrape_period_s: float
    retries: float
    backend_errors: float
    unroutable: float


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The q-quantile (0..1) of cumulative buckets [(upper bound, count <= bound)], sorted,
    the last +Inf; NaN when empty."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            width = count - below
            return lower + (bound - lower) * ((rank - below) / width if width else 1.0)
        lower, below = bound, count
    return lower


def _histogram(samples: dict[str, list[tuple[dict[str, str], float]]], name: str
               ) -> tuple[float, float, float]:
    """(mean, p50, p99) of the histogram `name` (NaN when it has no observation)."""
    buckets = sorted((float(labels["le"]), value)
                     for labels, value in samples.get(f"{name}_bucket", []))
    count = sum(v for _, v in samples.get(f"{name}_count", []))
    total = sum(v for _, v in samples.get(f"{name}_sum", []))
    mean = total / count if count else math.nan
    return mean, histogram_quantile(0.5, buckets), histogram_quantile(0.99, buckets)


def _gauge(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    values = samples.get(name)
    return float(values[0][1]) if values else math.nan


def parse_router_metrics(text: str, backends: Sequence[str]) -> RouterOverheads:
    """The overheads in `rt route`'s /metrics text; `backends` are the base URLs in
    `--backend` order."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))

    def total(name: str) -> float:
        return float(sum(v for _, v in samples.get(name, [])))

    per_backend = {labels.get("backend"): value
                   for labels, value in samples.get("rt_router_requests_total", [])}
    routing, age = _histogram(samples, ROUTING), _histogram(samples, AGE)
    return RouterOverheads(
        requests=tuple(float(per_backend.get(url, 0.0)) for url in backends),
        routing_latency_mean_s=routing[0], routing_latency_p50_s=routing[1],
        routing_latency_p99_s=routing[2], scrape_age_mean_s=age[0], scrape_age_p50_s=age[1],
        scrape_period_s=_gauge(samples, "rt_router_scrape_period_seconds"),
        retries=total("rt_router_retries_total"),
        backend_errors=total("rt_router_backend_errors_total"),
        unroutable=total("rt_router_unroutable_total"))


def unread_overheads(backends: int) -> RouterOverheads:
    """The overheads of a router whose /metrics could not be read: every figure NaN."""
    nan = math.nan
    return RouterOverheads((nan,) * backends, nan, nan, nan, nan, nan, nan, nan, nan, nan)
