"""`rt fidelity --fleet`: one trace through a real fleet and through the simulated one.

The real side: `replicas` `rt serve` processes (`--simulate`: the cost model on the wall
clock) and `rt route` in front of them, all on free ports of 127.0.0.1 (`backends.route.fleet`
starts and always stops them), the trace replayed through the router by the endpoint client
(`backends.replay.endpoint`: client-side timing; each request's replica from the router's
`x-rt-replica` header, its prefix hits from `usage.prompt_tokens_details.cached_tokens`, which
`rt serve` reports). Then the router's own /metrics are read: what the simulated router does not
model by itself (`RouterOverheads`). Around that replay, two calibration windows of other
requests (`calibration_windows`: one before, one after; the same requests, other prompt
tokens) go through the same replicas, each through a router of its own: what the twin fits
the serving stack's own time on (`sim.serving_stack`), pooled, so that a machine that
drifts or has a burst of load during the run weighs on the fit from both sides of the
measured replay, and what it measures its noise floor on (one window's fit predicting the
other: they differ by the machine only). Around each replay the replicas'
/metrics are read too: where the mean TTFT goes (`stack_probe.ttft_split`).

The simulated side is injected (backends never import sim): `simulate(overheads,
calibration=...)` returns the fleet simulator's result and its run.json description, given the
router's measured overheads (`RouterOverheads` as a dict) and the calibration windows
(`CalibrationReplay`s, in replay order) so that the simulation includes them. The run's
output (progress bars, run directories, exit status) is the caller's `RunOutput`; the
comparison (`compare`) is injected too. Ctrl-C during a replay writes the replays so far
and exits 130, every process stopped; a replica whose /metrics cannot be read leaves the
TTFT split NaN, named, and a router whose /metrics cannot be read its overheads (the run
goes on).

Layout under `root`: calibration/ and calibration-after/ (the calibration windows), real/
(the measured replay through the router), sim/ (the simulated fleet), and whatever `compare`
writes. Times are seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from backends.bench.serve_load import free_port
from backends.heap import frozen_heap
from backends.replay.endpoint import EndpointResult, replay_endpoint, run_info
from backends.replay.endpoint_probe import EndpointConfig, EndpointError, own_get, probe
from backends.replay.run_output import INTERRUPTED, RunOutput
from backends.route.fleet import (
    Replica,
    check_loopback_replicas,
    flag_argv,
    stop_all,
    wait_healthy,
)
from backends.route.overheads import RouterOverheads, parse_router_metrics, unread_overheads
from backends.route.stack_probe import ServerTotals, parse_server_totals, ttft_split
from runtime.records import ttft_by_request
from runtime.router import make_policy
from workloads import Trace, resample_like, trace_digest

# (the router's overheads (a dict), calibration=(CalibrationReplay, ...)) -> (result, describe)
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
    check_loopback_replicas(policy.replicas)
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
    """A calibration window: a replay of other requests through the same real fleet,
    before or after the measured one (`sim.serving_stack.MeasuredReplay`): its trace, each
    finished request's client-side TTFT (seconds, by request id) and the router's overheads
    during it (a dict)."""

    trace: Trace
    ttft_s: Mapping[str, float]
    overheads: Mapping[str, Any]


# one replay: its result, its run.json fields and the router's overheads during it
Replayed = tuple[EndpointResult, dict[str, Any], RouterOverheads]


@dataclass(frozen=True, slots=True)
class RealFleetRun:
    """The replays through the fleet by run-directory name (`REPLAYS`: each's result,
    run.json fields and router overheads) and their traces; the measured one is "real"."""

    replays: Mapping[str, Replayed]
    traces: Mapping[str, Trace]

    @property
    def result(self) -> EndpointResult:
        return self.replays["real"][0]

    @property
    def overheads(self) -> RouterOverheads:
        return self.replays["real"][2]

    @property
    def calibration(self) -> tuple[CalibrationReplay, ...]:
        """The calibration windows, in replay order (before, then after the measured one)."""
        return tuple(CalibrationReplay(self.traces[name], ttft_by_request(result.requests),
                                       asdict(overheads))
                     for name, (result, _, overheads) in self.replays.items()
                     if name != "real")


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


# every part unknown (NaN)
_UNREAD = ServerTotals(**{f.name: math.nan for f in dataclasses.fields(ServerTotals)})


def _server_totals(backends: list[str], failed: list[str]) -> ServerTotals:
    """The replicas' summed histograms; NaN ones, and the failure (naming the replica)
    appended to `failed`, when a replica's /metrics cannot be read (it died)."""
    texts = []
    for url in backends:
        try:
            texts.append(own_get(f"{url}/metrics").text)
        except httpx.HTTPError as err:
            failed.append(f"{url}/metrics: {err}")
            return _UNREAD
    return parse_server_totals(texts)


