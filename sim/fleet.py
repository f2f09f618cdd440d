"""The fleet simulator: N engines behind K routers (default 1), in one SimPy environment.

    router       request i goes to router i mod K (`sim.fleet_router`), whose policy
                 (`runtime.router`) picks a replica that can ever hold the prompt, from
                 snapshots (refreshed every `refresh_s`; 0 = oracle) and its own state. It
                 reaches the replica's API server `routing_latency_s` after its arrival.
    api server   one FIFO server per replica (Lindley's recursion, as in `sim.simulator`):
                 h = max(h_prev, reached) + cost(prompt); at h the request enters the core.
    engine       per replica, the single-engine simulator's own engine loop
                 (`sim.simulator.EngineProcess`: steady decodes, decode runs), each with its
                 own scheduler, KV pool, prefix cache and cost model; `on_prefill_done` and
                 `on_finished` are called at the end of the step that produced the first
                 token or finished the request.

A snapshot is what vLLM's /metrics would show: waiting, running and KV usage as of the last
step that *ended* by the scrape time (the replica's step records), however far ahead the
replica has stepped. A replica fast-forwards plain decode runs up to its next pending
hand-over or the earliest one any unrouted request could have (a suffix minimum over the
trace of arrival + latency + API cost). With KV events, replicas publish their pools'
events at each step's (or run's) end, runs ending by the next decision minus the delay.

With one replica and no routing latency the records are those of `sim.simulator.simulate`.
"""

from __future__ import annotations

import math
import time
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Collection, Generator, Sequence
from typing import Protocol, cast

import simpy

from runtime import Request
from runtime.kv_events import KvEventLog, observe_kv_events
from runtime.records import RequestRecord
from runtime.router import ReplicaSnapshot, RouterPolicy
from sim.block_ids import TraceBlockIds, own_streams_only
from sim.cost.api_server import ApiServerCost
from sim.cost.base import CostModel
from sim.engine_args import with_noise_seed
from sim.fleet_gc import built_and_run
from sim.fleet_kv import run_before
from sim.fleet_records import (
    FleetRequestRecord,
    FleetResult,
    ReplicaSummary,
    fleet_result,
)
from sim.fleet_router import (
    KvEventBus,
    RouterReplica,
    can_ever_fit,
    common_block_size,
    earliest_handovers,
    make_routers,
    max_prompt_len,
    routing_request,
)
from sim.fleet_tokens import replica_inputs, routing_tokens
from sim.simulator import EngineProcess, Progress, SimConfig, make_request
from workloads import Trace, TraceRequest

__all__ = ["FleetRequestRecord", "FleetResult", "ReplicaSetup", "ReplicaSummary",
           "can_ever_fit", "make_request", "simulate_fleet"]


class ReplicaSetup(Protocol):
    """What one replica needs (`sim.engine_args.SimSetup` is one)."""

    @property
    def config(self) -> SimConfig: ...

    @property
    def cost_model(self) -> CostModel: ...


_NOISE_SEED_STRIDE = 0x9E3779B1  # replica i's step-noise seed: the config's + i * this


def _own_noise(config: SimConfig, index: int) -> SimConfig:
    """Replica `index`'s config with step noise of its own (GPUs vary independently);
    replica 0 keeps the config's, so one replica runs as the single-engine simulator."""
    noise = config.step_noise
    if noise is None or index == 0:
        return config
    return with_noise_seed(config, noise.seed + index * _NOISE_SEED_STRIDE)


