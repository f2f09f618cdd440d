"""The fleet simulator: N engines behind one router, in one SimPy environment.

    router       requests arrive at their trace times; the policy (`runtime.router`) picks a
                 replica among those whose KV pool can ever hold the prompt, from replica
                 snapshots (refreshed every `refresh_s`; 0 = oracle) and its own state;
                 `on_routed` at once. After `routing_latency_s` the request reaches the
                 replica's API server.
    api server   one FIFO server per replica (Lindley's recursion, as in `sim.simulator`):
                 h = max(h_prev, reached) + cost(prompt); at h the request enters the core.
    engine       one engine-core loop per replica (`runtime.EngineCore`), each with its own
                 scheduler, KV pool, prefix cache and cost model; `on_prefill_done` and
                 `on_finished` are called at the end of the step that produced the first
                 token or finished the request.

A snapshot is what vLLM's /metrics would show: waiting, running and KV usage as of the last
step that *ended* by the scrape time (read from the replica's step records), so it does not
depend on how far ahead the loop has stepped or fast-forwarded. A replica fast-forwards runs
of plain decode steps up to the earliest time a request could reach its core: its own next
pending hand-over, or the earliest hand-over any not yet routed request could have there
(a suffix minimum over the trace of arrival + latency + API cost).

With one replica and no routing latency the records are those of `sim.simulator.simulate`.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import time
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Generator, Sequence
from typing import Protocol, cast

import simpy

from runtime import BatchFeatures, EngineCore, Request, SamplingParams, Scheduler
from runtime.records import STEP_FIELDS, RequestRecord
from runtime.router import MetricsRefresh, ReplicaSnapshot, RouterPolicy, RoutingRequest
from sim.cost.api_server import ApiServerCost
from sim.cost.base import CostModel, decode_run_timer
from sim.fleet_records import FleetRequestRecord, FleetResult, ReplicaSummary, fleet_record
from sim.simulator import Progress, SimConfig
from workloads import Trace, TraceRequest
from workloads.tokens import request_token_arrays

__all__ = ["FleetRequestRecord", "FleetResult", "ReplicaSetup", "ReplicaSummary",
           "can_ever_fit", "simulate_fleet"]


class ReplicaSetup(Protocol):
    """What one replica needs (`sim.engine_args.SimSetup` is one)."""

    @property
    def config(self) -> SimConfig: ...

    @property
    def cost_model(self) -> CostModel: ...


def can_ever_fit(config: SimConfig, prompt_len: int) -> bool:
    """Whether the replica's scheduler would take the prompt in (`Scheduler.add_request`
    ignores one that leaves no room under max_model_len or outgrows the whole KV pool)."""
    cache = config.cache
    return (0 < prompt_len < config.scheduler.max_model_len
            and prompt_len <= cache.num_usable_blocks * cache.block_size)


_NOISE_SEED_STRIDE = 0x9E3779B1  # replica i's step-noise seed: the config's + i * this


def _own_noise(config: SimConfig, index: int) -> SimConfig:
    """Replica `index`'s config with step noise of its own (GPUs vary independently);
    replica 0 keeps the config's, so one replica runs as the single-engine simulator."""
    noise = config.step_noise
    if noise is None or index == 0:
        return config
    seed = noise.seed + index * _NOISE_SEED_STRIDE
    return dataclasses.replace(config, step_noise=dataclasses.replace(noise, seed=seed))


