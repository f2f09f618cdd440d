"""Autoscaling in the loop (`simulate_autoscaled`): every `interval_s` each pool's policy
(`sim.scaling_policies`) reads the pool's serving replicas and its traffic over the last
interval and says how many replicas the pool wants; the autoscaler clamps that to
[min_replicas, the pool's size] and acts:

    scale up    a stopped replica starts (lowest index first): it is provisioned, and costs,
                from then; it takes traffic `startup_s` later (model load: `model_load_s`);
    scale down  starting replicas are cancelled first (they stop at once, as Kubernetes
                deletes not-ready pods first), then the most recently started serving
                replicas drain: they take no new request, finish what they hold (queued
                and in the API server included), and stop at the end of their last step.
A replica that stops loses its prefix cache (a new pod starts cold). Replica states:

    STOPPED --start--> STARTING --startup_s--> SERVING --drain--> DRAINING --idle--> STOPPED
                           `--cancel--> STOPPED

GPU-hours integrate each replica's GPUs from its start to its stop (or to the run's end:
the last request's finish). The run's records are `simulate_fleet`'s.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import simpy

from runtime.records import RequestRecord
from runtime.router import RouterPolicy
from sim.fleet import Replica, ReplicaSetup, _Fleet
from sim.fleet_records import FleetResult
from sim.model_config import ModelSpec
from sim.run_gc import run_with_gc
from sim.scaling_policies import PoolObservation, ScalingPolicy, WindowStats
from sim.simulator import Progress
from workloads import Trace

GB = 1e9
DISK_GBPS = 2.0  # one NVMe drive's sequential read (an assumption)
ENGINE_START_S = 20.0  # CUDA graph capture and the profiling run (an assumption)


def model_load_s(model: ModelSpec, tensor_parallel_size: int = 1,
                 disk_GBps: float = DISK_GBPS, engine_start_s: float = ENGINE_START_S) -> float:
    """Start-up delay of a replica: each GPU's weight shard read from disk in parallel, plus a
    fixed engine start."""
    return model.weight_bytes / tensor_parallel_size / (disk_GBps * GB) + engine_start_s


@dataclass(frozen=True, slots=True)
class ScalingPool:
    """A pool of identical replicas (`replicas`: their indices among the fleet's setups) and
    the policy that sizes it. Costs: `cost_per_hour` per replica."""

    name: str
    replicas: range
    policy: ScalingPolicy
    startup_s: float
    gpus_per_replica: int = 1
    cost_per_hour: float = 0.0
    min_replicas: int = 1
    initial_replicas: int | None = None  # default: min_replicas

    def __post_init__(self) -> None:
        initial = self.initial
        if not 1 <= self.min_replicas <= initial <= len(self.replicas):
            raise ValueError(f"pool {self.name!r}: need 1 <= min replicas ({self.min_replicas})"
                             f" <= initial ({initial}) <= max ({len(self.replicas)})")
        if not (math.isfinite(self.startup_s) and self.startup_s >= 0):
            raise ValueError(f"pool {self.name!r}: startup_s must be >= 0, "
                             f"got {self.startup_s}")

    @property
    def initial(self) -> int:
        return self.min_replicas if self.initial_replicas is None else self.initial_replicas


@dataclass(slots=True)
class PoolTimeline:
    """One pool's replica counts: from `times_s[k]` on, `serving[k]` take traffic and
    `provisioned[k]` are up (starting, serving or draining)."""

    name: str
    gpus_per_replica: int
    cost_per_hour: float  # per replica
    times_s: list[float] = field(default_factory=list)
    serving: list[int] = field(default_factory=list)
    provisioned: list[int] = field(default_factory=list)
    decisions: list[tuple[float, int]] = field(default_factory=list)  # (tick, wanted)
    gpu_hours: float = 0.0

    @property
    def cost(self) -> float:
        return self.gpu_hours / self.gpus_per_replica * self.cost_per_hour

    def record(self, now: float, serving: int, provisioned: int) -> None:
        if self.times_s and self.times_s[-1] == now:  # one entry per instant: the last state
            self.times_s.pop(), self.serving.pop(), self.provisioned.pop()
        if self.serving and (self.serving[-1], self.provisioned[-1]) == (serving, provisioned):
            return
        self.times_s.append(now)
        self.serving.append(serving)
        self.provisioned.append(provisioned)


@dataclass(slots=True)
class ScalingTimeline:
    """Every pool's timeline up to `end_s` (the last request's finish), GPU-hours and cost."""

    pools: list[PoolTimeline]
    end_s: float = 0.0
    policy: str | None = None  # None: a fixed fleet
    interval_s: float | None = None

    @property
    def gpu_hours(self) -> float:
        return sum(p.gpu_hours for p in self.pools)

    @property
    def cost(self) -> float:
        return sum(p.cost for p in self.pools)

    def to_json(self) -> dict[str, Any]:
        """run.json's "scaling" section."""
        return {"policy": self.policy, "interval_s": self.interval_s, "end_s": self.end_s,
                "gpu_hours": self.gpu_hours, "cost": self.cost,
                "pools": [{"name": p.name, "gpus_per_replica": p.gpus_per_replica,
                           "cost_per_hour": p.cost_per_hour, "gpu_hours": p.gpu_hours,
                           "cost": p.cost, "times_s": p.times_s, "serving": p.serving,
                           "provisioned": p.provisioned,
                           "decisions": [list(d) for d in p.decisions]} for p in self.pools]}