class _Replica(EngineProcess):
    """One engine behind the router: its API server queue and the simulator's engine loop,
    reporting first tokens and finishes to the fleet when the step that produced them ends."""

    def __init__(self, fleet: _Fleet, index: int, setup: ReplicaSetup) -> None:
        super().__init__(fleet.env, _own_noise(setup.config, index), setup.cost_model,
                         fleet.block_ids)
        self.fleet = fleet
        self.index = index
        self.pending: deque[tuple[float, Request]] = deque()  # routed, not yet handed over
        self.api_free_at = 0.0  # when the API server finishes its last routed request
        self.awaiting_first: set[str] = set()  # in the core, no first token yet
        # the step ends so far, seconds (the recorder's own column: it grows in place)
        self.end_s = cast(list[float], self.core.recorder.step_columns["end_s"])
        self.columns = self.core.recorder.step_columns
        # bounds[i]: the earliest hand-over to this core of request i of the trace or a
        # later one (seconds); read at the fleet's first unrouted index, twice per step
        self.bounds = fleet.handover_bounds(self.config.api_server)
        self.ahead = fleet.steps_ahead  # fixed for the run: due hand-overs enter in take_due
        self.kv_log: KvEventLog | None = None  # the pool's KV events (`_KvReplica`)

    def hand_over(self, req: TraceRequest, prompt: array[int], output: array[int],
                  reached_s: float, max_tokens: int | None = None,
                  hashes: Sequence[bytes] = ()) -> None:
        """The request reaches this replica's API server at `reached_s` (now or later);
        `max_tokens` defaults to the trace's output length; `hashes`: its block names."""
        max_tokens = req.output_len if max_tokens is None else max_tokens
        self.core.recorder.arrived(req.request_id, reached_s, req.prompt_len, max_tokens)
        handover = self.api_handover(reached_s, req.prompt_len)
        self.outputs[req.request_id] = output
        self.pending.append((handover, self.make_request(req, prompt, max_tokens, hashes or None)))
        self.env.timeout(handover - self.env.now).callbacks.append(self._submit_head)

    def api_handover(self, reached_s: float, prompt_len: int) -> float:
        """When the API server (FIFO) hands a prompt reaching it at `reached_s` to the core."""
        handover = max(self.api_free_at, reached_s) + self.config.api_server.time(prompt_len)
        self.api_free_at = handover
        return handover

    def _submit_head(self, _: simpy.Event) -> None:
        """A hand-over is due: the oldest pending request enters the core, unless taken."""
        if self.pending and self.pending[0][0] <= self.env.now:
            handover, request = self.pending.popleft()
            self.submit(request, handover)

    def take_due(self, clock: float) -> None:
        pending = self.pending
        if not self.ahead:
            return
        while pending and pending[0][0] <= clock:
            handover, request = pending.popleft()
            self.submit(request, handover)

    def submit(self, request: Request, now: float) -> None:
        self.awaiting_first.add(request.request_id)
        super().submit(request, now)

    def horizon(self) -> float:
        earliest = self.bounds[self.fleet.next_index]
        pending = self.pending
        return min(pending[0][0], earliest) if pending else earliest

    def steps_ahead_until(self) -> float:
        # docs/fleet.md, stepping ahead: due hand-overs enter through `take_due`
        return self.bounds[self.fleet.next_index] if self.ahead else -math.inf

    def publish_kv_events(self, at_s: float) -> None:
        """Publish the pool's events since the last call as emitted at `at_s` (the end of
        the step that produced them), if anyone listens."""
        log = self.kv_log
        if log is not None and log.events:
            self.fleet.kv_bus.publish(self.index, log.take(), at_s)

    def on_step_end(self, sampled: Collection[str]) -> None:
        awaiting = self.awaiting_first
        if sampled and awaiting:
            first = [req_id for req_id in sampled if req_id in awaiting]
            awaiting.difference_update(first)
            for req_id in first:
                self.fleet.first_token(self, req_id)
        self.report_finished()

    def on_finished(self, records: list[RequestRecord]) -> None:
        for record in records:
            self.awaiting_first.discard(record.request_id)
        self.fleet.finished(self, records)

    def snapshot(self, at_s: float) -> ReplicaSnapshot:
        """The metrics as of the last step that ended by `at_s` (seconds)."""
        k = bisect_right(self.end_s, at_s) - 1
        blocks = self.config.cache.num_blocks
        if k < 0:
            return ReplicaSnapshot(replica_id=self.index, taken_at_s=at_s,
                                   num_gpu_blocks=blocks)
        columns = self.columns
        usage = min(max(float(columns["kv_usage"][k]), 0.0), 1.0)  # type: ignore[arg-type]
        return ReplicaSnapshot(
            replica_id=self.index, taken_at_s=at_s,
            num_waiting=columns["num_waiting"][k],  # type: ignore[arg-type]
            num_running=columns["num_running"][k],  # type: ignore[arg-type]
            kv_usage=usage, num_gpu_blocks=blocks)


class _KvReplica(_Replica):
    """A replica whose pool's KV events a router reads: each step and decode run publishes
    them at its end, and runs end by the next decision minus the delay (`sim.fleet_kv`)."""

    def __init__(self, fleet: _Fleet, index: int, setup: ReplicaSetup) -> None:
        super().__init__(fleet, index, setup)
        self.kv_log = observe_kv_events(self.core.scheduler.kv_cache_manager.block_pool)

    def fast_forward(self, clock: float) -> float | None:
        end = run_before(self, clock, self.horizon(), self.fleet.kv_run_limit_s())
        if end is not None:
            self.publish_kv_events(end)
        return end

    def one_step(self, clock: float) -> tuple[float, dict[str, list[int]]]:
        end, sampled = super().one_step(clock)
        self.publish_kv_events(end)
        return end, sampled


