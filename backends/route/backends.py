"""The router's backends: their URLs, health, last scraped metrics, and the start-up check.

A backend is *up* while it answers: each refresh scrapes its `/metrics` (vLLM's gauges
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, summed
over engines, and `num_gpu_blocks` from `vllm:cache_config_info`) into a `ReplicaSnapshot`.
A failed scrape, or a request that could not connect, counts one failure; a success resets
the count. At `max_failures` consecutive failures the backend is taken *down*: it gets no
new requests, the responses still streaming from it are cut (their clients get an error
event), and it is probed on `/health` until it answers 200, when it is put back.

Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from backends.replay.endpoint_probe import bounded_get, redacted
from runtime.router import ReplicaSnapshot, RouterPolicy

RUNNING, WAITING, KV_USAGE = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                              "vllm:kv_cache_usage_perc")
CACHE_INFO = "vllm:cache_config_info"
TAKEN_OUT = "the backend was taken out"

if TYPE_CHECKING:
    from backends.route.upstream import Exchange


@dataclass(slots=True)
class EngineGauges:
    """The gauges of one scrape (None: not exported)."""

    num_running: float | None = None
    num_waiting: float | None = None
    kv_usage: float | None = None
    num_gpu_blocks: int | None = None


# a sample line of one of the three gauges (not e.g. num_requests_waiting_by_reason):
# name, optional {labels}, value
_GAUGE_LINE = re.compile(r"^(vllm:(?:num_requests_running|num_requests_waiting|"
                         r"kv_cache_usage_perc))(?:\{[^}\n]*\})?[ \t]+(\S+)", re.MULTILINE)
_CACHE_INFO_LINE = re.compile(r"^vllm:cache_config_info\{([^}\n]*)\}", re.MULTILINE)


def parse_metrics(text: str) -> EngineGauges:
    """vLLM's gauges from Prometheus text, summed over label sets (KV usage averaged: one
    value per engine of a data-parallel server). Two regular-expression scans, not a loop
    over every line (a server's /metrics has hundreds of lines, scraped every refresh)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    gauges = EngineGauges()
    for name, value in _GAUGE_LINE.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        sums[name] = sums.get(name, 0.0) + number
        counts[name] = counts.get(name, 0) + 1
    for labels in _CACHE_INFO_LINE.findall(text):
        gauges.num_gpu_blocks = _label_int(labels, "num_gpu_blocks")
    gauges.num_running = sums.get(RUNNING)
    gauges.num_waiting = sums.get(WAITING)
    if KV_USAGE in sums:
        gauges.kv_usage = min(max(sums[KV_USAGE] / counts[KV_USAGE], 0.0), 1.0)
    return gauges


def _label_int(labels: str, key: str) -> int | None:
    for part in labels.split(","):
        name, _, value = part.partition("=")
        if name.strip() == key:
            try:
                number = int(value.strip().strip('"'))
            except ValueError:
                return None
            return number if number >= 1 else None
    return None


def needed_signals(policy: RouterPolicy) -> tuple[str, ...]:
    """The /metrics gauges `policy` reads (load-only and router-index policies: none).
    ValueError for a policy that needs the engines' KV events, which rt route does not read."""
    config = getattr(policy, "config", None)

    def weight(name: str) -> float:
        return float(getattr(config, name, 0.0))

    if policy.name in ("dynamo-kv", "kv-aware") or weight("precise_prefix_cache") > 0:
        raise ValueError(f"router policy {policy.name} needs the engines' KV events (a precise "
                         "prefix index), which rt route does not read; use llm-d's "
                         "prefix-cache scorer, prefix-aware or sglang-cache-aware")
    if policy.name == "vllm-dp":
        legacy = getattr(config, "formula", "") == "legacy"
        return (WAITING, RUNNING) if legacy else (WAITING, RUNNING, KV_USAGE)
    if policy.name == "power-of-two" and getattr(config, "load", "") == "snapshot":
        return (KV_USAGE,)
    if policy.name == "llm-d":
        needed = []
        if weight("queue") > 0 or weight("load_aware") > 0:
            needed.append(WAITING)
        if weight("kv_cache_utilization") > 0:
            needed.append(KV_USAGE)
        return tuple(needed)
    return ()


@dataclass(eq=False)
class Backend:
    """One backend as the router sees it."""

    replica_id: int
    url: str  # base URL without a trailing slash or /v1
    up: bool = True
    failures: int = 0  # consecutive
    gauges: EngineGauges = field(default_factory=EngineGauges)
    scraped_at_s: float | None = None  # last successful scrape
    in_flight: int = 0
    # its requests in flight, from their sending to the end of their relay: failed (their
    # connections closed) when it is taken down
    streams: set[Exchange] = field(default_factory=set)

    def snapshot(self, now_s: float) -> ReplicaSnapshot:
        g = self.gauges
        return ReplicaSnapshot(
            replica_id=self.replica_id,
            taken_at_s=self.scraped_at_s if self.scraped_at_s is not None else now_s,
            num_waiting=int(g.num_waiting or 0), num_running=int(g.num_running or 0),
            kv_usage=g.kv_usage or 0.0, num_gpu_blocks=g.num_gpu_blocks)

    def scraped(self, text: str) -> None:
        """A successful scrape of its /metrics (`text`), now."""
        self.gauges = parse_metrics(text)
        self.scraped_at_s = time.monotonic()

    def succeeded(self) -> None:
        self.failures = 0

    def failed(self, max_failures: int) -> bool:
        """Count one failure; True when this one takes the backend down."""
        self.failures += 1
        if self.up and self.failures >= max_failures:
            self.take_down()
            return True
        return False

    def take_down(self) -> None:
        self.up = False
        for exchange in list(self.streams):  # their waits fail: a 502 or an error event
            exchange.close(TAKEN_OUT)

    def put_back(self) -> None:
        self.up = True
        self.failures = 0


def normalize_url(url: str) -> str:
    """"http://h:p/v1/" -> "http://h:p"; ValueError unless http(s)."""
    base = url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"--backend {redacted(url)!r}: not an http:// or https:// URL")
    if "@" in base.split("/", 3)[2]:  # user:password@host: the relay would not send them
        raise ValueError(f"--backend {redacted(url)!r}: credentials in a backend URL are "
                         "not sent (the router forwards each client's Authorization)")
    return base


