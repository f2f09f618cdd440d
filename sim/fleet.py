"""The fleet simulator: N engines behind K routers (default 1), in one SimPy environment.

    router       request i goes to router i mod K (`sim.fleet_router`), whose policy
                 (`runtime.router`) picks a replica that can ever hold the prompt, from
                 snapshots (refreshed every `refresh_s`; 0 = oracle) and its own state. It
                 reaches the replica's API server `routing_latency_s` after its arrival.
    api server   one FIFO server per replica (Lindley's recursion, as in `sim.simulator`):
                 h = max(h_prev, reached) + cost(prompt); at h the request enters the core,
                 or, given a serving stack's delay d per request (`stack_delay_s`), at
                 h + d: a plain delay after the routing decision, not queued (requests
                 may enter the core in another order than they were routed).
    engine       per replica, the single-engine simulator's own engine loop
                 (`sim.simulator.EngineProcess`: steady decodes, decode runs), each with its
                 own scheduler, KV pool, prefix cache and cost model; `on_prefill_done` and
                 `on_finished` are called at the end of the step that produced the first
                 token or finished the request (pre-routed replicas, below: both at the
                 end of the step that finished it, as nothing reads them sooner).

A snapshot is what vLLM's /metrics would show: waiting, running and KV usage as of the last
step that *ended* by the scrape time (the replica's step records), however far ahead the
replica has stepped. A replica fast-forwards plain decode runs up to its next pending
hand-over or the earliest one any unrouted request could have (a suffix minimum over the
trace of arrival + latency + API cost); behind routers that read completions but no
snapshots nor KV events, a replica with nothing routed to it waiting sleeps through a run
that only a request routed to it could cut, until its end or that routing
(`Replica.sleep_through_run`). With KV events, replicas publish their pools' events at each
step's (or run's) end, runs ending by the next decision minus the delay.

When no router reads snapshots, completions or token ids (round-robin, random, session
hashing), the whole trace is routed before any step and each replica runs its share to the
end in turn (`sim.fleet_replica.PreRoutedReplica`). With one replica and no routing latency
the records are those of `sim.simulator.simulate` (a pre-routed replica takes requests in
when `simulate`'s sleeping API server would wake, `sim.api_server.server_wake`). Nothing
passes between such replicas: with `workers` > 1 they run in that many forked processes,
each a contiguous range of replicas (`sim.fleet_workers`), with the same records. Behind
routers that read only completions, as in-flight counts (least-outstanding, power-of-two,
sglang-cache-aware), `workers` > 1 processes run in lockstep (`sim.fleet_lockstep`): this one
routes and simulates the first group of replicas, a forked child each other group, meeting
at every routing decision; the same records too.
"""

from __future__ import annotations

import math
import time
from array import array
from bisect import bisect_left
from collections.abc import Generator, Mapping, Sequence
from functools import cached_property, partial
from typing import cast

import simpy

from runtime import KVCacheBlock
from runtime.records import RequestRecord, new_step_columns
from runtime.router import ReplicaSnapshot, RouterPolicy, RoutingRequest
from sim.api_server import deliver_to_clients
from sim.block_ids import TraceBlockIds
from sim.cost.api_server import ApiServerCost
from sim.fleet_lockstep import Peers, hears_counts_only, run_lockstep
from sim.fleet_records import (
    FleetRequestRecord,
    FleetResult,
    ReplicasOutcome,
    ReplicaSummary,
    assembled_result,
    replicas_outcome,
)
from sim.fleet_replica import KvReplica, PreRoutedReplica, Replica, ReplicaSetup
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
from sim.fleet_workers import can_fork, run_forked, worker_ranges
from sim.router_keys import router_keys_for
from sim.run_gc import release_pools, run_with_gc
from sim.simulator import Progress, make_request
from workloads import Trace, TraceRequest

__all__ = ["FleetRequestRecord", "FleetResult", "Replica", "ReplicaSetup", "ReplicaSummary",
           "can_ever_fit", "make_request", "pre_routable", "runs_in_lockstep", "simulate_fleet"]


_ROUTE_AHEAD_S = 10.0  # snapshot-blind routing ahead, s (routed requests hold their tokens)