def fixed_timeline(names: Sequence[str], counts: Sequence[int], gpus: Sequence[int],
                   costs: Sequence[float], end_s: float) -> ScalingTimeline:
    """The timeline of a fleet that never scales: every replica up from 0 to `end_s`."""
    pools = [PoolTimeline(name, g, c, [0.0], [n], [n], gpu_hours=n * g * end_s / 3600)
             for name, n, g, c in zip(names, counts, gpus, costs, strict=True)]
    return ScalingTimeline(pools, end_s)


class State(Enum):
    STOPPED = 0
    STARTING = 1
    SERVING = 2
    DRAINING = 3


@dataclass(slots=True)
class _Window:
    """Sums over the requests a pool finished since the last tick."""

    arrived_before: int = 0  # requests that had reached the pool by the last tick
    finished: int = 0
    timed: int = 0  # finished with more than one output token (an ITL)
    prompt: float = 0.0
    output: float = 0.0
    ttft: float = 0.0
    itl: float = 0.0
    duration: float = 0.0

    def add(self, record: RequestRecord) -> None:
        if record.first_token_s is None or record.finish_s is None:
            return  # ignored or aborted: no latency to report
        self.finished += 1
        self.prompt += record.prompt_len
        self.output += record.output_len
        self.ttft += record.first_token_s - record.arrival_s
        self.duration += record.finish_s - record.arrival_s
        if record.output_len > 1:
            self.timed += 1
            self.itl += (record.finish_s - record.first_token_s) / (record.output_len - 1)

    def stats(self, arrived: int) -> WindowStats:
        n = self.finished
        return WindowStats(
            num_requests=arrived - self.arrived_before, num_finished=n,
            mean_prompt_len=self.prompt / n if n else None,
            mean_output_len=self.output / n if n else None,
            mean_ttft_s=self.ttft / n if n else None,
            mean_itl_s=self.itl / self.timed if self.timed else None,
            mean_duration_s=self.duration / n if n else None)


