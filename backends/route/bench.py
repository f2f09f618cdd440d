"""`rt bench route`: what the router adds, against direct calls to the same backend, in the
same run.

One `rt serve` backend (the command is given, e.g. `--simulate`) and one `rt route` in front
of it start on free ports of 127.0.0.1. For each concurrency, a closed loop of `concurrency`
streaming clients sends `num_requests` completions (`max_tokens` tokens each, ignore_eos)
straight to the backend, then through the router, then both again (interleaved so that drift
on a shared machine hits both alike). Per request: time to the first SSE byte (TTFT) and to
the last (E2E), client-side. The report: requests/s and p50/p99 of both, per path, and the
router's added p50/p99 (routed minus direct), and the router process's CPU time per routed
request (from /proc: a cost that, unlike added latency, does not grow with the load other
processes put on the machine). Every wait is bounded; both processes are always stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import ssl
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import certifi
import httpx
import numpy as np

from backends.route.flags import RouteBenchFlags
from backends.route.fleet import Replica, stop_all, wait_healthy


@dataclass(frozen=True, slots=True)
class RouteBenchConfig:
    """Attributes:
    serve_command: `rt serve ...` without --host/--port.
    route_command: `rt route ...` without --backend/--host/--port.
    concurrencies: closed-loop client counts, one measurement each.
    num_requests: per path and round.
    max_tokens: output tokens per request.
    rounds: direct-then-routed rounds per concurrency.
    """

    serve_command: tuple[str, ...]
    route_command: tuple[str, ...]
    concurrencies: tuple[int, ...] = (1, 200)
    num_requests: int = 400
    max_tokens: int = 4
    rounds: int = 2
    request_timeout_s: float = 60.0


def route_bench_config(rt: Sequence[str], model: str, gpu: str, profile: str | None,
                       seed: int, router: str, router_args: Sequence[str], refresh_ms: float,
                       flags: RouteBenchFlags) -> RouteBenchConfig:
    """The run `rt bench route` asks for: `rt serve --simulate` of `model` on `gpu` (4096
    tokens at most per sequence) behind `rt route` with the policy; `rt` is the command line
    that starts rt (python and cli.py)."""
    serve = [*rt, "serve", "--simulate", "--sim-model", model, "--gpu", gpu, "--seed",
             str(seed), "--max-model-len", "4096"]
    serve += ["--profile", str(profile)] if profile else []
    route = [*rt, "route", "--router", router, "--seed", str(seed), "--router-refresh-ms",
             str(refresh_ms)]
    for arg in router_args:
        route += ["--router-arg", arg]
    return RouteBenchConfig(tuple(serve), tuple(route), tuple(flags.concurrency or (1, 200)),
                            flags.num_requests, flags.max_tokens, flags.rounds)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far (Linux /proc; NaN
    elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _backend_and_router(config: RouteBenchConfig, ports: tuple[int, int]
                        ) -> Iterator[tuple[str, str, int]]:
    started: list[Replica] = []
    with tempfile.TemporaryDirectory(prefix="rt-bench-route-") as logs:
        try:
            started.append(Replica(config.serve_command, ports[0], Path(logs)))
            wait_healthy(started, 180)
            command = (*config.route_command, "--backend", started[0].url)
            started.append(Replica(command, ports[1], Path(logs)))
            wait_healthy(started, 60)
            yield started[0].url, started[1].url, started[1].proc.pid
        finally:
            stop_all(list(reversed(started)), 20)


async def _closed_loop(url: str, concurrency: int, num_requests: int, max_tokens: int,
                       timeout_s: float, tag: str) -> dict[str, Any]:
    """`concurrency` workers, each with its own one-connection client (one shared pool
    would cost the client O(connections^2) per request: httpcore's pool bookkeeping),
    sending requests until `num_requests` are done."""
    ttft: list[float] = []
    e2e: list[float] = []
    errors = 0
    counter = iter(range(num_requests))
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    tls = ssl.create_default_context(cafile=certifi.where())  # loaded once, not per client

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        for i in counter:
            body = {"prompt": f"{tag} request {i}: the quick brown fox",
                    "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            start = time.perf_counter()
            first = None
            try:
                async with client.stream("POST", f"{url}/v1/completions",
                                         json=body) as response:
                    async for _ in response.aiter_raw():
                        first = first or time.perf_counter()
                    ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            end = time.perf_counter()
            if not ok or first is None:
                errors += 1
                continue
            ttft.append(first - start)
            e2e.append(end - start)

    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(
            httpx.AsyncClient(timeout=timeout_s, limits=limits, verify=tls))
            for _ in range(concurrency)]
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for client in clients))
        wall = time.perf_counter() - started
    return {"ttft": ttft, "e2e": e2e, "errors": errors, "wall_s": wall}


def _summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ttft = np.array([x for r in runs for x in r["ttft"]]) * 1000
    e2e = np.array([x for r in runs for x in r["e2e"]]) * 1000
    done = len(e2e)
    wall = sum(r["wall_s"] for r in runs)
    pct = lambda a, q: round(float(np.percentile(a, q)), 3) if len(a) else None  # noqa: E731
    return {"requests": done, "errors": sum(r["errors"] for r in runs),
            "requests_per_s": round(done / wall, 1) if wall else None,
            "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
            "e2e_ms": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)}}


def _added(direct: dict[str, Any], routed: dict[str, Any]) -> dict[str, Any]:
    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    return {metric: {q: diff(direct[metric][q], routed[metric][q]) for q in ("p50", "p99")}
            for metric in ("ttft_ms", "e2e_ms")}


def run_route_bench(config: RouteBenchConfig, ports: tuple[int, int]) -> dict[str, Any]:
    """The report (see the module docstring)."""
    results = []
    with _backend_and_router(config, ports) as (backend, router, router_pid):
        for concurrency in config.concurrencies:
            # a warm-up of each path (connections, first-request costs), not measured
            for url in (backend, router):
                asyncio.run(_closed_loop(url, concurrency, concurrency, config.max_tokens,
                                         config.request_timeout_s, "warm"))
            runs: dict[str, list[dict[str, Any]]] = {"direct": [], "routed": []}
            router_cpu = 0.0
            for round_ in range(config.rounds):
                for path, url in (("direct", backend), ("routed", router)):
                    cpu = _cpu_s(router_pid)
                    runs[path].append(asyncio.run(_closed_loop(
                        url, concurrency, config.num_requests, config.max_tokens,
                        config.request_timeout_s, f"{path}{round_}")))
                    router_cpu += (_cpu_s(router_pid) - cpu) if path == "routed" else 0.0
            direct, routed = _summary(runs["direct"]), _summary(runs["routed"])
            # the router's own CPU per routed request (its scrapes in those rounds too): a
            # cost that does not depend on how loaded the machine is, unlike added latency
            routed["router_cpu_ms_per_request"] = round(
                router_cpu * 1e3 / max(routed["requests"], 1), 3)
            results.append({"concurrency": concurrency, "direct": direct, "routed": routed,
                            "added_ms": _added(direct, routed),
                            "throughput_ratio": round(routed["requests_per_s"]
                                                      / direct["requests_per_s"], 3)
                            if direct["requests_per_s"] and routed["requests_per_s"]
                            else None})
    return {"num_requests": config.num_requests, "rounds": config.rounds,
            "max_tokens": config.max_tokens, "results": results}