class _Fleet:
    # Route (and step) ahead, docs/fleet.md: same records, fewer cut runs. Off where choices
    # read replica state at the arrival (P/D, the autoscaler's serving set).
    routes_ahead = True
    # Replicas sleep through runs nobody routed can cut (docs/fleet.md), where routers read
    # completions but neither snapshots nor KV events (least-outstanding, ...).
    sleeps_through_runs_allowed = True
    # Every replica serves throughout (an autoscaler's fleet changes `serving`): a prompt
    # every replica can hold has them all as candidates, without reading `serving`.
    serving_fixed = True
    # `route` gives prefix-hashing routers the trace's block keys where it can
    # (`sim.router_keys`); P/D's own routing hashes token ids.
    gives_prefix_keys = True

    def __init__(self, trace: Trace, setups: Sequence[ReplicaSetup],
                 policy: RouterPolicy | Sequence[RouterPolicy], refresh_s: float,
                 routing_latency_s: float, progress: Progress | None,
                 kv_event_delay_s: float = 0.0,
                 extra_routers: Sequence[RouterReplica] = (),
                 stack_delay_s: Mapping[str, float] | None = None) -> None:
        """`extra_routers`: routers taking no arrivals of their own (P/D's prefill router)
        that are fed KV events too; `stack_delay_s`: `simulate_fleet`'s."""
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
        self.stack_delay_s = _checked_delays(stack_delay_s or {})
        self.kv_delay_s = kv_event_delay_s
        self.progress = progress
        self.done = 0
        self.env = simpy.Environment()
        self.block_ids = TraceBlockIds.of(trace)  # every replica's and router's
        self.next_index = 0  # the first request not yet routed
        policies = [r.policy for r in self.routers]
        self.steps_ahead = (self.routes_ahead and not self.kv_bus  # docs/fleet.md
                            and all(p.completion_blind for p in policies))
        # the routers' prompt block keys from the trace, for the whole run or none of it
        self.router_keys = (router_keys_for(trace.requests, policies, setups[0].config)
                            if self.gives_prefix_keys else None)
        keyed = None if self.router_keys is None else self.router_keys.blocking
        self.token_blind = not any(p.reads_token_ids and (keyed is None
                                                          or p.prompt_blocking != keyed)
                                   for p in policies)
        # route the whole trace first, then run each replica's share to its end (docs/fleet.md)
        self.pre_routed = self.steps_ahead and pre_routable(policies)
        self.sleeps_through_runs = (self.sleeps_through_runs_allowed and self.routes_ahead
                                    and not self.steps_ahead and not self.kv_bus
                                    and all(p.snapshot_blind for p in policies))
        # per API cost: suffix minima of arrival + latency + cost(prompt) over the trace
        # (`handover_bounds`; replicas of one pool share their list)
        self._bounds: dict[ApiServerCost, list[float]] = {}
        self.spare_blocks: list[KVCacheBlock] = []  # `PreRoutedReplica`s' released blocks
        self.spare_holder: int | None = None  # the `PreRoutedReplica` making blocks of them
        self.step_columns = new_step_columns()  # `PreRoutedReplica`s' steps, one after another
        kind = (KvReplica if self.kv_bus else PreRoutedReplica if self.pre_routed
                else Replica)
        self.replicas = [kind(self, i, setup) for i, setup in enumerate(setups)]
        self.serving = [True] * len(setups)  # takes new requests (an autoscaler changes it)
        # the longest prompt every replica can ever hold (candidates: all, when serving)
        self._fits_all = min(max_prompt_len(r.config) for r in self.replicas)
        # snapshot-blind routers read only the replicas' ids: one fixed set of snapshots
        self._blind_snapshots = tuple(
            ReplicaSnapshot(replica_id=r.index, taken_at_s=0.0,
                            num_gpu_blocks=r.config.cache.num_blocks) for r in self.replicas
        ) if self.routes_ahead and all(p.snapshot_blind for p in policies) else None
        # in lockstep (`run_in_lockstep`): this process's replicas, the other processes, and
        # in a child the trace indices of the requests its replicas finished since the last
        # decision (the parent's policies hear them at the next one)
        self.own: range | None = None
        self.peers: Peers | None = None
        self.finished_here = array("q")
        self.trace_index: dict[str, int] = {}  # request id -> its index (made for lockstep)
        # processes may run it in lockstep (`run_in_lockstep`)
        self.lockstep_allowed = self.sleeps_through_runs and runs_in_lockstep(policies)

    def run(self) -> None:
        self.start_processes()
        self.env.run()

    def run_to_end(self, started_s: float, workers: int = 1) -> FleetResult:
        """`run`, then `result` with the wall seconds since `started_s` (`perf_counter`); a
        fleet of several replicas runs them in `workers` processes if > 1 when pre-routed
        (`run_in_workers`) or allowed lockstep (`run_in_lockstep`); in this one otherwise,
        or where fork is unavailable. The replicas' pools are released after
        (`release_pools`): read the result, not the pools."""
        if workers > 1 and len(self.replicas) > 1 and can_fork():
            if self.pre_routed:
                return self.run_in_workers(workers, started_s)
            if self.lockstep_allowed:
                return self.run_in_lockstep(workers, started_s)
        self.run()
        result = self.result(time.perf_counter() - started_s)
        if not self.pre_routed:  # a pre-routed replica released its pool as it finished
            release_pools(r.core.scheduler.kv_cache_manager for r in self.replicas)
        return result

    def start_processes(self) -> None:
        if self.pre_routed:  # before any step: each replica then runs its share in one go
            self.route_whole_trace()
        else:
            self.env.process(self.router())
        for replica in self.replicas:
            self.env.process(replica.engine())

    def route_whole_trace(self) -> None:
        """Route every request (`pre_routed`) and order each replica's hand-overs."""
        for i, req in enumerate(self.trace):
            self.route_blind(req)
            self.next_index = i + 1
        for replica in self.replicas:  # stack delays may reorder a replica's hand-overs
            cast(PreRoutedReplica, replica).order_handovers(bool(self.stack_delay_s))

    def run_in_workers(self, workers: int, started_s: float) -> FleetResult:
        """`run_to_end` of a pre-routed fleet in `workers` forked processes: the trace routed
        here, each worker running a contiguous range of replicas balanced by their shares'
        requests (`run_range`), the records joined in replica order: the same result as one
        process. Progress is reported as each worker ends."""
        self.route_whole_trace()
        shares = worker_ranges([len(cast(PreRoutedReplica, r).requests)
                                for r in self.replicas], workers)
        parts = run_forked([partial(self.run_range, share) for share in shares],
                           lambda _, part: self.count_done(sum(len(r.records)
                                                               for r in part.replicas)),
                           [f"worker {k} (replicas {share.start}-{share.stop - 1})"
                            for k, share in enumerate(shares)])
        return assembled_result(self.trace, parts, time.perf_counter() - started_s,
                                self.router_of if len(self.routers) > 1 else None)

    def run_range(self, replicas: range) -> ReplicasOutcome:
        """In a worker, on the routed fleet: `replicas` run one after another as `run` runs
        them (the first makes new blocks, its own step columns start empty), their records
        as `result` makes them. Block identities (`sim.block_ids`) are numbered in this
        worker's own order: only their equality reaches the records, as with SHA-256."""
        self.progress = None  # the parent reports progress as workers end
        for i in replicas:
            self.env.process(self.replicas[i].engine())
        self.env.run()
        return self.outcome([self.replicas[i] for i in replicas])

    def run_in_lockstep(self, workers: int, started_s: float) -> FleetResult:
        """`run_to_end` in `workers` processes in lockstep (`sim.fleet_lockstep`): each runs
        a contiguous group of replicas; this one routes, hearing the children's finishes
        before each decision and telling them its choice; the records joined in replica
        order, as one process makes them. Progress is reported as this process's replicas
        finish requests, and as each worker ends."""
        groups = worker_ranges([1] * len(self.replicas), workers)
        self.trace_index = {req.request_id: i for i, req in enumerate(self.trace)}
        parts = run_lockstep([partial(self.run_group, group) for group in groups],
                             self.worker_done,
                             [f"worker {k} (replicas {group.start}-{group.stop - 1})"
                              for k, group in enumerate(groups)])
        return assembled_result(self.trace, parts, time.perf_counter() - started_s,
                                self.router_of if len(self.routers) > 1 else None)

    def run_group(self, group: range, peers: Peers) -> ReplicasOutcome:
        """In one process of a lockstep run: the arrivals (the parent routes them, a child
        takes the parent's word) and the replicas of `group` only; their outcome (their
        pools then released, here in the parent)."""
        self.own, self.peers = group, peers
        if peers.index:
            self.progress = None  # the parent reports progress as workers end
        self.env.process(self.router())
        for i in group:
            self.env.process(self.replicas[i].engine())
        self.env.run()
        replicas = [self.replicas[i] for i in group]
        outcome = self.outcome(replicas)
        release_pools(r.core.scheduler.kv_cache_manager for r in replicas)
        return outcome

    @property
    def in_lockstep_child(self) -> bool:
        """Whether this process is a child of a lockstep run (it runs no policy)."""
        return self.peers is not None and self.peers.index > 0

    def worker_done(self, worker: int, part: ReplicasOutcome) -> None:
        """Worker `worker` of a lockstep run ended: count its requests done (this process's
        own, worker 0, were counted as they finished)."""
        if worker:
            self.count_done(sum(len(r.records) for r in part.replicas))

    def hear_children(self, peers: Peers) -> None:
        """In the parent of a lockstep run, before a decision: the policies hear the
        children's finishes since the last one (`on_finished`, by request id)."""
        trace = self.trace
        for index in peers.gather():
            request_id = trace[index].request_id
            self.policy_of(request_id).on_finished(request_id)

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
            bounds = self._bounds[api] = earliest_handovers(self.trace.requests,
                                                            self.latency_s, api)
        return bounds

    @cached_property
    def arrivals(self) -> list[float]:
        """The trace's arrival times, seconds, sorted (made on `arrives_at`'s first call:
        only sleeping fleets ask)."""
        return [req.arrival_s for req in self.trace]

    def arrives_at(self, at_s: float) -> bool:
        """Whether a request not yet routed arrives at exactly `at_s` (seconds)."""
        arrivals = self.arrivals  # a list of floats: no `Trace.__getitem__` per probe
        i = bisect_left(arrivals, at_s, self.next_index)
        return i < len(arrivals) and arrivals[i] == at_s

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
            peers = self.peers
            if peers is None:
                self.route(req)
            elif peers.index == 0:  # the parent: hear the children, route, tell them
                self.hear_children(peers)
                peers.announce(self.route(req))
            else:
                self.take_routed(req, peers.ask(self.finished_here))
                self.finished_here = array("q")
            self.next_index = i + 1

    def router_for(self, req: TraceRequest) -> RouterReplica:
        """The router replica taking the request being routed (round-robin by arrival),
        its KV events delivered up to now."""
        router = self.routers[self.next_index % len(self.routers)]
        if len(self.routers) > 1:
            self.router_of[req.request_id] = router.index
        router.deliver_kv_events(req.arrival_s)
        return router

    def route(self, req: TraceRequest) -> int:
        """Route `req` at its arrival and hand it over (in lockstep, only to a replica of
        this process's group); returns the chosen replica's index."""
        now = req.arrival_s
        first = self.replicas[0]
        tokens = routing_tokens(first, req, self.kv_block_size, self.token_blind, True)
        router = self.router_for(req)
        candidates = self.candidates(req, self.snapshots(now, router))
        keys = None if self.router_keys is None else self.router_keys.keys(req)
        routing = routing_request(req, tokens[0], self.kv_block_size, tokens[2], keys)
        index = router.policy.route(routing, candidates).replica
        if self.own is None or index in self.own:
            self.hand_over(self.replicas[index], req, tokens, routing.block_hashes)
        return index

    def hand_over(self, replica: Replica, req: TraceRequest,
                  tokens: tuple[array[int], array[int], list[bytes], bool],
                  block_hashes: Sequence[bytes]) -> None:
        """Give `req`, routed now, to `replica` (its token ids as it reads them; the prompt's
        block hashes as the routers computed them, `RoutingRequest.block_hashes`)."""
        prompt, output, _, placeholders = tokens
        prompt, output, hashes = replica_inputs(replica, self.replicas[0].config, req, prompt,
                                                output, placeholders, block_hashes)
        replica.hand_over(req, prompt, output, req.arrival_s + self.latency_s, hashes=hashes)

    def take_routed(self, req: TraceRequest, index: int) -> None:
        """In a lockstep child: the parent routed `req` to replica `index`; hand it over if
        that replica is this process's (its tokens as `route` makes them; no block hashes:
        routers in lockstep take no KV events, so `route` computes none either)."""
        assert self.own is not None and self.kv_block_size is None
        if index in self.own:
            tokens = routing_tokens(self.replicas[0], req, None, self.token_blind, True)
            self.hand_over(self.replicas[index], req, tokens, ())

    def candidates(self, req: TraceRequest, snapshots: Sequence[ReplicaSnapshot]
                   ) -> Sequence[ReplicaSnapshot]:
        """The serving replicas' snapshots, those that can ever hold the prompt if any can."""
        serving = self.serving
        if req.prompt_len <= self._fits_all and (self.serving_fixed or False not in serving):
            return snapshots  # O(1) a request on a fixed fleet (64 replicas: ~6k instructions)
        return [snapshots[r.index] for r in self.replicas
                if serving[r.index] and can_ever_fit(r.config, req.prompt_len)] or [
                    snapshots[r.index] for r in self.replicas if serving[r.index]]

    def route_blind(self, req: TraceRequest) -> None:
        """Route as `route` does for routers that read no snapshot, completion or token id
        (`pre_routed`): the chosen replica builds the request when it is handed over."""
        router = self.router_for(req)
        routing = RoutingRequest(request_id=req.request_id, now_s=req.arrival_s,
                                 prompt_len=req.prompt_len, session_id=req.session_id)
        candidates = self.candidates(req, self.snapshots(req.arrival_s, router))
        replica = self.replicas[router.policy.route(routing, candidates).replica]
        cast(PreRoutedReplica, replica).hand_over_later(req)

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

    def first_token(self, replica: Replica, request_id: str) -> None:
        """`replica` produced the request's first token: at the end of the current step,
        or, on a pre-routed replica, of the step that finished the request."""
        if not self.in_lockstep_child:  # a child has no policy
            self.policy_of(request_id).on_prefill_done(request_id)

    def finished(self, replica: Replica, records: list[RequestRecord]) -> None:
        """`replica` finished these requests (at the end of the current step)."""
        if self.in_lockstep_child:  # for the parent's policies, at the next decision
            index = self.trace_index
            self.finished_here.extend(index[record.request_id] for record in records)
        else:
            for record in records:
                self.policy_of(record.request_id).on_finished(record.request_id)
        self.count_done(len(records))

    def count_done(self, count: int) -> None:
        self.done += count
        if self.progress is not None:
            self.progress(self.done, len(self.trace))

    def result(self, wall_s: float) -> FleetResult:
        """The records. Call once: the replicas' records are shifted in place (`outcome`)."""
        return assembled_result(self.trace, [self.outcome(self.replicas)], wall_s,
                                self.router_of if len(self.routers) > 1 else None)

    def outcome(self, replicas: Sequence[Replica]) -> ReplicasOutcome:
        """What the records read of `replicas` once run; token times as clients see them,
        each replica's through its own front end (`deliver_to_clients`, as `simulate`;
        nothing changes without an output cost)."""
        for replica in replicas:
            deliver_to_clients(replica.core.recorder.finished, replica.config.api_server)
        return replicas_outcome([(r.index, r.core) for r in replicas])


