"""The discrete-event simulator: a trace through the real engine core on a simulated clock.

The two stages of a serving runtime's pipeline:

    api_server   requests arrive at their trace times and are tokenized by one FIFO server
                 (a cost per request + per prompt token), so a burst of long prompts queues
                 here. Its hand-overs follow Lindley's recursion, h_i = max(h_{i-1},
                 arrival_i) + cost_i: known in advance, so it is no process (`KnownHandovers`)
    engine       the engine-core loop (`EngineProcess`, a fleet replica's too): schedule(),
                 the step time, synthetic tokens, update_from_output(); requests handed over
                 by a step boundary enter there; idle, it goes to the next hand-over

With a front-end output cost (`ApiServerCost.per_output_token_s` > 0, a profile fitted on
client-side times by `rt calibrate --from-run`), each token's time is when its client sees
it: the step's end plus the delivery delay of that step's tokens
(`sim.api_server.deliver_to_clients`); the steps and the attribution parts stay engine-side.

Tokens are the trace's deterministic ids (`workloads.prompt_token_ids` / `output_token_ids`),
so the prefix cache sees exactly the trace's sharing; every request runs with `ignore_eos`
and `max_tokens` = its trace output length. Blocks are named from the trace's coordinates
where that is exact (`sim.block_ids`); a request all of whose blocks are named gets
placeholder token ids, which nothing reads (`EngineProcess.token_arrays`).
"""

from __future__ import annotations

import itertools
import math
import time
from array import array
from collections.abc import Callable, Collection, Generator, Sequence

import simpy
from mypy_extensions import mypyc_attr

from runtime import (
    BatchFeatures,
    EngineCore,
    Recorder,
    Request,
    SamplingParams,
    Scheduler,
)
from runtime.block_pieces import BlockPieces
from runtime.engine import RunPlan
from runtime.records import RequestRecord, RunResult
from sim.api_server import deliver_to_clients, handover_times, server_wakes
from sim.block_ids import TraceBlockIds
from sim.cost.base import CostModel, decode_run_timer
from sim.run_gc import release_pools, run_with_gc
from sim.sim_config import SimConfig as SimConfig  # re-exported: its old home
from workloads import Trace, TraceRequest
from workloads.tokens import request_token_arrays

_ZERO = array("q", [0])  # a placeholder token id (never read), repeated: `token_arrays`

Progress = Callable[[int, int], None]  # (requests finished, requests in the trace)


SimResult = RunResult  # the records of one simulation (the replay's shape)