class _Replica:
    """One engine behind the router: its API server queue and its engine-core loop."""

    def __init__(self, fleet: _Fleet, index: int, setup: ReplicaSetup) -> None:
        self.fleet = fleet
        self.index = index
        self.config = _own_noise(setup.config, index)
        self.cost_model = setup.cost_model
        self.env = fleet.env
        self.core = EngineCore(Scheduler(self.config.scheduler, self.config.cache))
        self.outputs: dict[str, array[int]] = {}  # request id -> its trace output tokens
        self.wake = self.env.event()
        noise = self.config.step_noise
        self.run_times = decode_run_timer(self.cost_model) if noise is None else None
        self.pending: deque[tuple[float, Request]] = deque()  # routed, not yet handed over
        self.api_free_at = 0.0  # when the API server finishes its last routed request
        self.awaiting_first: set[str] = set()  # in the core, no first token yet
        self.notified = 0  # finished records already reported to the router
        # the step ends so far, seconds (the recorder's own column: it grows in place)
        self.end_s = cast(list[float], self.core.recorder.step_columns["end_s"])
        self.columns = self.core.recorder.step_columns

    # ---- API server ------------------------------------------------------------------------

    def hand_over(self, req: TraceRequest, prompt: array[int], output: array[int],
                  reached_s: float, max_tokens: int | None = None) -> None:
        """The request reaches this replica's API server at `reached_s` (now or later);
        `max_tokens` defaults to the trace's output length."""
        max_tokens = req.output_len if max_tokens is None else max_tokens
        self.core.recorder.arrived(req.request_id, reached_s, req.prompt_len, max_tokens)
        handover = self.api_handover(reached_s, req.prompt_len)
        self.outputs[req.request_id] = output
        self.pending.append((handover, make_request(req, prompt, max_tokens)))
        self.env.timeout(handover - self.env.now).callbacks.append(self._submit_head)

    def api_handover(self, reached_s: float, prompt_len: int) -> float:
        """When the API server (FIFO) hands a prompt reaching it at `reached_s` to the core."""
        handover = max(self.api_free_at, reached_s) + self.config.api_server.time(prompt_len)
        self.api_free_at = handover
        return handover

    def _submit_head(self, _: simpy.Event) -> None:
        """One hand-over is due: the oldest pending request enters the core (FIFO)."""
        handover, request = self.pending.popleft()
        self.submit(request, handover)

    def submit(self, request: Request, now: float) -> None:
        """`request` enters the core's input queue at `now` (the current time)."""
        self.core.submit(request, now)
        self.awaiting_first.add(request.request_id)
        if not self.wake.triggered:
            self.wake.succeed()

    def horizon(self) -> float:
        """No request can enter the core before this time (seconds)."""
        head = self.pending[0][0] if self.pending else math.inf
        return min(head, self.fleet.earliest_handover(self.config.api_server))

    # ---- engine ------------------------------------------------------------------------------

    def engine(self) -> Generator[simpy.Event, object, None]:
        """`sim.simulator`'s engine loop, reporting first tokens and finishes to the router
        when the step that produced them ends."""
        core, env = self.core, self.env
        clock = 0.0
        while True:
            if not core.has_work():
                self.wake = env.event()
                yield self.wake
                clock = env.now
            end = self.fast_forward(clock) if self.config.fast_forward else None
            first: list[str] = []
            if end is None:
                end, first = self.one_step(clock)
            if end > env.now:
                yield env.timeout(end - env.now)
            clock = end
            self.report(first)

    def fast_forward(self, clock: float) -> float | None:
        outputs = self.outputs

        def upcoming(request: Request, count: int) -> array[int]:
            start = request.num_output_tokens
            return outputs[request.request_id][start : start + count]

        cost = self.cost_model.step_time

        def timed(features: BatchFeatures, start_s: float) -> float:
            return cost(features)

        if self.config.step_noise is not None:
            indices = itertools.count(self.core.recorder.num_steps)

            def timed(features: BatchFeatures, start_s: float) -> float:
                return self.step_time(features, next(indices), start_s)

        end = self.core.fast_forward(clock, self.horizon(), timed, upcoming, self.run_times)
        if end is not None and self.config.check_invariants:
            self.core.scheduler.check_invariants()
        return end

    def step_time(self, features: BatchFeatures, step: int, start_s: float) -> float:
        duration = self.cost_model.step_time(features)
        noise = self.config.step_noise
        return duration if noise is None else duration * noise.factor(step, start_s)

    def one_step(self, clock: float) -> tuple[float, list[str]]:
        """Run one step from `clock`: (its end, the requests that got their first token)."""
        core = self.core
        step = core.begin_step(clock)
        self.report([])  # requests refused on entry finish now
        if step is None:
            return clock, []
        duration = self.step_time(step.features, core.recorder.num_steps, clock)
        end = clock + duration
        sampled = self.sample(step.output.num_scheduled_tokens)
        core.end_step(step, sampled, end, duration)
        if self.config.check_invariants:
            core.scheduler.check_invariants()
        awaiting = self.awaiting_first
        first = [req_id for req_id in sampled if req_id in awaiting]
        awaiting.difference_update(first)
        return end, first

    def sample(self, scheduled: dict[str, int]) -> dict[str, list[int]]:
        requests = self.core.scheduler.requests
        sampled = {}
        for req_id in scheduled:
            request = requests[req_id]
            if request.num_computed_tokens >= request.num_tokens:
                sampled[req_id] = [self.outputs[req_id][request.num_output_tokens]]
        return sampled

    def report(self, first: list[str]) -> None:
        """Tell the fleet (and so the router) about first tokens and finishes it has not
        heard of yet."""
        fleet = self.fleet
        for req_id in first:
            fleet.first_token(self, req_id)
        finished = self.core.recorder.finished
        if self.notified == len(finished):
            return
        records = finished[self.notified:]
        for record in records:
            self.outputs.pop(record.request_id, None)
            self.awaiting_first.discard(record.request_id)
        self.notified = len(finished)
        fleet.finished(self, records)

    # ---- what the router sees ------------------------------------------------------------

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