class _AutoscaledFleet(_Fleet):
    routes_ahead = False  # its choices read replica state at the arrival
    serving_fixed = False  # replicas start, drain and stop

    def __init__(self, trace: Trace, setups: Sequence[ReplicaSetup],
                 router: RouterPolicy | Sequence[RouterPolicy], pools: Sequence[ScalingPool],
                 interval_s: float, refresh_s: float, routing_latency_s: float,
                 progress: Progress | None, kv_event_delay_s: float = 0.0) -> None:
        super().__init__(trace, setups, router, refresh_s, routing_latency_s, progress,
                         kv_event_delay_s)
        if not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"the autoscaling interval must be > 0 s, got {interval_s}")
        covered = sorted(i for pool in pools for i in pool.replicas)
        if covered != list(range(len(setups))):
            raise ValueError("the pools must cover every replica setup exactly once")
        self.pools = list(pools)
        self.interval_s = interval_s
        self.pool_of = {i: k for k, pool in enumerate(pools) for i in pool.replicas}
        self.state = [State.STOPPED] * len(setups)
        self.up_since = [0.0] * len(setups)
        self.generation = [0] * len(setups)  # a cancelled start's ready event is stale
        self.gpu_s = [0.0] * len(pools)
        self.windows = [_Window() for _ in pools]
        self.timeline = [PoolTimeline(p.name, p.gpus_per_replica, p.cost_per_hour)
                         for p in pools]
        for pool in pools:
            for i in pool.replicas[:pool.initial]:
                self.state[i] = State.SERVING
        self.serving = [s is State.SERVING for s in self.state]
        for k in range(len(pools)):
            self._record(k, 0.0)

    def start_processes(self) -> None:
        super().start_processes()
        self.env.process(self.autoscaler())

    def autoscaler(self) -> Generator[simpy.Event, object, None]:
        while True:
            yield self.env.timeout(self.interval_s)
            if self.done >= len(self.trace):
                return
            for k in range(len(self.pools)):
                self._tick(k, self.env.now)

    def _tick(self, k: int, now: float) -> None:
        pool, window = self.pools[k], self.windows[k]
        arrived = sum(self._arrived(i) for i in pool.replicas)
        current = sum(self.state[i] in (State.STARTING, State.SERVING) for i in pool.replicas)
        serving = [self.replicas[i].snapshot(now) for i in pool.replicas
                   if self.state[i] is State.SERVING]
        starting = sum(self.state[i] is State.STARTING for i in pool.replicas)
        obs = PoolObservation(now, self.interval_s, current, serving, window.stats(arrived),
                              starting)
        wanted = min(max(pool.policy.desired(obs), pool.min_replicas), len(pool.replicas))
        self.timeline[k].decisions.append((now, wanted))
        self.windows[k] = _Window(arrived_before=arrived)
        for _ in range(wanted - current):
            self._start(k, now)
        for _ in range(current - wanted):
            self._remove(k, now)

    def _arrived(self, index: int) -> int:
        recorder = self.replicas[index].core.recorder
        return len(recorder.live) + len(recorder.finished)

    def _start(self, k: int, now: float) -> None:
        stopped = [i for i in self.pools[k].replicas if self.state[i] is State.STOPPED]
        if not stopped:
            return  # every replica is up (some still draining)
        i = stopped[0]
        self.state[i], self.up_since[i] = State.STARTING, now
        self.generation[i] += 1
        ready = self.env.timeout(self.pools[k].startup_s)
        ready.callbacks.append(functools.partial(self._ready, i, self.generation[i]))
        self._record(k, now)

    def _ready(self, i: int, generation: int, _: simpy.Event) -> None:
        if self.generation[i] != generation or self.state[i] is not State.STARTING:
            return
        self.state[i] = State.SERVING
        self.serving[i] = True
        self._record(self.pool_of[i], self.env.now)

    def _remove(self, k: int, now: float) -> None:
        """Cancel the newest starting replica, else drain the newest serving one."""
        for wanted in (State.STARTING, State.SERVING):
            mine = [i for i in self.pools[k].replicas if self.state[i] is wanted]
            if mine:
                i = max(mine, key=lambda j: (self.up_since[j], j))
                break
        else:
            return
        if self.state[i] is State.STARTING:
            self._stop(i, now)
            return
        self.state[i], self.serving[i] = State.DRAINING, False
        self._record(k, now)
        self._stop_if_drained(self.replicas[i])

    def finished(self, replica: Replica, records: list[RequestRecord]) -> None:
        super().finished(replica, records)
        window = self.windows[self.pool_of[replica.index]]
        for record in records:
            window.add(record)
        self._stop_if_drained(replica)

    def _stop_if_drained(self, replica: Replica) -> None:
        i = replica.index
        # idle, and every finish reported: the last step has ended (its results are in the
        # core from its start on)
        if (self.state[i] is State.DRAINING and not replica.core.has_work()
                and not replica.pending
                and replica.notified == len(replica.core.recorder.finished)):
            self._stop(i, self.env.now)

    def _stop(self, i: int, now: float) -> None:
        k = self.pool_of[i]
        self.gpu_s[k] += (now - self.up_since[i]) * self.pools[k].gpus_per_replica
        self.state[i], self.serving[i] = State.STOPPED, False
        reset = self.replicas[i].core.scheduler.reset_prefix_cache()
        assert reset, f"replica {i} stopped holding KV blocks"
        self.replicas[i].publish_kv_events(now)  # AllBlocksCleared, if a router listens
        self._record(k, now)

    def _record(self, k: int, now: float) -> None:
        states = [self.state[i] for i in self.pools[k].replicas]
        self.timeline[k].record(now, states.count(State.SERVING),
                                len(states) - states.count(State.STOPPED))

    def scaling(self, result: FleetResult, policy: str | None) -> ScalingTimeline:
        end = max((r.finish_s for r in result.requests if r.finish_s is not None),
                  default=0.0)
        for i, state in enumerate(self.state):
            if state is not State.STOPPED:
                k = self.pool_of[i]
                self.gpu_s[k] += max(0.0, end - self.up_since[i]) * \
                    self.pools[k].gpus_per_replica
        for line, seconds in zip(self.timeline, self.gpu_s, strict=True):
            line.gpu_hours = seconds / 3600
        return ScalingTimeline(self.timeline, end, policy, self.interval_s)


def simulate_autoscaled(trace: Trace, replicas: Sequence[ReplicaSetup],
                        router: RouterPolicy | Sequence[RouterPolicy],
                        pools: Sequence[ScalingPool], interval_s: float = 10.0,
                        refresh_s: float = 0.05, routing_latency_s: float = 0.0,
                        progress: Progress | None = None, policy_name: str | None = None,
                        kv_event_delay_s: float = 0.0,
                        ) -> tuple[FleetResult, ScalingTimeline]:
    """`simulate_fleet` with `pools` autoscaled every `interval_s` (see the module docstring).

    Args:
        replicas: every replica a pool may start (its size: the pool's max replicas).
        pools: partition `replicas` by index; each pool's first `initial` replicas serve
            from t = 0, the rest start stopped.
        policy_name: recorded in the timeline.
    Returns the records and the scaling timeline (counts, GPU-hours, cost)."""
    started = time.perf_counter()

    def run() -> tuple[FleetResult, ScalingTimeline]:
        fleet = _AutoscaledFleet(trace, replicas, router, pools, interval_s, refresh_s,
                                 routing_latency_s, progress, kv_event_delay_s)
        result = fleet.run_to_end(started)
        return result, fleet.scaling(result, policy_name)

    return run_with_gc(run)