def _json_number(value: float) -> float | None:
    return None if math.isnan(value) else value  # JSON has no NaN: null


def _mean_ttft_s(result: EndpointResult) -> float:
    ttfts = ttft_by_request(result.requests)
    return sum(ttfts.values()) / len(ttfts) if ttfts else math.nan


def _router_overheads(url: str, backends: list[str]) -> tuple[RouterOverheads, str | None]:
    """The router's overheads from its /metrics, and None; when they cannot be read or
    parsed, every figure NaN and the failure (naming the URL)."""
    try:
        response = own_get(f"{url}/metrics")
        response.raise_for_status()
        return parse_router_metrics(response.text, backends), None
    except (httpx.HTTPError, ValueError) as err:
        return unread_overheads(len(backends)), f"{url}/metrics: {err}"


def _json_overheads(overheads: RouterOverheads) -> dict[str, Any]:
    """`overheads` as run.json's fields (NaN as null)."""
    return {k: [_json_number(x) for x in v] if isinstance(v, tuple) else _json_number(v)
            for k, v in asdict(overheads).items()}


def _replay_once(plan: FleetFidelityPlan, trace: Trace, backends: list[str], logs: Path,
                 token_seed: int, progress: Callable[[int, int], None] | None
                 ) -> tuple[EndpointResult, dict[str, Any], RouterOverheads]:
    """`trace` through a fresh router in front of `backends` (prompts' token ids from
    `token_seed`): the result, its run.json fields (with the router's overheads and the
    TTFT split, from the replicas' histograms over this replay) and the router's
    overheads."""
    failed: list[str] = []
    before = _server_totals(backends, failed)
    with running_router(plan, backends, logs) as url:
        config = EndpointConfig(url=url, **{**plan.endpoint, "seed": token_seed})
        info = probe(config)
        with frozen_heap():  # no old-generation collection of the start-up heap mid-replay
            result = replay_endpoint(trace, config, info, progress)
        overheads, unread = _router_overheads(url, backends)
    split = ttft_split(_mean_ttft_s(result), overheads.routing_latency_mean_s,
                       _server_totals(backends, failed).minus(before))
    fields = run_info(result, config, info)
    del fields["wall_s"]  # `save` writes the result's own
    fields["router"] = {"replicas": plan.replicas, "command": list(plan.route_command[2:]),
                        "overheads": _json_overheads(overheads),
                        "ttft_split": {k: _json_number(v) for k, v in split.items()}}
    if unread is not None:  # the overheads unknown: NaN (null), and why
        fields["router"]["overheads_not_measured"] = unread
    if failed:  # the split unknown: NaN (null), and why
        fields["router"]["ttft_split_not_measured"] = failed[0]
    return result, fields, overheads


def calibration_trace(trace: Trace, seed: int) -> Trace:
    """The calibration replays' trace: as many other requests as `trace`, lengths resampled
    from it, Poisson arrivals at its mean rate (`workloads.resample_like`, seed + 1)."""
    return resample_like(trace, seed + 1)


# The replays in their order, by run-directory name: a calibration window before the
# measured replay, the measured one, a calibration window after it.
REPLAYS = ("calibration", "real", "calibration-after")