def make_request(req: TraceRequest, prompt: array[int], max_tokens: int) -> Request:
    """The engine-core request of a trace request (its output length: `max_tokens`)."""
    return Request(req.request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=req.arrival_s, priority=req.priority, cache_salt=req.cache_salt)


class _Fleet:
    def __init__(self, trace: Trace, setups: Sequence[ReplicaSetup], policy: RouterPolicy,
                 refresh_s: float, routing_latency_s: float, progress: Progress | None) -> None:
        if not setups:
            raise ValueError("a fleet needs at least one replica, got 0")
        if not (routing_latency_s >= 0.0 and math.isfinite(routing_latency_s)):
            raise ValueError(f"routing_latency_s must be a finite number >= 0, "
                             f"got {routing_latency_s}")
        self.trace = trace
        self.policy = policy
        self.refresh = MetricsRefresh(refresh_s)
        self.latency_s = routing_latency_s
        self.progress = progress
        self.done = 0
        self.env = simpy.Environment()
        self.replicas = [_Replica(self, i, setup) for i, setup in enumerate(setups)]
        self.serving = [True] * len(setups)  # takes new requests (an autoscaler changes it)
        self.next_index = 0  # the first request not yet routed
        # per API cost: suffix minima of arrival + latency + cost(prompt) over the trace
        self._earliest: dict[ApiServerCost, list[float]] = {}

    def run(self) -> None:
        self.start_processes()
        self.env.run()

    def start_processes(self) -> None:
        self.env.process(self.router())
        for replica in self.replicas:
            self.env.process(replica.engine())

    def earliest_handover(self, api: ApiServerCost) -> float:
        """The earliest time a request not yet routed could be handed over to a core whose
        API server costs `api` (seconds; inf once all are routed)."""
        bounds = self._earliest.get(api)
        if bounds is None:
            bounds = [math.inf] * (len(self.trace) + 1)
            for i in range(len(self.trace) - 1, -1, -1):
                req = self.trace[i]
                reached = req.arrival_s + self.latency_s
                bounds[i] = min(bounds[i + 1], reached + api.time(req.prompt_len))
            self._earliest[api] = bounds
        return bounds[self.next_index]

    def router(self) -> Generator[simpy.Event, object, None]:
        for i, req in enumerate(self.trace):
            if req.arrival_s > self.env.now:
                yield self.env.timeout(req.arrival_s - self.env.now)
            self.route(req)
            self.next_index = i + 1

    def route(self, req: TraceRequest) -> None:
        now = req.arrival_s
        first = self.replicas[0].config
        prompt, output = request_token_arrays(req, first.vocab_size, first.seed)
        snapshots = self.snapshots(now)
        serving = self.serving
        candidates = [snapshots[r.index] for r in self.replicas
                      if serving[r.index] and can_ever_fit(r.config, req.prompt_len)] or [
                          snapshots[r.index] for r in self.replicas if serving[r.index]]
        routing = RoutingRequest(request_id=req.request_id, now_s=now,
                                 prompt_len=req.prompt_len, token_ids=prompt,
                                 session_id=req.session_id)
        decision = self.policy.choose(routing, candidates)
        self.policy.on_routed(routing, decision.replica)
        replica = self.replicas[decision.replica]
        config = replica.config
        if (config.vocab_size, config.seed) != (first.vocab_size, first.seed):
            prompt, output = request_token_arrays(req, config.vocab_size, config.seed)
        replica.hand_over(req, prompt, output, now + self.latency_s)

    def snapshots(self, now: float) -> Sequence[ReplicaSnapshot]:
        """Every replica's snapshot as of the last scrape tick at or before `now`."""
        refresh = self.refresh
        if refresh.due(now):
            tick = now
            if refresh.refresh_s > 0.0:
                tick = min(now, math.floor(now / refresh.refresh_s) * refresh.refresh_s)
            refresh.store([r.snapshot(tick) for r in self.replicas], now)
        return refresh.snapshots

    def first_token(self, replica: _Replica, request_id: str) -> None:
        """`replica` produced the request's first token (at the end of the current step)."""
        self.policy.on_prefill_done(request_id)

    def finished(self, replica: _Replica, records: list[RequestRecord]) -> None:
        """`replica` finished these requests (at the end of the current step)."""
        for record in records:
            self.policy.on_finished(record.request_id)
        self.count_done(len(records))

    def count_done(self, count: int) -> None:
        self.done += count
        if self.progress is not None:
            self.progress(self.done, len(self.trace))

    def result(self, wall_s: float) -> FleetResult:
        order = {req.request_id: i for i, req in enumerate(self.trace)}
        arrivals = {req.request_id: req.arrival_s for req in self.trace}
        requests: list[RequestRecord] = []
        summaries = []
        queries = hits = 0
        columns: dict[str, list[object]] = {name: [] for name in STEP_FIELDS}
        columns["replica"] = []
        for replica in self.replicas:
            recorder = replica.core.recorder
            assert not recorder.live, f"{len(recorder.live)} requests never finished"
            for record in recorder.finished:
                requests.append(fleet_record(record, replica.index,
                                              arrivals[record.request_id]))
            for name, values in recorder.step_columns.items():
                columns[name].extend(values)
            columns["replica"].extend([replica.index] * recorder.num_steps)
            stats = replica.core.scheduler.prefix_cache_stats
            queries += stats.queries
            hits += stats.hits
            summaries.append(ReplicaSummary(replica.index, len(recorder.finished),
                                            recorder.num_steps, stats.queries, stats.hits))
        requests.sort(key=lambda r: order[r.request_id])
        return FleetResult(requests=requests, step_columns=columns,
                           prefix_cache_queries=queries, prefix_cache_hits=hits,
                           wall_s=wall_s, replicas=summaries)


