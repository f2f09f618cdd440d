"""`rt bench route`: what the router adds, against direct calls to the same backend, in the
same run.

One `rt serve` backend (the command is given, e.g. `--simulate`) and one `rt route` in front
of it start on free ports of 127.0.0.1. For each concurrency, a closed loop of `concurrency`
streaming clients sends `num_requests` completions (`max_tokens` tokens each, ignore_eos)
straight to the backend, then through the router, then both again (interleaved so that drift
on a shared machine hits both alike). At concurrency 1 the two paths alternate request by
request instead (one client each; which goes first alternates too), so that the load other
processes put on the machine, which moves within seconds, hits both alike; requests/s is
then that of the path's own requests (1 / their mean duration). Per request: time to the
first SSE byte (TTFT) and to the last (E2E), client-side. The report: requests/s and
p50/p99 of both, per path, and the router's added p50/p99 (routed minus direct), and the
router process's CPU time per routed request (from /proc: a cost that, unlike added latency,
does not grow with the load other processes put on the machine; its scrapes during the
measured requests included). Every wait is bounded; both processes are always stopped.
With `soak_s`, a soak instead (`backends.route.soak`).
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
import numpy.typing as npt

from backends.bench.serve_load import free_port
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
    about: the report's head, (name, value) pairs in order (router, model, gpu).
    soak_s: instead of the above, a soak of this many seconds (`backends.route.soak`) at
        the one concurrency, in front of `soak_backends` backends.
    """

    serve_command: tuple[str, ...]
    route_command: tuple[str, ...]
    concurrencies: tuple[int, ...] = (1, 200)
    num_requests: int = 400
    max_tokens: int = 4
    rounds: int = 2
    request_timeout_s: float = 60.0
    about: tuple[tuple[str, str], ...] = ()
    soak_s: float | None = None
    soak_backends: int = 2


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
    default = (200,) if flags.soak is not None else (1, 200)
    return RouteBenchConfig(tuple(serve), tuple(route), tuple(flags.concurrency or default),
                            flags.num_requests, flags.max_tokens, flags.rounds,
                            about=(("router", router), ("model", model), ("gpu", gpu)),
                            soak_s=flags.soak, soak_backends=flags.soak_backends)


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
            timed = await _timed_request(client, url, f"{tag} request {i}", max_tokens)
            if timed is None:
                errors += 1
                continue
            ttft.append(timed[0])
            e2e.append(timed[1])

    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(
            httpx.AsyncClient(timeout=timeout_s, limits=limits, verify=tls))
            for _ in range(concurrency)]
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for client in clients))
        wall = time.perf_counter() - started
    return {"ttft": ttft, "e2e": e2e, "errors": errors, "wall_s": wall}


async def _timed_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
                         ) -> tuple[float, float] | None:
    """One streamed completion: (seconds to the first body byte, to the last), None if it
    failed."""
    body = {"prompt": f"{prompt}: the quick brown fox", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for _ in response.aiter_raw():
                first = first or time.perf_counter()
            ok = response.status_code == 200
    except httpx.HTTPError:
        ok = False
    end = time.perf_counter()
    return (first - start, end - start) if ok and first is not None else None


async def _alternating(urls: dict[str, str], num_requests: int, max_tokens: int,
                       timeout_s: float, tag: str) -> dict[str, dict[str, Any]]:
    """Concurrency 1, the paths (name -> URL) taking turns request by request: per path,
    the `_closed_loop` record, its wall time the sum of its requests' durations."""
    runs: dict[str, dict[str, Any]] = {path: {"ttft": [], "e2e": [], "errors": 0,
                                              "wall_s": 0.0} for path in urls}
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    tls = ssl.create_default_context(cafile=certifi.where())
    async with contextlib.AsyncExitStack() as stack:
        clients = {path: await stack.enter_async_context(
            httpx.AsyncClient(timeout=timeout_s, limits=limits, verify=tls)) for path in urls}
        order = list(urls)
        for i in range(num_requests):
            for path in order if i % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                timed = await _timed_request(clients[path], urls[path], f"{tag}{path} {i}",
                                             max_tokens)
                run = runs[path]
                run["wall_s"] += time.perf_counter() - start
                if timed is None:
                    run["errors"] += 1
                else:
                    run["ttft"].append(timed[0])
                    run["e2e"].append(timed[1])
    return runs


def _summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ttft = np.array([x for r in runs for x in r["ttft"]]) * 1000
    e2e = np.array([x for r in runs for x in r["e2e"]]) * 1000
    done = len(e2e)
    wall = sum(r["wall_s"] for r in runs)

    def pct(values: npt.NDArray[np.float64], q: int) -> float | None:
        return round(float(np.percentile(values, q)), 3) if len(values) else None

    return {"requests": done, "errors": sum(r["errors"] for r in runs),
            "requests_per_s": round(done / wall, 1) if wall else None,
            "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
            "e2e_ms": {"p50": pct(e2e, 50), "p99": pct(e2e, 99)}}


def _added(direct: dict[str, Any], routed: dict[str, Any]) -> dict[str, Any]:
    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    return {metric: {q: diff(direct[metric][q], routed[metric][q]) for q in ("p50", "p99")}
            for metric in ("ttft_ms", "e2e_ms")}


def _measure(config: RouteBenchConfig, concurrency: int, backend: str, router: str,
             router_pid: int) -> dict[str, Any]:
    """One concurrency's result: both paths, interleaved (the module docstring)."""
    for url in (backend, router):  # a warm-up of each path (connections, first requests)
        asyncio.run(_closed_loop(url, concurrency, concurrency, config.max_tokens,
                                 config.request_timeout_s, "warm"))
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "routed": []}
    router_cpu = 0.0
    for round_ in range(config.rounds):
        if concurrency == 1:  # request by request
            cpu = _cpu_s(router_pid)
            both = asyncio.run(_alternating({"direct": backend, "routed": router},
                                            config.num_requests, config.max_tokens,
                                            config.request_timeout_s, str(round_)))
            router_cpu += _cpu_s(router_pid) - cpu
            for path, run in both.items():
                runs[path].append(run)
            continue
        for path, url in (("direct", backend), ("routed", router)):
            cpu = _cpu_s(router_pid)
            runs[path].append(asyncio.run(_closed_loop(
                url, concurrency, config.num_requests, config.max_tokens,
                config.request_timeout_s, f"{path}{round_}")))
            router_cpu += (_cpu_s(router_pid) - cpu) if path == "routed" else 0.0
    direct, routed = _summary(runs["direct"]), _summary(runs["routed"])
    routed["router_cpu_ms_per_request"] = round(router_cpu * 1e3 / max(routed["requests"], 1),
                                                3)
    ratio = (round(routed["requests_per_s"] / direct["requests_per_s"], 3)
             if direct["requests_per_s"] and routed["requests_per_s"] else None)
    return {"concurrency": concurrency, "direct": direct, "routed": routed,
            "added_ms": _added(direct, routed), "throughput_ratio": ratio}


def run_route_bench(config: RouteBenchConfig) -> dict[str, Any]:
    """The report (see the module docstring); the backend and the router on free ports."""
    if config.soak_s is not None:
        from backends.route.soak import run_route_soak

        return run_route_soak(config)
    with _backend_and_router(config, (free_port(), free_port())) as (backend, router, pid):
        results = [_measure(config, concurrency, backend, router, pid)
                   for concurrency in config.concurrencies]
    return {"command": "rt bench route", **dict(config.about),
            "num_requests": config.num_requests, "rounds": config.rounds,
            "max_tokens": config.max_tokens, "results": results}
