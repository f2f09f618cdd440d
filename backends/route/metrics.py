"""The router's own Prometheus metrics (`rt route`'s /metrics).

Names follow Prometheus conventions under an `rt_router_` prefix (prometheus-client adds
`_total` to counters); `backend` is the backend's base URL, `policy` the policy's CLI name.
A decision's `reason` is the policy's phrase with numbers replaced by N (so that replica ids
and tie counts do not multiply the label values). Times are seconds.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from backends.route.backends import Backend

ROUTING_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 1.0)
AGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 5.0)
_TIE_NOTE = re.compile(r" \(tie of \d+, seeded draw\)$")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def reason_label(reason: str) -> str:
    return _NUMBER.sub("N", _TIE_NOTE.sub("", reason))


class RouterMetrics:
    def __init__(self, policy: str, backends: Sequence[Backend], scrape_period_s: float = 0.0
                 ) -> None:
        self.registry = registry = CollectorRegistry()
        self.policy = policy
        self.requests = Counter("rt_router_requests", "Requests dispatched, by backend.",
                                ["backend"], registry=registry)
        self.decisions = Counter("rt_router_routing_decisions", "Routing decisions, by the "
                                 "policy's reason.", ["policy", "reason"], registry=registry)
        self.errors = Counter("rt_router_backend_errors", "Backend failures, by kind: connect "
                              "(request re-routed), stream (response cut), status (a 5xx "
                              "other than 503), scrape, health.",
                              ["backend", "kind"], registry=registry)
        self.retries = Counter("rt_router_retries", "Requests re-routed after a backend "
                               "refused the connection.", registry=registry)
        self.unroutable = Counter("rt_router_unroutable", "Requests answered 503: no backend "
                                  "up.", registry=registry)
        self.routing_latency = Histogram(
            "rt_router_routing_latency_seconds", "From the request reaching the router to its "
            "dispatch to a backend (body read, parse, policy).", buckets=ROUTING_BUCKETS,
            registry=registry)
        self.decision_scrape_age = Histogram(
            "rt_router_decision_scrape_age_seconds", "Per routing decision, the mean age of "
            "the candidates' last /metrics scrape: how stale the signals the policy read were "
            "(a simulated fleet's refresh tick gives refresh / 2 on average).",
            buckets=AGE_BUCKETS, registry=registry)
        period = Gauge("rt_router_scrape_period_seconds", "Seconds between two /metrics scrapes "
                       "of a backend (0: before every decision; the health-check period when "
                       "the policy reads no gauge).", registry=registry)
        period.set(scrape_period_s)
        up = Gauge("rt_router_backend_up", "1 while the backend takes requests.", ["backend"],
                   registry=registry)
        in_flight = Gauge("rt_router_in_flight_requests", "Requests dispatched and not "
                          "finished, by backend.", ["backend"], registry=registry)
        age = Gauge("rt_router_scrape_age_seconds", "Age of the backend's last successful "
                    "/metrics scrape (-1: never).", ["backend"], registry=registry)
        self._requests = [self.requests.labels(backend.url) for backend in backends]
        for backend in backends:
            for kind in ("connect", "stream", "status", "scrape", "health"):
                self.errors.labels(backend.url, kind)
            up.labels(backend.url).set_function(partial(_up, backend))
            in_flight.labels(backend.url).set_function(partial(_in_flight, backend))
            age.labels(backend.url).set_function(partial(_age, backend))

    def dispatched(self, replica: int) -> None:
        """One request sent to backend `replica` (its index)."""
        self._requests[replica].inc()

    def decided(self, reason: str) -> None:
        self.decisions.labels(self.policy, reason_label(reason)).inc()


def _up(backend: Backend) -> float:
    return float(backend.up)


def _in_flight(backend: Backend) -> float:
    return float(backend.in_flight)


def _age(backend: Backend) -> float:
    at = backend.scraped_at_s
    return -1.0 if at is None else time.monotonic() - at