def simulate_fleet(trace: Trace, replicas: Sequence[ReplicaSetup],
                   policy: RouterPolicy | Sequence[RouterPolicy], refresh_s: float = 0.05,
                   routing_latency_s: float = 0.0, progress: Progress | None = None,
                   kv_event_delay_s: float = 0.0,
                   stack_delay_s: Mapping[str, float] | None = None,
                   workers: int = 1) -> FleetResult:
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
        stack_delay_s: seconds (>= 0, by request id; absent: 0) each request spends in
            the serving stack after the routing decision and its API server, before its
            replica's core (`sim.serving_stack`): routed at its arrival, it enters the core
            that much later, not queued behind the others.
        workers: processes that simulate the replicas, each a contiguous range of them;
            the same records as 1. A pre-routed fleet (`pre_routable` policies: round-robin,
            random, session hashing) runs them apart, one behind policies reading only
            completions (`runs_in_lockstep`: least-outstanding, power-of-two,
            sglang-cache-aware) in lockstep. Other fleets run in this process.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    started = time.perf_counter()
    return run_with_gc(lambda: _Fleet(trace, replicas, policy, refresh_s, routing_latency_s,
                                      progress, kv_event_delay_s, stack_delay_s=stack_delay_s
                                      ).run_to_end(started, workers))