_ROUTE_AHEAD_S = 10.0  # snapshot-blind routing ahead, s (routed requests hold their tokens)


class _Fleet:
    # Route (and step) ahead, docs/fleet.md: same records, fewer cut runs. Off where choices
    # read replica state at the arrival (P/D, the autoscaler's serving set).
    routes_ahead = True

    def __init__(self, trace: Trace, setups: Sequence[ReplicaSetup],
                 policy: RouterPolicy | Sequence[RouterPolicy], refresh_s: float,
                 routing_latency_s: float, progress: Progress | None,
                 kv_event_delay_s: float = 0.0,
                 extra_routers: Sequence[RouterReplica] = ()) -> None:
        """`extra_routers`: routers taking no arrivals of their own (P/D's prefill router)
        that are fed KV events too."""
        if not setups:
            raise ValueError("a fleet needs at least one replica, got 0")
        if not (routing_latency_s >= 0.0 and math.isfinite(routing_latency_s)):
            raise ValueError(f"routing_latency_s must be a finite number >= 0, "
                             f"got {routing_latency_s}")
        self.trace = trace
        self.routers = make_routers(policy, refresh_s, kv_event_delay_s)
        self.policy = self.routers[0].policy
        self.router_of: dict[str, int] = {}  # request id -> its router (with several)
        self.kv_bus = KvEventBus([r.kv_events for r in (*self.routers, *extra_routers)
                                  if r.kv_events is not None])
        self.kv_block_size = (common_block_size([s.config.cache for s in setups])
                              if self.kv_bus else None)
        self.latency_s = routing_latency_s
        self.kv_delay_s = kv_event_delay_s
        self.progress = progress
        self.done = 0
        self.env = simpy.Environment()
        self.block_ids = TraceBlockIds(own_streams_only(trace))  # every replica's and router's
        self.next_index = 0  # the first request not yet routed
        self.steps_ahead = (self.routes_ahead and not self.kv_bus  # docs/fleet.md
                            and all(r.policy.completion_blind for r in self.routers))
        # per API cost: suffix minima of arrival + latency + cost(prompt) over the trace
        # (`handover_bounds`; replicas of one pool share their list)
        self._bounds: dict[ApiServerCost, list[float]] = {}
        kind = _KvReplica if self.kv_bus else _Replica
        self.replicas = [kind(self, i, setup) for i, setup in enumerate(setups)]
        self.serving = [True] * len(setups)  # takes new requests (an autoscaler changes it)
        # the longest prompt every replica can ever hold (candidates: all, when serving)
        self._fits_all = min(max_prompt_len(r.config) for r in self.replicas)
        # snapshot-blind routers read only the replicas' ids: one fixed set of snapshots
        self._blind_snapshots = tuple(
            ReplicaSnapshot(replica_id=r.index, taken_at_s=0.0,
                            num_gpu_blocks=r.config.cache.num_blocks) for r in self.replicas
        ) if self.routes_ahead and all(r.policy.snapshot_blind for r in self.routers) else None
        self.token_blind = not any(r.policy.reads_token_ids for r in self.routers)

    def run(self) -> None:
        self.start_processes()
        self.env.run()

    def start_processes(self) -> None:
        self.env.process(self.router())
        for replica in self.replicas:
            self.env.process(replica.engine())

    def kv_run_limit_s(self) -> float:
        """The next routing decision minus the KV-event delay (`sim.fleet_kv`), seconds."""
        i = self.next_index
        return (self.trace[i].arrival_s if i < len(self.trace) else math.inf) - self.kv_delay_s

    def handover_bounds(self, api: ApiServerCost) -> list[float]:
        """bounds[i]: the earliest time request i of the trace or a later one could be
        handed over to a core whose API server costs `api` (seconds; inf past the last);
        at `next_index`, the earliest any request not yet routed could."""
        bounds = self._bounds.get(api)
        if bounds is None:
            bounds = self._bounds[api] = earliest_handovers(self.trace, self.latency_s, api)
        return bounds

    def router(self) -> Generator[simpy.Event, object, None]:
        policies = [r.policy for r in self.routers]
        ahead = self.routes_ahead and all(p.completion_blind for p in policies)
        at_once = ahead and all(p.snapshot_blind for p in policies)
        routers = self.routers
        for i, req in enumerate(self.trace):
            at = req.arrival_s
            if at_once:  # decided from the dispatches before it only
                at -= _ROUTE_AHEAD_S
            elif ahead:  # decided once the metrics its snapshot reads are final
                at = routers[i % len(routers)].refresh.last_tick(at)
            if at > self.env.now:
                yield self.env.timeout(at - self.env.now)
            self.route(req)
            self.next_index = i + 1

    def router_for(self, req: TraceRequest) -> RouterReplica:
        """The router replica taking the request being routed (round-robin by arrival),
        its KV events delivered up to now."""
        router = self.routers[self.next_index % len(self.routers)]
        if len(self.routers) > 1:
            self.router_of[req.request_id] = router.index
        router.deliver_kv_events(req.arrival_s)
        return router

    def route(self, req: TraceRequest) -> None:
        now = req.arrival_s
        first = self.replicas[0]
        prompt, output, known, placeholders = routing_tokens(first, req, self.kv_block_size,
                                                             self.token_blind)
        router = self.router_for(req)
        snapshots = self.snapshots(now, router)
        serving = self.serving
        candidates: Sequence[ReplicaSnapshot] = snapshots
        if req.prompt_len > self._fits_all or False in serving:
            candidates = [snapshots[r.index] for r in self.replicas
                          if serving[r.index] and can_ever_fit(r.config, req.prompt_len)] or [
                              snapshots[r.index] for r in self.replicas if serving[r.index]]
        routing = routing_request(req, prompt, self.kv_block_size, known)
        replica = self.replicas[router.policy.route(routing, candidates).replica]
        prompt, output, hashes = replica_inputs(replica, first.config, req, prompt, output,
                                                placeholders, routing.block_hashes)
        replica.hand_over(req, prompt, output, now + self.latency_s, hashes=hashes)

    def snapshots(self, now: float, router: RouterReplica | None = None
                  ) -> Sequence[ReplicaSnapshot]:
        """Every replica's snapshot as of `router`'s (default: the first router's) last
        scrape tick at or before `now` (fixed ones when every router is snapshot-blind)."""
        if self._blind_snapshots is not None:
            return self._blind_snapshots
        refresh = (router or self.routers[0]).refresh
        if refresh.due(now):
            tick = refresh.last_tick(now)
            refresh.store([r.snapshot(tick) for r in self.replicas], now)
        return refresh.snapshots

    def policy_of(self, request_id: str) -> RouterPolicy:
        """The policy of the router that routed the request."""
        if len(self.routers) == 1:
            return self.policy
        return self.routers[self.router_of[request_id]].policy

    def first_token(self, replica: _Replica, request_id: str) -> None:
        """`replica` produced the request's first token (at the end of the current step)."""
        self.policy_of(request_id).on_prefill_done(request_id)

    def finished(self, replica: _Replica, records: list[RequestRecord]) -> None:
        """`replica` finished these requests (at the end of the current step)."""
        for record in records:
            self.policy_of(record.request_id).on_finished(record.request_id)
        self.count_done(len(records))

    def count_done(self, count: int) -> None:
        self.done += count
        if self.progress is not None:
            self.progress(self.done, len(self.trace))

    def result(self, wall_s: float) -> FleetResult:
        return fleet_result(self.trace, [(r.index, r.core) for r in self.replicas], wall_s,
                            self.router_of if len(self.routers) > 1 else None)


