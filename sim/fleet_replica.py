"""One engine of a fleet (`sim.fleet`): its API server queue and the single-engine simulator's
engine loop, reporting first tokens and finishes to the fleet when the step that produced
them ends (a pre-routed replica: both when the step that finishes the request ends). Three
kinds, chosen once per run by what the routers read:

    Replica          routed requests wait in `pending` as engine requests; with stepping
                     ahead, due ones enter in `take_due` and idle gaps are jumped; behind
                     routers reading completions only, it sleeps through plain decode runs
                     (`sleep_through_run`)
    KvReplica        a router reads its pool's KV events: steps and runs publish them at
                     their end, and runs end by the next decision minus the delay
    PreRoutedReplica every router is blind to replicas, completions and token ids: the whole
                     trace is routed first, and the replica runs its share to the end in one
                     go, building each request when it is due and reporting first
                     tokens with finishes (docs/fleet.md)
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Collection, Generator, Mapping, MutableSequence, Sequence
from functools import partial
from operator import itemgetter
from typing import Protocol, cast

import simpy

from runtime import KVCacheBlock, Recorder, Request
from runtime.kv_events import KvEventLog, observe_kv_events
from runtime.records import RequestRecord
from runtime.router import ReplicaSnapshot
from sim.api_server import server_wakes
from sim.block_ids import TraceBlockIds
from sim.cost.api_server import ApiServerCost
from sim.cost.base import CostModel
from sim.engine_args import with_noise_seed
from sim.fleet_kv import run_before
from sim.fleet_records import FleetRequestRecord
from sim.fleet_router import KvEventBus
from sim.simulator import EngineProcess, KnownHandovers, SimConfig
from workloads import TraceRequest


class ReplicaSetup(Protocol):
    """What one replica needs (`sim.engine_args.SimSetup` is one)."""

    @property
    def config(self) -> SimConfig: ...

    @property
    def cost_model(self) -> CostModel: ...


class FleetView(Protocol):
    """What a replica reads of its fleet (`sim.fleet._Fleet`)."""

    env: simpy.Environment
    block_ids: TraceBlockIds
    kv_bus: KvEventBus
    next_index: int  # the first request of the trace not yet routed
    latency_s: float  # routing latency, s
    stack_delay_s: Mapping[str, float]  # per request id, s after the API server (or absent)
    steps_ahead: bool  # fixed for the run (docs/fleet.md, stepping ahead)
    sleeps_through_runs: bool  # fixed for the run (docs/fleet.md, sleeping through runs)
    spare_blocks: list[KVCacheBlock]  # released by replicas whose share is done
    spare_holder: int | None  # the replica whose pool makes blocks of them now
    step_columns: dict[str, MutableSequence[object]]  # `PreRoutedReplica`s' steps, in turn

    def handover_bounds(self, api: ApiServerCost) -> list[float]: ...

    def arrives_at(self, at_s: float) -> bool: ...

    def kv_run_limit_s(self) -> float: ...

    def first_token(self, replica: Replica, request_id: str) -> None: ...

    def finished(self, replica: Replica, records: list[RequestRecord]) -> None: ...


def _wake(event: simpy.Event, _: simpy.Event | None = None) -> None:
    """Wake a sleeping replica (its run's end, or a hand-over) unless already woken."""
    if not event.triggered:
        event.succeed()


# How far ahead a sleeping replica plans its run (simulated seconds): a request routed to it
# cuts the plan, and a longer run is slept through in several plans (step noise times each
# step on its own: an unbounded plan cut early was most of a noisy fleet's time).
_PLAN_AHEAD_S = 1.0

_NOISE_SEED_STRIDE = 0x9E3779B1  # replica i's step-noise seed: the config's + i * this


def own_noise(config: SimConfig, index: int) -> SimConfig:
    """Replica `index`'s config with step noise of its own (GPUs vary independently);
    replica 0 keeps the config's, so one replica runs as the single-engine simulator."""
    noise = config.step_noise
    if noise is None or index == 0:
        return config
    return with_noise_seed(config, noise.seed + index * _NOISE_SEED_STRIDE)


class Replica(EngineProcess):
    """One engine behind the router: its API server queue and the simulator's engine loop,
    reporting first tokens and finishes to the fleet when the step that produced them ends
    (`PreRoutedReplica` overrides it: both when the step that finishes the request ends)."""

    def __init__(self, fleet: FleetView, index: int, setup: ReplicaSetup,
                 recorder: Recorder | None = None) -> None:
        """`recorder`: the core's (by default its own)."""
        super().__init__(fleet.env, own_noise(setup.config, index), setup.cost_model,
                         fleet.block_ids, recorder)
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
        self.sleeps_through_runs = fleet.sleeps_through_runs
        self.asleep: simpy.Event | None = None  # in `sleep_through_run`: a hand-over wakes it
        self.kv_log: KvEventLog | None = None  # the pool's KV events (`KvReplica`)

    def hand_over(self, req: TraceRequest, prompt: array[int], output: array[int],
                  reached_s: float, max_tokens: int | None = None,
                  hashes: Sequence[bytes] = ()) -> None:
        """The request reaches this replica's API server at `reached_s` (now or later);
        `max_tokens` defaults to the trace's output length; `hashes`: its block names."""
        max_tokens = req.output_len if max_tokens is None else max_tokens
        self.arrived(req, reached_s, max_tokens)
        request = self.make_request(req, prompt, max_tokens, self.api_start(reached_s),
                                    hashes or None)  # stamped before its API server's turn
        handover = self.stack_handover(req, reached_s)
        self.outputs[req.request_id] = output
        entry = (handover, request)
        pending = self.pending
        if pending and handover < pending[-1][0]:  # a shorter stack delay: ahead of others
            insort(pending, entry, key=itemgetter(0))
        else:
            pending.append(entry)
        if self.asleep is not None:  # it may cut the run: woken before its hand-over's
            _wake(self.asleep)  # timeout is made, so an instant hand-over finds it cut
        # (an instant hand-over's time may round a hair below now: no negative delay)
        self.env.timeout(max(handover - self.env.now, 0.0)).callbacks.append(
            partial(self._handover_due, handover))

    def arrived(self, req: TraceRequest, reached_s: float, max_tokens: int) -> None:
        """Record the request reaching the API server at `reached_s`; its record is the
        fleet's row from the start (`sim.fleet_records.assembled_result` completes it)."""
        record = self.core.recorder.arrived(req.request_id, reached_s, req.prompt_len,
                                            max_tokens, FleetRequestRecord)
        cast(FleetRequestRecord, record).replica = self.index
        cast(FleetRequestRecord, record).routing_s = reached_s - req.arrival_s

    def api_start(self, reached_s: float) -> float:
        """When the API server (FIFO) starts on a prompt reaching it at `reached_s`: its
        `arrival_time` stamp, as vLLM's (docs/engine-core.md, "Arrival ties"), seconds."""
        return max(self.api_free_at, reached_s)

    def api_handover(self, reached_s: float, prompt_len: int) -> float:
        """When the API server (FIFO) hands a prompt reaching it at `reached_s` to the core."""
        handover = self.api_start(reached_s) + self.config.api_server.time(prompt_len)
        self.api_free_at = handover
        return handover

    def stack_handover(self, req: TraceRequest, reached_s: float) -> float:
        """`api_handover`, then the request's serving-stack delay (the fleet's
        `stack_delay_s`; none: 0), seconds."""
        handover = self.api_handover(reached_s, req.prompt_len)
        delays = self.fleet.stack_delay_s
        return handover + delays.get(req.request_id, 0.0) if delays else handover

    def _handover_due(self, due: float, _: simpy.Event) -> None:
        """The timeout of the hand-over at `due` (seconds) fired: `enter_due(due)`. Its own
        time, not the event loop's: the timeout fires at now + (due - now), which may round
        a float's last bit below `due`."""
        self.enter_due(due)

    def enter_due(self, due: float) -> None:
        """Every pending request handed over by `due` (seconds) enters the core, in
        hand-over order. So a hand-over's timeout never leaves its request behind one due
        before it that it took (a shorter stack delay puts a later-routed request first,
        and timeouts of nearly equal times may fire in either order); each other one's
        timeout then finds its request taken."""
        pending = self.pending
        while pending and pending[0][0] <= due:
            handover, request = pending.popleft()
            self.submit(request, handover)

    def take_due(self, clock: float) -> None:
        if self.ahead:
            self.enter_due(clock)

    def idle_until(self) -> float | None:
        # stepping ahead: an idle gap up to a routed request due before anything unrouted
        # could be is jumped as a step is (its `_handover_due` then finds it taken)
        pending = self.pending
        if self.ahead and pending and pending[0][0] < self.steps_ahead_until():
            return pending[0][0]
        return None

    def submit(self, request: Request, now: float) -> None:
        self.awaiting_first.add(request.request_id)
        super().submit(request, now)

    def sleep_through_run(self, clock: float) -> Generator[simpy.Event, object, None]:
        """Sleeping through runs (docs/fleet.md): with no routed request waiting for its
        hand-over, plan the run from `clock` (at most `_PLAN_AHEAD_S` of it); while a
        request not yet routed could still come here before it ends, sleep until it ends
        or until the router routes one here, whichever is first; the loop then
        fast-forwards up to `horizon` as it would have at each arrival, in one run (the
        plan's, if nothing came). Nothing the routers read changes inside a plain decode
        run (no first token; finishes only in its last step, reported at its end), so they
        route as if it had been run step by step. Not where the run would end exactly at
        an arrival: the tie is left to the event loop's order, as when cutting."""
        if self.pending:  # its hand-over enters the core during the run: cut as routed
            return
        plan = self.planned = self.plan_run(clock, clock + _PLAN_AHEAD_S)
        if plan is None:  # the next step is no plain decode: `fast_forward` plans no run
            self.no_run = True
            return
        fleet = self.fleet
        if plan.end <= self.bounds[fleet.next_index] or fleet.arrives_at(plan.end):
            return  # nothing unrouted can come here within the run (or a tie): run it now
        env = self.env
        self.asleep = woken = env.event()
        env.timeout(max(plan.end - env.now, 0.0)).callbacks.append(partial(_wake, woken))
        yield woken
        self.asleep = None

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
        # ignores: step columns are typed MutableSequence[object] (`new_step_columns`);
        # kv_usage is an array("d"), the counts arrays("q") (a check per snapshot: hot)
        usage = min(max(float(columns["kv_usage"][k]), 0.0), 1.0)  # type: ignore[arg-type]
        return ReplicaSnapshot(
            replica_id=self.index, taken_at_s=at_s,
            num_waiting=columns["num_waiting"][k],  # type: ignore[arg-type]
            num_running=columns["num_running"][k],  # type: ignore[arg-type]
            kv_usage=usage, num_gpu_blocks=blocks)


class KvReplica(Replica):
    """A replica whose pool's KV events a router reads: each step and decode run publishes
    them at its end, and runs end by the next decision minus the delay (`sim.fleet_kv`)."""

    def __init__(self, fleet: FleetView, index: int, setup: ReplicaSetup) -> None:
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


class PreRoutedReplica(KnownHandovers, Replica):
    """A replica of a fleet whose routers read nothing of the replicas, their completions
    or token ids (`_Fleet.pre_routed`): every request is routed before any step runs, so
    nothing can enter this core but its own share, and nothing it reports is read before
    the run ends. It is the single-engine simulator on its share (`KnownHandovers`: the
    same take-ins, at a sleeping API server's wakes, idle jumps and fast paths), run to the
    end without the event loop, one replica after another; its requests are built when
    handed over, so routing the whole trace first holds one request and two floats per
    request. Its records are the fleet's rows from their arrival; the policy hears each
    request's first token and finish at the end of the step that finishes it (nothing
    reads them before the run ends)."""

    def __init__(self, fleet: FleetView, index: int, setup: ReplicaSetup) -> None:
        # The replicas run one after another: each appends its steps to the fleet's one set
        # of step columns (the result's, no join; large arrays grow in place where 64 sets
        # of ~10k steps were copied as they grew)
        super().__init__(fleet, index, setup, Recorder(fleet.step_columns))
        self.requests, self.handovers, self.take_in = [], [], []
        self.stamps: list[float] = []  # stamps[i]: requests[i]'s `api_start`, s
        self.next_index = 0
        self.latency_s = fleet.latency_s

    def engine(self) -> Generator[simpy.Event, object, None]:
        # The replicas run one after another: its rows follow theirs, and it makes its
        # never-used blocks of the blocks they released, by id (same ids and order; no new
        # objects to build, collect and free, none renamed). One pool at a time holds the
        # spares (a released spare and one in use look alike: both have one reference).
        fleet = self.fleet
        if fleet.spare_holder is not None:
            raise AssertionError(f"replica {self.index} started while replica "
                                 f"{fleet.spare_holder} still holds the spare blocks")
        fleet.spare_holder = self.index
        self.core.scheduler.kv_cache_manager.block_pool.reuse(fleet.spare_blocks)
        self.core.recorder.follow()
        yield from super().engine()

    def snapshot(self, at_s: float) -> ReplicaSnapshot:
        """Never read: a pre-routed fleet's routers read nothing of the replicas (and its
        step columns hold every replica's rows, so `end_s` is not this replica's)."""
        raise AssertionError("a pre-routed fleet's routers read no replica snapshot")

    def reached_s(self, req: TraceRequest) -> float:
        """When the request reaches this replica's API server: its arrival + the fleet's
        routing latency (seconds)."""
        return req.arrival_s + self.latency_s

    def hand_over_later(self, req: TraceRequest) -> None:
        """Route the request here (in trace order); it is built when handed over, and taken
        in when `simulate`'s API server would wake for it (`order_handovers`)."""
        reached_s = self.reached_s(req)
        self.requests.append(req)
        self.stamps.append(self.api_start(reached_s))
        self.handovers.append(self.stack_handover(req, reached_s))

    def order_handovers(self, reorder: bool) -> None:
        """Once every request is routed: with `reorder` (serving-stack delays can put a
        later-routed request first), the share in hand-over order (ties in routing order);
        then the take-ins at a sleeping server's wakes (`server_wakes`)."""
        if reorder:
            order = sorted(range(len(self.handovers)), key=self.handovers.__getitem__)
            self.requests = [self.requests[i] for i in order]
            self.handovers = [self.handovers[i] for i in order]
            self.stamps = [self.stamps[i] for i in order]
        self.take_in = server_wakes(self.handovers)

    def arrive(self, req: TraceRequest) -> None:
        self.arrived(req, self.reached_s(req), req.output_len)

    def arrival_stamp(self, i: int) -> float:
        return self.stamps[i]

    def wait_for_work(self) -> Generator[simpy.Event, object, float]:
        if self.next_index == len(self.take_in):  # its share is done: no block is used again
            self.hand_on_blocks()
        return (yield from super().wait_for_work())

    def hand_on_blocks(self) -> None:
        """Release the pool's blocks to the fleet's spares, for the replicas after it. Not
        in `wait_for_work`, whose frame stays suspended to the end: its locals (the
        released list, ~25k blocks at 64 replicas) would live on, and young collections
        walk them once each (64 replicas on the Azure excerpt: 1.79M list items walked,
        against 0.38M at 4 replicas)."""
        released = self.core.scheduler.kv_cache_manager.release_blocks()  # ids 1, 2, ...
        spares = self.fleet.spare_blocks  # by id, as `released`: which starts with the
        spares += released[len(spares):]  # spares it made blocks of, then new objects
        self.fleet.spare_holder = None

    def submit(self, request: Request, now: float) -> None:
        EngineProcess.submit(self, request, now)  # no first token awaited step by step

    def on_step_end(self, sampled: Collection[str]) -> None:
        self.report_finished()

    def on_finished(self, records: list[RequestRecord]) -> None:
        for record in records:
            if record.first_token_s is not None:
                self.fleet.first_token(self, record.request_id)
        self.fleet.finished(self, records)