def simulate_fleet(trace: Trace, replicas: Sequence[ReplicaSetup], policy: RouterPolicy,
                   refresh_s: float = 0.05, routing_latency_s: float = 0.0,
                   progress: Progress | None = None) -> FleetResult:
    """Run the trace through `replicas` behind `policy` to completion (every request ends
    finished or ignored).

    Args:
        replicas: one setup per replica (its `SimConfig` and cost model); replica i is
            `replica_id` i in the router's snapshots and the records' `replica` column.
        policy: a fresh policy (`runtime.router.make_policy`); the run updates its state.
        refresh_s: seconds between metric scrapes (0: every decision sees the current
            metrics).
        routing_latency_s: seconds from arrival to reaching the chosen replica.
        progress: called as (requests finished, requests in the trace).
    """
    started = time.perf_counter()
    # Each replica's KV pool is tens of thousands of linked `KVCacheBlock`s living for the
    # whole run: building them with the cyclic collector on triggered collections walking
    # every block built so far, and each full collection during the run walked them all
    # again (about a fifth of a 16-replica run's CPU, growing with the replica count). So
    # the fleet is built with the collector paused, then frozen (`gc.freeze`: full
    # collections skip it) until the run ends. Records are unaffected.
    enabled = gc.isenabled()
    gc.disable()
    try:
        fleet = _Fleet(trace, replicas, policy, refresh_s, routing_latency_s, progress)
        gc.freeze()
    finally:
        if enabled:
            gc.enable()
    try:
        fleet.run()
    finally:
        gc.unfreeze()
    return fleet.result(time.perf_counter() - started)
