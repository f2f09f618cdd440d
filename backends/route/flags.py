"""`rt route`'s own flags (import-light: no FastAPI here, so the CLI can declare them). The
policy flags (`--router`, `--router-arg`, `--router-refresh-ms`) are the simulator's
(`sim.fleet_config.FleetFlags`), shared by `rt simulate --replicas` and `rt route`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from backends.bench.flags import MAX_STREAMS
from backends.serve.flags import SERVER_PANEL
from runtime.flags import check_bounds, flag

ROUTE_PANEL = "Router"
# The response header naming the backend that answered: its index among --backend (0-based,
# a simulated fleet's `replica`), on every forwarded response; `rt replay --endpoint` reads it.
REPLICA_HEADER = "x-rt-replica"


# `rt route --help`'s description of the command, beside its flags.
ROUTE_HELP = """\
Route the OpenAI API (/v1/completions, /v1/chat/completions, streaming or not) over
--backend servers with a shared router policy (as `rt simulate --replicas N --router`):
its own in-flight counts and prefix index (the prompt's UTF-8 bytes), and each backend's
/metrics scraped every --router-refresh-ms. Serves /v1/models, /health, /metrics.
Failing backends are taken out and put back when healthy; SIGTERM/Ctrl-C drains.
"""


@dataclass(frozen=True, slots=True)
class RouteFlags:
    """Which backends, where the router listens, and when it gives up on a backend."""

    backend: list[str] | None = flag(None, "--backend", "Base URL of an OpenAI-compatible "
                                     "server (rt serve, vllm serve), e.g. "
                                     "http://127.0.0.1:8001 (repeat; order = replica id).",
                                     ROUTE_PANEL)
    host: str = flag("127.0.0.1", "--host", None, ROUTE_PANEL)
    port: int = flag(8080, "--port", None, ROUTE_PANEL, bounds=(0, 65535))  # 0: a free port
    max_failures: int = flag(3, "--max-failures", "Consecutive failed scrapes or connections "
                             "after which a backend is taken out (until /health answers).",
                             ROUTE_PANEL)
    health_check_ms: float = flag(500.0, "--health-check-ms", "How often a backend taken out "
                                  "is probed on /health.", ROUTE_PANEL)
    backend_timeout: float = flag(300.0, "--backend-timeout", "Seconds a backend may stay "
                                  "silent (before the headers, or between two chunks) before "
                                  "its request fails.", ROUTE_PANEL)
    shutdown_timeout: float = flag(10.0, "--shutdown-timeout", "On SIGTERM, seconds in-flight "
                                   "requests may finish before they are cut.", ROUTE_PANEL)

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise ValueError(f"--max-failures must be >= 1, got {self.max_failures}")
        check_bounds(self)
        for name in ("health_check_ms", "backend_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")


# rt bench route's load at most: 1e20 requests, rounds or streams hung before the first line
MAX_BENCH_REQUESTS = 1 << 24  # per path, round and concurrency
MAX_ROUNDS = 100
MAX_SOAK_BACKENDS = 64  # each an rt serve process


@dataclass(frozen=True, slots=True)
class RouteBenchFlags:
    """`rt bench route`'s load: closed-loop streams, requests, tokens, rounds."""

    concurrency: list[int] | None = flag(None, "--concurrency", "Closed-loop streams (repeat) "
                                         "[default: 1 and 200; --soak: 200].", min=1)
    num_requests: int = flag(400, "--num-requests", "Requests per path, round and "
                             "concurrency.", min=1, bounds=(1, MAX_BENCH_REQUESTS))
    max_tokens: int = flag(4, "--max-tokens", min=1)
    rounds: int = flag(2, "--rounds", "Direct-then-routed rounds (interleaved against drift).",
                       min=1, bounds=(1, MAX_ROUNDS))
    soak: float | None = flag(None, "--soak", "Instead: hold --concurrency streams (one value; "
                              "default 200) of 256 prompt + --max-tokens tokens through the "
                              "router for SECONDS; report errors, token-count mismatches, the "
                              "router's RSS and descriptors, the backends' KV blocks after.")
    soak_backends: int = flag(2, "--soak-backends", "rt serve --simulate backends behind the "
                              "router in --soak.", min=1, bounds=(1, MAX_SOAK_BACKENDS))

    def __post_init__(self) -> None:
        check_bounds(self)
        for streams in self.concurrency or ():
            if streams > MAX_STREAMS:
                raise ValueError(f"--concurrency must be at most {MAX_STREAMS}, got {streams}")
        if self.soak is not None and not 0 < self.soak <= 24 * 3600:
            raise ValueError(f"--soak must be in (0, 86400] seconds, got {self.soak}")
        if self.soak is not None and len(self.concurrency or ()) > 1:
            raise ValueError(f"--soak holds one --concurrency, got {self.concurrency}")


@dataclass(frozen=True, slots=True)
class FleetModelFlags:
    """`rt fleet up --model`: its replicas' `rt serve --model`."""

    model: str | None = flag(None, "--model", "As rt serve's --model (with --simulate, the "
                             "simulated model).", SERVER_PANEL, alias="--sim-model")