def pre_routable(policies: Sequence[RouterPolicy]) -> bool:
    """Whether a fleet behind these router policies (one per router replica) is routed whole
    before any step (`_Fleet.pre_routed`, which adds the fleet's own conditions: not P/D nor
    autoscaled): none reads snapshots, completions, token ids or KV events."""
    return all(p.snapshot_blind and p.completion_blind and not p.reads_token_ids
               and not p.wants_kv_events for p in policies)


def runs_in_lockstep(policies: Sequence[RouterPolicy]) -> bool:
    """Whether a fleet behind these router policies runs in processes in lockstep when given
    workers (`_Fleet.lockstep_allowed`, which adds the fleet's own conditions: not P/D nor
    autoscaled): some read completions, none reads snapshots' metrics or KV events, and every
    one hears completions as in-flight counts only (`sim.fleet_lockstep.hears_counts_only`)."""
    return (not all(p.completion_blind for p in policies)
            and all(p.snapshot_blind and not p.wants_kv_events and hears_counts_only(p)
                    for p in policies))


def _checked_delays(delays: Mapping[str, float]) -> Mapping[str, float]:
    """`delays`, or ValueError (one line) naming a request whose delay is not a finite
    number >= 0 (the stepping-ahead bounds take hand-overs no earlier than without it)."""
    for request_id, delay in delays.items():
        if not (delay >= 0.0 and math.isfinite(delay)):
            raise ValueError(f"stack_delay_s[{request_id!r}] must be a finite number >= 0, "
                             f"got {delay}")
    return delays