@mypyc_attr(allow_interpreted_subclasses=True)  # the fleet's replicas
class EngineProcess:
    """One engine's SimPy process: the engine-core loop (`runtime.EngineCore`) on the
    simulated clock, shared by `simulate` and the fleet simulator (`sim.fleet`).

    A step is begin_step (take in, schedule), the cost model's time, synthetic tokens,
    end_step. Runs of plain decode steps are fast-forwarded up to `horizon()`, the earliest
    time a request could enter the core, and, with fast-forward, running decodes advance
    implicitly (`runtime.steady`). The records are identical either way. Drivers subclass
    it: `horizon` says when the next request can come, `on_step_end` hears at each step's
    end which requests got a token, `on_finished` which requests finished (records).
    """

    def __init__(self, env: simpy.Environment, config: SimConfig, cost_model: CostModel,
                 block_ids: TraceBlockIds | None = None,
                 recorder: Recorder | None = None) -> None:
        """`block_ids`: the simulation's shared block identities (a fleet's engines and
        routers share one); by default the engine's own. `recorder`: the core's (one
        appending to step columns it shares, `sim.fleet_replica`); by default its own."""
        self.env = env
        self.config = config
        self.cost_model = cost_model
        # request id -> its trace output tokens (8 bytes per token)
        self.outputs: dict[str, array[int]] = {}
        self.core = EngineCore(Scheduler(config.scheduler, config.cache), recorder,
                               upcoming=self.upcoming if config.fast_forward else None)
        self.wake = env.event()
        # Durations of a decode run in bulk; with step noise each step is timed on its own.
        self.run_times = decode_run_timer(cost_model) if config.step_noise is None else None
        self.notified = 0  # finished records already passed to `on_finished`
        self.block_ids = block_ids if block_ids is not None else TraceBlockIds()
        self._plain_timer = _start_blind(cost_model.step_time)  # no noise: one for the run
        self.sleeps_through_runs = False  # the loop calls `sleep_through_run` (a replica's)
        self.planned: RunPlan | None = None  # the run `sleep_through_run` planned
        # `sleep_through_run` found no run from this clock (the next step is not a plain
        # decode): `fast_forward` returns None without planning again
        self.no_run = False

    def known_hashes(self, req: TraceRequest) -> list[bytes]:
        """The identities of the request's leading prompt blocks that this engine takes as
        given (`sim.block_ids`; none without prefix caching or with `trace_block_ids` off)."""
        config = self.config
        if not (config.trace_block_ids and config.cache.enable_prefix_caching):
            return []
        return self.block_ids.prompt_ids(req, config.cache.block_size, config.vocab_size,
                                         config.seed)

    def tokens_unread(self, req: TraceRequest) -> bool:
        """Whether this engine never reads the request's token values: it reads them only
        to hash blocks and to check stop tokens; the simulator's requests have no stop
        tokens (`ignore_eos`), and with prefix caching off, or every block named (trace
        coordinates and own names, `make_request`), no block is hashed."""
        cfg = self.config
        if not cfg.cache.enable_prefix_caching:
            return cfg.trace_block_ids
        key = self.block_ids.own_key(req, cfg.cache.block_size, cfg.vocab_size, cfg.seed)
        return cfg.trace_block_ids and key is not None

    def token_arrays(self, req: TraceRequest) -> tuple[array[int], array[int]]:
        """The request's prompt and output token ids for this engine: the trace's, or
        placeholders (zeros) when it never reads them (`tokens_unread`)."""
        if self.tokens_unread(req):  # repeating one zero: 0.86 -> 0.31 s in a Mooncake run
            return _ZERO * req.prompt_len, _ZERO * req.output_len
        return request_token_arrays(req, self.config.vocab_size, self.config.seed)

    def make_request(self, req: TraceRequest, prompt: array[int], max_tokens: int,
                     arrival_s: float, known: Sequence[bytes] | None = None) -> Request:
        """`make_request` with this engine's block naming (`known`: the prompt's block
        identities if already computed, `known_hashes`), stamped `arrival_s`."""
        config = self.config
        if not (config.trace_block_ids and config.cache.enable_prefix_caching):
            return make_request(req, prompt, max_tokens, [] if known is None else known,
                                arrival_s=arrival_s)
        return make_request(req, prompt, max_tokens, *self.block_ids.given_names(
            req, config.cache.block_size, config.vocab_size, config.seed, known),
            arrival_s=arrival_s)

    # ---- what a driver provides ----------------------------------------------------------

    def horizon(self) -> float:
        """No request can enter the core before this time (seconds)."""
        return math.inf

    def on_step_end(self, sampled: Collection[str]) -> None:
        """At the end of the step just run (after its simulated time has passed): the ids of
        the requests that got a token in it (none after a fast-forwarded run)."""
        self.report_finished()

    def on_finished(self, records: list[RequestRecord]) -> None:
        """These requests finished (or were refused), now."""

    def take_due(self, clock: float) -> None:
        """Before a step at `clock`: requests due by then that the driver holds enter the
        core (default: none; they are submitted by the driver's own process)."""

    def steps_ahead_until(self) -> float:
        """A step ending before this time (seconds) is followed by the next one without
        waiting for the event loop to reach its end: nothing can enter the core, nor read
        what it reports at a step's end, before then (default: never; `sim.fleet`)."""
        return -math.inf

    def idle_until(self) -> float | None:
        """With no work in the core: when the next request the driver holds is due, if the
        engine may go there without the event loop (as `steps_ahead_until` allows a step;
        it then enters in `take_due`), else None: wait to be woken (default)."""
        return None

    # ---- the loop ----------------------------------------------------------------------------

    def submit(self, request: Request, now: float) -> None:
        """`request` enters the core's input queue at `now` (the current time)."""
        self.core.submit(request, now)
        if not self.wake.triggered:
            self.wake.succeed()

    def engine(self) -> Generator[simpy.Event, object, None]:
        """The engine-core loop. `clock` is the engine's own time: step ends are computed as
        start + duration, so stepping one by one and fast-forwarding give the same floats;
        it runs ahead of the event loop's time while `steps_ahead_until` allows."""
        core, env = self.core, self.env
        fast_forward = self.config.fast_forward
        sleeps = fast_forward and self.sleeps_through_runs
        clock = 0.0
        while True:
            self.take_due(clock)
            if not core.has_work():
                clock = yield from self.wait_for_work()
            if sleeps:
                yield from self.sleep_through_run(clock)
            end = self.fast_forward(clock) if fast_forward else None
            sampled: Collection[str] = ()
            if end is None:
                end, sampled = self.one_step(clock)
            if end > env.now and end >= self.steps_ahead_until():
                yield env.timeout(end - env.now)
            clock = end
            self.on_step_end(sampled)

    def sleep_through_run(self, clock: float) -> Generator[simpy.Event, object, None]:
        """Before a fast-forward from `clock`: wait until its run can be cut no more,
        leaving the plan in `planned` (`sim.fleet_replica`); default: no wait."""
        yield from ()

    def wait_for_work(self) -> Generator[simpy.Event, object, float]:
        """Idle: wait until the core may have work; returns the engine's clock then
        (default: go to `idle_until`'s time without the event loop if the driver gives one,
        else the next `submit` wakes it, at the event loop's time)."""
        due = self.idle_until()
        if due is not None:
            self.take_due(due)
            return due
        self.wake = self.env.event()
        yield self.wake
        return self.env.now

    def upcoming(self, request: Request, count: int) -> array[int]:
        """The request's next `count` trace output tokens."""
        start = request.num_output_tokens
        return self.outputs[request.request_id][start : start + count]

    def fast_forward(self, clock: float) -> float | None:
        if self.no_run:  # none up to clock + 1 s is none up to any horizon
            self.no_run = False
            return None
        core, horizon = self.core, self.horizon()
        plan, self.planned = self.planned, None  # `sleep_through_run`'s, if any
        if plan is not None and core.plan_holds(plan, clock, horizon):
            plan = plan.cut(horizon)
        else:
            plan = self.plan_run(clock, horizon)
        end = None if plan is None else core.run_plan(plan)
        if end is not None and self.config.check_invariants:
            self.core.sync()
            self.core.scheduler.check_invariants()
        return end

    def plan_run(self, clock: float, horizon: float) -> RunPlan | None:
        """The run `fast_forward` would take from `clock` up to `horizon` (seconds), not
        run (None where it would take none)."""
        return self.core.plan_run(clock, horizon, self._run_timer(), self.upcoming,
                                  self.run_times)

    def _run_timer(self) -> Callable[[BatchFeatures, float], float]:
        """A run's step timer (features, start s) -> s: the cost model's, or with step
        noise each step's own in index order from the next step."""
        if self.config.step_noise is None:
            return self._plain_timer
        indices = itertools.count(self.core.recorder.num_steps)

        def timed(features: BatchFeatures, start_s: float) -> float:
            return self.step_time(features, next(indices), start_s)

        return timed

    def step_time(self, features: BatchFeatures, step: int, start_s: float) -> float:
        """Seconds of step number `step`, which starts at `start_s` (seconds): the cost
        model's time, times the step's noise factor when the run has step noise."""
        duration = self.cost_model.step_time(features)
        noise = self.config.step_noise
        return duration if noise is None else noise.duration(duration, step, start_s)

    def one_step(self, clock: float) -> tuple[float, dict[str, list[int]]]:
        """Run one step from `clock`: its end (`clock` if there was nothing to run) and the
        tokens sampled in it."""
        core = self.core
        step = core.begin_step(clock)
        self.report_finished()  # requests refused on entry finish now
        if step is None:
            return clock, {}
        duration = self.step_time(step.features, core.recorder.num_steps, clock)
        end = clock + duration
        sampled = self.sample(step.output.num_scheduled_tokens)
        core.end_step(step, sampled, end, duration)
        if self.config.check_invariants:
            core.sync()
            core.scheduler.check_invariants()
        return end, sampled

    def sample(self, scheduled: dict[str, int]) -> dict[str, list[int]]:
        """Each request that completes its sequence this step gets its next trace token."""
        requests = self.core.scheduler.requests
        outputs = self.outputs
        sampled = {}
        for req_id in scheduled:
            request = requests[req_id]
            if request.num_computed_tokens >= request.num_tokens:
                sampled[req_id] = [outputs[req_id][request.num_output_tokens]]
        return sampled

    def report_finished(self) -> None:
        """Pass the records finished since the last call to `on_finished`."""
        finished = self.core.recorder.finished
        if self.notified == len(finished):
            return
        records = finished[self.notified:]
        self.notified = len(finished)
        for record in records:
            self.outputs.pop(record.request_id, None)
        self.on_finished(records)


