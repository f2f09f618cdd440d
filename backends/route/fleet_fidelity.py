"""`rt fidelity --fleet`: one trace through a real fleet and through the simulated one.

The real side: `replicas` `rt serve` processes (`--simulate`: the cost model on the wall
clock) and `rt route` in front of them, all on free ports of 127.0.0.1 (`backends.route.fleet`
starts and always stops them), the trace replayed through the router by the endpoint client
(`backends.replay.endpoint`: client-side timing; each request's replica from the router's
`x-rt-replica` header, its prefix hits from `usage.prompt_tokens_details.cached_tokens`, which
`rt serve` reports). Then the router's own /metrics are read: what the simulated router does not
model by itself (`RouterOverheads`). Before that replay, a calibration replay of other
requests (`calibration_trace`) goes through the same replicas and a router of its own: what
the twin fits the serving stack's own time on (`sim.serving_stack`). Around each replay the
replicas' /metrics are read too: where the mean TTFT goes (`stack_probe.ttft_split`).

The simulated side is injected (backends never import sim): `simulate(overheads,
calibration=...)` returns the fleet simulator's result and its run.json description, given the
router's measured overheads (`RouterOverheads` as a dict) and the calibration replay
(`CalibrationReplay`) so that the simulation includes them. Writing run directories (`save`,
`analysis.rundir.save_result`) and the comparison (`compare`) are injected too.

Layout under `root`: calibration/ (the calibration replay), real/ (the replay through the
router), sim/ (the simulated fleet), and whatever `compare` writes. Times are seconds.
"""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from backends.bench.serve_load import free_port
from backends.replay.endpoint import EndpointResult, replay_endpoint, run_info
from backends.replay.endpoint_probe import EndpointConfig, EndpointError, probe
from backends.route.fleet import Replica, flag_argv, stop_all, wait_healthy
from backends.route.overheads import RouterOverheads, parse_router_metrics
from backends.route.stack_probe import ServerTotals, parse_server_totals, ttft_split
from runtime.router import make_policy
from workloads import Trace, resample_like, trace_digest

Save = Callable[..., Any]  # (path, kind, trace identity, result, describe) -> a loaded run
# (the router's overheads (a dict), calibration=CalibrationReplay) -> (result, describe)
Simulate = Callable[..., tuple[Any, Mapping[str, Any]]]
Compare = Callable[[Path, Path, Mapping[str, Any], Path], str]  # real, sim, overheads, root


@dataclass(frozen=True, slots=True)
class FleetFidelityPlan:
    """What the real side starts and how the client replays.

    Attributes:
        serve_command: `rt serve ...` without --host/--port (appended per replica).
        route_command: `rt route ...` without --backend/--host/--port.
        ports: one per replica, then the router's.
        endpoint: `EndpointConfig` keyword arguments other than `url`.
        start_timeout_s, stop_timeout_s: bounds of the start and of each drain.
    """

    serve_command: tuple[str, ...]
    route_command: tuple[str, ...]
    ports: tuple[int, ...]
    endpoint: Mapping[str, Any]
    start_timeout_s: float = 180.0
    stop_timeout_s: float = 20.0

    @property
    def replicas(self) -> int:
        return len(self.ports) - 1


def fleet_fidelity_plan(cli: Path, policy: Any, engine: Any, model: str, gpu: str,
                        profile: Path | None, seed: int) -> FleetFidelityPlan:
    """The plan of `rt fidelity --fleet`: `cli` is rt's script (run by this interpreter);
    `policy`
    is `FleetFlags` (replicas, router, router_arg, router_refresh_ms) and `engine` the
    engine flags every replica gets; free ports of 127.0.0.1 for the replicas and router.
    ValueError (one line) for an unknown policy or a bad policy argument."""
    make_policy(policy.router, policy.router_arg or [], seed)  # bad: one line, nothing started
    rt = (sys.executable, str(cli.resolve()))
    serve = [*rt, "serve", "--simulate", "--sim-model", model, "--gpu", gpu, "--seed",
             str(seed), *flag_argv(engine)]
    serve += ["--profile", str(profile)] if profile is not None else []
    route = [*rt, "route", "--router", policy.router, "--router-refresh-ms",
             str(policy.router_refresh_ms), "--seed", str(seed)]
    for arg in policy.router_arg or []:
        route += ["--router-arg", arg]
    endpoint = {"model": None, "api_key": None, "max_concurrency": None, "timeout_s": 600.0,
                "vocab_size": 32000, "seed": seed}
    ports = tuple(free_port() for _ in range(policy.replicas + 1))
    return FleetFidelityPlan(tuple(serve), tuple(route), ports, endpoint)


@dataclass(frozen=True, slots=True)
class CalibrationReplay:
    """The replay of other requests through the same real fleet, before the measured one
    (`sim.serving_stack.MeasuredReplay`): its trace, each finished request's client-side
    TTFT (seconds, by request id) and the router's overheads during it (a dict)."""

    trace: Trace
    ttft_s: Mapping[str, float]
    overheads: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class RealFleetRun:
    """The replay through the router, its run.json fields, the router's overheads and the
    calibration replay before it (its endpoint result and run.json fields too)."""

    result: EndpointResult
    info: dict[str, Any]
    overheads: RouterOverheads
    calibration: CalibrationReplay
    calibration_result: EndpointResult
    calibration_info: dict[str, Any]