def simulate_fleet(trace: Trace, replicas: Sequence[ReplicaSetup],
                   policy: RouterPolicy | Sequence[RouterPolicy], refresh_s: float = 0.05,
                   routing_latency_s: float = 0.0, progress: Progress | None = None,
                   kv_event_delay_s: float = 0.0) -> FleetResult:
    """Run the trace through `replicas` behind `policy` to completion (every request ends
    finished or ignored).

    Args:
        replicas: one setup per replica (its `SimConfig` and cost model); replica i is
            `replica_id` i in the router's snapshots and the records' `replica` column.
        policy: a fresh policy (`runtime.router.make_policy`), or one per router replica
            (`sim.fleet_router`: requests spread round-robin, rows name their `router`);
            the run updates their state.
        refresh_s: seconds between metric scrapes (0: every decision sees the current
            metrics).
        routing_latency_s: seconds from arrival to reaching the chosen replica.
        progress: called as (requests finished, requests in the trace).
        kv_event_delay_s: seconds from a step's end to its KV events reaching the routers
            whose policy scores with them.
    """
    started = time.perf_counter()

    def run(fleet: _Fleet) -> FleetResult:
        fleet.run()
        return fleet.result(time.perf_counter() - started)

    return built_and_run(lambda: _Fleet(trace, replicas, policy, refresh_s, routing_latency_s,
                                        progress, kv_event_delay_s), run)