def _start_blind(cost: Callable[[BatchFeatures], float]
                 ) -> Callable[[BatchFeatures, float], float]:
    """A step timer (features, start s) -> seconds that ignores the start (no noise)."""

    def timed(features: BatchFeatures, start_s: float) -> float:
        return cost(features)

    return timed


def make_request(req: TraceRequest, prompt: array[int], max_tokens: int,
                 known_hashes: Sequence[bytes] = (), block_key: bytes | None = None,
                 block_pieces: BlockPieces | None = None, *, arrival_s: float) -> Request:
    """The engine-core request of a trace request (output length `max_tokens`), with its
    leading prompt blocks' identities if known, its own blocks' key and its pieces; its
    `arrival_time` is `arrival_s`, where the driver's API server stamps it (seconds)."""
    return Request(req.request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival_s, priority=req.priority, cache_salt=req.cache_salt,
                   block_hashes=known_hashes, block_key=block_key, block_pieces=block_pieces)


@mypyc_attr(allow_interpreted_subclasses=True)  # the fleet's replicas
class KnownHandovers(EngineProcess):
    """An engine whose hand-overs are known before its first step (`_Simulation`, a pre-routed
    fleet replica): `requests[i]`, handed over at `handovers[i]`, enters at the first step
    boundary at or after `take_in[i]` (s). It jumps idle gaps, never waiting for the loop."""

    requests: list[TraceRequest]
    handovers: list[float]
    take_in: list[float]
    next_index: int  # the first request not handed over yet (0 before the first step)

    def arrive(self, req: TraceRequest) -> None:
        """Record the request reaching the API server, at its trace arrival."""
        self.core.recorder.arrived(req.request_id, req.arrival_s, req.prompt_len,
                                   req.output_len)

    def take_due(self, clock: float) -> None:
        """Requests taken in by `clock` enter the input queue, each at its hand-over."""
        take_in = self.take_in
        while self.next_index < len(take_in) and take_in[self.next_index] <= clock:
            self._hand_over(self.next_index)

    def _hand_over(self, i: int) -> None:
        req = self.requests[i]
        self.arrive(req)
        prompt, self.outputs[req.request_id] = self.token_arrays(req)
        self.next_index = i + 1
        self.submit(self.make_request(req, prompt, req.output_len, self.arrival_stamp(i)),
                    self.handovers[i])

    def arrival_stamp(self, i: int) -> float:
        """`requests[i]`'s `arrival_time` in the core, seconds: its trace arrival. Only
        its order counts (the priority queue and victim), and one API server taking the
        trace in order stamps in that order (ties: add order, the same)."""
        return self.requests[i].arrival_s

    def idle_until(self) -> float | None:
        """The next take-in (None after the last: the run ends)."""
        i = self.next_index
        return self.take_in[i] if i < len(self.take_in) else None

    def steps_ahead_until(self) -> float:
        return math.inf

    def horizon(self) -> float:
        i = self.next_index
        return self.handovers[i] if i < len(self.handovers) else math.inf