def check_backends(urls: list[str], policy: RouterPolicy, headers: dict[str, str] | None = None,
                   timeout_s: float = 5.0) -> list[str]:
    """Normalized URLs of backends that answer as OpenAI servers (GET /v1/models with
    `headers`: the router's API key) and export what `policy` needs; ValueError (one line)
    naming the first that does not."""
    if not urls:
        raise ValueError("give at least one --backend URL")
    bases = [normalize_url(u) for u in urls]
    for base in bases:
        if bases.count(base) > 1:
            raise ValueError(f"--backend {base} is given twice")
    needed = needed_signals(policy)
    for base in bases:
        _check_one(functools.partial(bounded_get, headers=headers or {}, timeout_s=timeout_s),
                   base, policy.name, needed)
    return bases


def _check_one(get: Callable[[str], httpx.Response], base: str, policy: str,
               needed: tuple[str, ...]) -> None:
    """`get`: a GET bounded in all (a backend dripping its answer once held the start-up)."""
    try:
        models = get(f"{base}/v1/models")
    except httpx.HTTPError as err:
        raise ValueError(f"backend {base} is unreachable: {err or type(err).__name__}") \
            from None
    try:
        data = models.json().get("data") if models.status_code == 200 else None
    except ValueError:
        data = None
    if models.status_code == 401:
        raise ValueError(f"backend {base} refuses the router's API key (GET /v1/models "
                         "answered 401): give rt route the backends' --api-key")
    if not isinstance(data, list) or not data:
        raise ValueError(f"backend {base} is not OpenAI-compatible: GET /v1/models answered "
                         f"{models.status_code} without a model list")
    if not needed:
        return
    try:
        response = get(f"{base}/metrics")
        gauges = parse_metrics(response.text) if response.status_code == 200 else None
    except httpx.HTTPError:
        gauges = None
    values = {RUNNING: None, WAITING: None, KV_USAGE: None} if gauges is None else {
        RUNNING: gauges.num_running, WAITING: gauges.num_waiting, KV_USAGE: gauges.kv_usage}
    missing = [name for name in needed if values[name] is None]
    if missing:
        raise ValueError(f"router policy {policy} needs {', '.join(missing)} from /metrics, "
                         f"which backend {base} does not export")


async def healthy(client: httpx.AsyncClient, backend: Backend, timeout_s: float) -> bool:
    try:
        response = await client.get(f"{backend.url}/health", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200