def calibration_windows(trace: Trace, seed: int) -> tuple[Trace, Trace]:
    """The two calibration windows: the same requests, the first ceil(n / 2) of
    `calibration_trace` by arrival, one replayed before the measured replay and one after
    it (other prompt tokens: `_replay_traces`), so that a drift or a burst of load of the
    machine falls on the fit from both sides (as `rt fidelity --repeats` interleaves C R R
    C) and the two windows differ by the machine only. Why the same requests: a request's
    stack time depends on the request (its length, its neighbours' timing; reproducible
    across runs), and two halves of one resampled trace differ by chance (fid15c's seed-0
    halves: mean prompt 991 against 1186 tokens, the second half's real - twin TTFT +0.4 ms
    over the first's when both ran before the measured replay; docs/route.md)."""
    whole = calibration_trace(trace, seed)
    half = whole.requests[:(len(whole) + 1) // 2]
    return Trace(half, f"{whole.name}:before"), Trace(half, f"{whole.name}:after")


def _replay_traces(trace: Trace, seed: int) -> dict[str, tuple[Trace, int]]:
    """Each replay of `REPLAYS`: its trace and its prompts' token seed (the windows' seed
    + 1 and + 2, so that the replicas' prefix caches hold nothing of `trace`'s nor of the
    other window's)."""
    before, after = calibration_windows(trace, seed)
    replays = zip(REPLAYS, ((before, seed + 1), (trace, seed), (after, seed + 2)), strict=True)
    return dict(replays)


class ReplayInterrupted(Exception):  # noqa: N818 (an outcome, not an error)
    """Ctrl-C cut a replay short: the replays so far, the cut one last (`RealFleetRun`)."""

    def __init__(self, done: RealFleetRun) -> None:
        super().__init__("interrupted")
        self.done = done


class ReplayFailed(Exception):
    """A replay could not run (a router did not come up, or did not answer): the replays
    finished before it (`RealFleetRun`), and why, one line."""

    def __init__(self, done: RealFleetRun, why: Exception) -> None:
        super().__init__(str(why))
        self.done = done


def replay_through_fleet(plan: FleetFidelityPlan, trace: Trace, out: RunOutput | None = None
                         ) -> RealFleetRun:
    """Start the replicas; replay the first calibration window (`calibration_windows`),
    `trace`, then the second window, each through a fresh router (the policy's state as the
    twin's) under a progress bar of `out`'s; read each router's /metrics and the replicas'
    before and after each replay; stop everything. RuntimeError (one line) when a process
    does not come up; `ReplayInterrupted` after a replay Ctrl-C cut short (the later ones
    not started); `ReplayFailed` when a replay's router fails (the later ones not started)."""
    replays = _replay_traces(trace, int(plan.endpoint["seed"]))
    done: dict[str, Replayed] = {}
    with running_replicas(plan) as (backends, logs):
        for name, (replayed, token_seed) in replays.items():
            try:
                with (contextlib.nullcontext(None) if out is None
                      else out.progress(_LABELS[name], len(replayed))) as update:
                    done[name] = _replay_once(plan, replayed, backends, logs, token_seed,
                                              update)
            except (RuntimeError, EndpointError, httpx.HTTPError) as err:
                raise ReplayFailed(RealFleetRun(done, _traces(replays)), err) from None
            if done[name][0].interrupted:
                raise ReplayInterrupted(RealFleetRun(done, _traces(replays)))
    return RealFleetRun(done, _traces(replays))


_LABELS = {"calibration": "calibration replay (before) through the router",
           "real": "real replay through the router",
           "calibration-after": "calibration replay (after) through the router"}


def _traces(replays: Mapping[str, tuple[Trace, int]]) -> dict[str, Trace]:
    return {name: replayed for name, (replayed, _) in replays.items()}


def trace_identity(trace: Trace) -> dict[str, Any]:
    """run.json's trace section ({"name", "requests", "digest"})."""
    return {"name": trace.name, "requests": len(trace), "digest": trace_digest(trace)}


def _save(out: RunOutput, root: Path, name: str, trace: Trace, result: Any,
          info: dict[str, Any]) -> None:
    """Replay `name` as root/name (`result`: an `EndpointResult`, which has what
    `RunOutput.save` reads of a `RunResult`), and a note when its TTFT split is unknown."""
    out.save(root / name, "endpoint", trace_identity(trace), result, info)
    if "ttft_split_not_measured" in info["router"]:
        out.say(f"note: {name}/: the TTFT split is not measured (NaN): "
                f"{info['router']['ttft_split_not_measured']}")
    unread = info["router"].get("overheads_not_measured")
    if unread is not None:
        out.say(f"note: {name}/: the router's overheads are not measured (NaN; the twin "
                "takes the other replay's, else assumes no routing latency and the flag's "
                f"refresh): {unread}")


def run_fleet_fidelity(plan: FleetFidelityPlan, trace: Trace, root: Path, out: RunOutput,
                       simulate: Simulate, compare: Compare) -> str:
    """The real fleet runs (root/calibration, root/real, root/calibration-after), then the
    simulated one given the router's measured overheads and the calibration windows
    (root/sim), then `compare`'s text; `out` shows progress, writes the run directories and
    ends the command. ValueError (one line) when a process does not come up, the router
    does not answer (the replays finished before it written), or every request of the
    measured replay failed. Ctrl-C during a replay: the replays so far written, exit 130."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        real = replay_through_fleet(plan, trace, out)
    except ReplayInterrupted as cut:
        _save_replays(out, root, cut.done)
        out.say(INTERRUPTED)
        out.exit(130)
    except ReplayFailed as failed:
        _save_replays(out, root, failed.done)
        raise ValueError(f"the real fleet: {failed}") from None
    except (RuntimeError, EndpointError, httpx.HTTPError) as err:
        raise ValueError(f"the real fleet: {err}") from None
    _save_replays(out, root, real)
    if real.result.requests and real.result.num_failed == len(real.result.requests):
        first = next(iter(real.result.errors.values()), "?")
        raise ValueError(f"every request through the router failed (first: {first})")
    result, describe = simulate(asdict(real.overheads), calibration=real.calibration)
    out.save(root / "sim", "simulate", trace_identity(trace), result, describe)
    return compare(root / "real", root / "sim", asdict(real.overheads), root)


def _save_replays(out: RunOutput, root: Path, run: RealFleetRun) -> None:
    for name, (result, info, _) in run.replays.items():
        _save(out, root, name, run.traces[name], result, info)
