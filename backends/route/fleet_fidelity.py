"""`rt fidelity --fleet`: one trace through a real fleet and through the simulated one.

The real side: `replicas` `rt serve` processes (`--simulate`: the cost model on the wall
clock) and `rt route` in front of them, all on free ports of 127.0.0.1 (`backends.route.fleet`
starts and always stops them), the trace replayed through the router by the endpoint client
(`backends.replay.endpoint`: client-side timing; each request's replica from the router's
`x-rt-replica` header, its prefix hits from `usage.prompt_tokens_details.cached_tokens`, which
`rt serve` reports). Then the router's own /metrics are read: what the simulated router does not
model by itself (`RouterOverheads`).

The simulated side is injected (backends never import sim): `simulate(overheads)` returns the
fleet simulator's result and its run.json description, given the router's measured overheads
(`RouterOverheads` as a dict) so that the simulation includes them. Writing run directories (`save`,
`analysis.rundir.save_result`) and the comparison (`compare`) are injected too.

Layout under `root`: real/ (the replay through the router), sim/ (the simulated fleet), and
whatever `compare` writes. Times are seconds.
"""

from __future__ import annotations

import contextlib
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
from runtime.router import make_policy
from workloads import Trace, trace_digest

Save = Callable[..., Any]  # (path, kind, trace identity, result, describe) -> a loaded run
# the router's overheads (a dict) -> (result, describe)
Simulate = Callable[[Mapping[str, Any]], tuple[Any, Mapping[str, Any]]]
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
class RealFleetRun:
    """The replay through the router, its run.json fields, and the router's overheads."""

    result: EndpointResult
    info: dict[str, Any]
    overheads: RouterOverheads


@contextlib.contextmanager
def running_fleet(plan: FleetFidelityPlan) -> Iterator[tuple[str, list[str]]]:
    """The replicas and the router up (yields the router's base URL and the replicas' in
    order); all stopped after, router first (it drains), whatever happens."""
    replicas: list[Replica] = []
    router: list[Replica] = []
    with tempfile.TemporaryDirectory(prefix="rt-fleet-fidelity-") as logs:
        try:
            for port in plan.ports[:-1]:
                replicas.append(Replica(plan.serve_command, port, Path(logs)))
            wait_healthy(replicas, plan.start_timeout_s)
            backends = [a for r in replicas for a in ("--backend", r.url)]
            router.append(Replica((*plan.route_command, *backends), plan.ports[-1], Path(logs)))
            wait_healthy(router, plan.start_timeout_s)
            yield router[0].url, [r.url for r in replicas]
        finally:
            stop_all(router, plan.stop_timeout_s)
            stop_all(replicas, plan.stop_timeout_s)


def replay_through_fleet(plan: FleetFidelityPlan, trace: Trace,
                         progress: Callable[[int, int], None] | None = None) -> RealFleetRun:
    """Start the fleet, replay `trace` through its router, read the router's /metrics,
    stop everything. RuntimeError (one line) when a process does not come up."""
    with running_fleet(plan) as (url, backends):
        config = EndpointConfig(url=url, **plan.endpoint)
        info = probe(config)
        result = replay_endpoint(trace, config, info, progress)
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
    overheads = parse_router_metrics(text, backends)
    fields = run_info(result, config, info)
    del fields["wall_s"]  # `save` writes the result's own
    fields["router"] = {"replicas": plan.replicas, "command": list(plan.route_command[2:]),
                        "overheads": asdict(overheads)}
    return RealFleetRun(result, fields, overheads)


def trace_identity(trace: Trace) -> dict[str, Any]:
    """run.json's trace section ({"name", "requests", "digest"})."""
    return {"name": trace.name, "requests": len(trace), "digest": trace_digest(trace)}


def run_fleet_fidelity(plan: FleetFidelityPlan, trace: Trace, root: Path, save: Save,
                       simulate: Simulate, compare: Compare,
                       progress: Callable[[int, int], None] | None = None) -> str:
    """The real fleet run (root/real), then the simulated one given the router's measured
    overheads (root/sim), then `compare`'s text. ValueError (one line) when a
    process does not come up, the router does not answer, or every request failed."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        real = replay_through_fleet(plan, trace, progress)
    except (RuntimeError, EndpointError, httpx.HTTPError) as err:
        raise ValueError(f"the real fleet: {err}") from None
    if real.result.requests and real.result.num_failed == len(real.result.requests):
        first = next(iter(real.result.errors.values()), "?")
        raise ValueError(f"every request through the router failed (first: {first})")
    save(root / "real", "endpoint", trace_identity(trace), real.result, real.info)
    result, describe = simulate(asdict(real.overheads))
    save(root / "sim", "simulate", trace_identity(trace), result, describe)
    return compare(root / "real", root / "sim", asdict(real.overheads), root)
