"""Where a real fleet's TTFT goes, from the time stamps the servers already keep.

Every `rt serve` replica exports vLLM's histograms: TTFT from its API handler receiving the
request to its API process receiving the first output
(`vllm:time_to_first_token_seconds`), and the engine's own queue (queued -> scheduled) and
prefill (scheduled -> first token) times. With the client's TTFT and the router's routing
latency (`rt_router_routing_latency_seconds`), the mean TTFT of a replay splits into

    client TTFT = routing + hops + API server and IPC + engine
    engine      = queue + prefill                 (the engine's clock: what the twin models)
    API and IPC = serve TTFT - engine             (request parse, ZeroMQ both ways, loops)
    hops        = client TTFT - serve TTFT - routing
                  (client, HTTP client -> router -> replica and the stream back)

Sums and counts are cumulative, so a replay's share is the difference of two scrapes
(`ServerTotals.minus`). Means only: the histograms' buckets are too coarse for quantiles of
a few milliseconds. Times are seconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

from prometheus_client.parser import text_string_to_metric_families

_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds",
               "queue": "vllm:request_queue_time_seconds",
               "prefill": "vllm:request_prefill_time_seconds"}


@dataclass(frozen=True, slots=True)
class ServerTotals:
    """Sums (seconds) and counts of the replicas' TTFT, queue and prefill histograms,
    summed over replicas."""

    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    queue_sum: float = 0.0
    queue_count: float = 0.0
    prefill_sum: float = 0.0
    prefill_count: float = 0.0

    def minus(self, before: ServerTotals) -> ServerTotals:
        """What was observed between the scrape `before` and this one."""
        return ServerTotals(*(getattr(self, f.name) - getattr(before, f.name)
                              for f in fields(self)))

    def mean_s(self, name: str) -> float:
        """The mean of histogram `name` (ttft, queue, prefill); NaN when none observed."""
        count = getattr(self, f"{name}_count")
        return getattr(self, f"{name}_sum") / count if count else math.nan


def parse_server_totals(texts: Iterable[str]) -> ServerTotals:
    """The totals of the replicas' /metrics texts (`rt serve`'s, or vLLM's)."""
    totals = dict.fromkeys((f.name for f in fields(ServerTotals)), 0.0)
    names = {f"{metric}_{part}": f"{key}_{part}" for key, metric in _HISTOGRAMS.items()
             for part in ("sum", "count")}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in names:
                    totals[names[sample.name]] += float(sample.value)
    return ServerTotals(**totals)


def ttft_split(client_ttft_mean_s: float, routing_mean_s: float, servers: ServerTotals
               ) -> dict[str, float]:
    """The module docstring's split of the mean client TTFT, in milliseconds."""
    engine = servers.mean_s("queue") + servers.mean_s("prefill")
    serve = servers.mean_s("ttft")
    return {"client_ttft_mean_ms": client_ttft_mean_s * 1e3,
            "routing_mean_ms": routing_mean_s * 1e3,
            "hops_mean_ms": (client_ttft_mean_s - serve - routing_mean_s) * 1e3,
            "api_ipc_mean_ms": (serve - engine) * 1e3,
            "engine_mean_ms": engine * 1e3,
            "serve_ttft_mean_ms": serve * 1e3}