@mypyc_attr(allow_interpreted_subclasses=True)  # the fleet's replicas
class _Simulation(KnownHandovers):
    """One engine behind its API server, no process of its own: hand-overs by Lindley's
    recursion (`handover_times`), taken in when a sleeping server would wake them."""

    def __init__(self, trace: Trace, config: SimConfig, cost_model: CostModel,
                 progress: Progress | None) -> None:
        super().__init__(simpy.Environment(), config, cost_model,
                         TraceBlockIds.of(trace))
        self.progress = progress
        self.requests = list(trace)
        self.handovers = handover_times(trace, config.api_server)
        self.take_in = server_wakes(self.handovers)
        self.next_index = 0

    def on_finished(self, records: list[RequestRecord]) -> None:
        if self.progress is not None:
            self.progress(self.notified, len(self.requests))

    def run_to_end(self, started_s: float) -> SimResult:
        """The engine's process to the end, then the records in trace order (wall seconds
        since `started_s`, `perf_counter`); then the pool is released (`release_pools`)."""
        self.env.process(self.engine())
        self.env.run()
        recorder = self.core.recorder
        assert not recorder.live, f"{len(recorder.live)} requests never finished"
        deliver_to_clients(recorder.finished, self.config.api_server)
        stats = self.core.scheduler.prefix_cache_stats
        order = {req.request_id: i for i, req in enumerate(self.requests)}
        result = SimResult(requests=sorted(recorder.finished, key=lambda r: order[r.request_id]),
                           step_columns=dict(recorder.step_columns),
                           prefix_cache_queries=stats.queries, prefix_cache_hits=stats.hits,
                           wall_s=time.perf_counter() - started_s)
        release_pools([self.core.scheduler.kv_cache_manager])
        return result


def simulate(trace: Trace, config: SimConfig, cost_model: CostModel,
             progress: Progress | None = None) -> SimResult:
    """Run the trace to completion; every request ends finished (or ignored). The
    collector meanwhile as `sim.run_gc` says."""
    started = time.perf_counter()
    return run_with_gc(lambda: _Simulation(trace, config, cost_model, progress)
                       .run_to_end(started))