@contextlib.contextmanager
def running_replicas(plan: FleetFidelityPlan) -> Iterator[tuple[list[str], Path]]:
    """The replicas up (yields their base URLs in order and the log directory); all
    stopped after, whatever happens."""
    replicas: list[Replica] = []
    with tempfile.TemporaryDirectory(prefix="rt-fleet-fidelity-") as logs:
        try:
            for port in plan.ports[:-1]:
                replicas.append(Replica(plan.serve_command, port, Path(logs)))
            wait_healthy(replicas, plan.start_timeout_s)
            yield [r.url for r in replicas], Path(logs)
        finally:
            stop_all(replicas, plan.stop_timeout_s)


@contextlib.contextmanager
def running_router(plan: FleetFidelityPlan, backends: list[str], logs: Path
                   ) -> Iterator[str]:
    """A fresh router in front of `backends` (its counters, prefix index and policy state
    new); yields its base URL, stopped (drained) after, whatever happens."""
    router: list[Replica] = []
    try:
        args = [a for url in backends for a in ("--backend", url)]
        router.append(Replica((*plan.route_command, *args), plan.ports[-1], logs))
        wait_healthy(router, plan.start_timeout_s)
        yield router[0].url
    finally:
        stop_all(router, plan.stop_timeout_s)


def _server_totals(backends: list[str]) -> ServerTotals:
    return parse_server_totals(httpx.get(f"{url}/metrics", timeout=10.0).text
                               for url in backends)


def _mean_ttft_s(result: EndpointResult) -> float:
    ttfts = [r.first_token_s - r.arrival_s for r in result.requests
             if r.first_token_s is not None]
    return sum(ttfts) / len(ttfts) if ttfts else math.nan


def _replay_once(plan: FleetFidelityPlan, trace: Trace, backends: list[str], logs: Path,
                 token_seed: int, progress: Callable[[int, int], None] | None
                 ) -> tuple[EndpointResult, dict[str, Any], RouterOverheads]:
    """`trace` through a fresh router in front of `backends` (prompts' token ids from
    `token_seed`): the result, its run.json fields (with the router's overheads and the
    TTFT split, from the replicas' histograms over this replay) and the router's
    overheads."""
    before = _server_totals(backends)
    with running_router(plan, backends, logs) as url:
        config = EndpointConfig(url=url, **{**plan.endpoint, "seed": token_seed})
        info = probe(config)
        result = replay_endpoint(trace, config, info, progress)
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
    overheads = parse_router_metrics(text, backends)
    split = ttft_split(_mean_ttft_s(result), overheads.routing_latency_mean_s,
                       _server_totals(backends).minus(before))
    fields = run_info(result, config, info)
    del fields["wall_s"]  # `save` writes the result's own
    fields["router"] = {"replicas": plan.replicas, "command": list(plan.route_command[2:]),
                        "overheads": asdict(overheads), "ttft_split": split}
    return result, fields, overheads


def calibration_trace(trace: Trace, seed: int) -> Trace:
    """The calibration replay's trace: as many other requests as `trace`, lengths resampled
    from it, Poisson arrivals at its mean rate (`workloads.resample_like`, seed + 1)."""
    return resample_like(trace, seed + 1)


def replay_through_fleet(plan: FleetFidelityPlan, trace: Trace,
                         progress: Callable[[int, int], None] | None = None) -> RealFleetRun:
    """Start the replicas; replay a calibration trace (`calibration_trace`, its prompts'
    token ids from seed + 1, so that the replicas' prefix caches hold nothing of `trace`'s)
    through a router, then `trace` through a fresh one (the policy's state as the twin's);
    read each router's /metrics and the replicas' before and after each replay; stop
    everything. RuntimeError (one line) when a process does not come up."""
    seed = int(plan.endpoint["seed"])
    calibration = calibration_trace(trace, seed)
    with running_replicas(plan) as (backends, logs):
        c_result, c_info, c_overheads = _replay_once(plan, calibration, backends, logs,
                                                     seed + 1, progress)
        result, info, overheads = _replay_once(plan, trace, backends, logs, seed, progress)
    ttft = {r.request_id: r.first_token_s - r.arrival_s for r in c_result.requests
            if r.first_token_s is not None}
    replay = CalibrationReplay(calibration, ttft, asdict(c_overheads))
    return RealFleetRun(result, info, overheads, replay, c_result, c_info)


def trace_identity(trace: Trace) -> dict[str, Any]:
    """run.json's trace section ({"name", "requests", "digest"})."""
    return {"name": trace.name, "requests": len(trace), "digest": trace_digest(trace)}


def run_fleet_fidelity(plan: FleetFidelityPlan, trace: Trace, root: Path, save: Save,
                       simulate: Simulate, compare: Compare,
                       progress: Callable[[int, int], None] | None = None) -> str:
    """The real fleet runs (root/calibration, root/real), then the simulated one given the
    router's measured overheads and the calibration replay (root/sim), then `compare`'s
    text. ValueError (one line) when a
    process does not come up, the router does not answer, or every request failed."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        real = replay_through_fleet(plan, trace, progress)
    except (RuntimeError, EndpointError, httpx.HTTPError) as err:
        raise ValueError(f"the real fleet: {err}") from None
    if real.result.requests and real.result.num_failed == len(real.result.requests):
        first = next(iter(real.result.errors.values()), "?")
        raise ValueError(f"every request through the router failed (first: {first})")
    calibration = real.calibration
    save(root / "calibration", "endpoint", trace_identity(calibration.trace),
         real.calibration_result, real.calibration_info)
    save(root / "real", "endpoint", trace_identity(trace), real.result, real.info)
    result, describe = simulate(asdict(real.overheads), calibration=calibration)
    save(root / "sim", "simulate", trace_identity(trace), result, describe)
    return compare(root / "real", root / "sim", asdict(real.overheads), root)
