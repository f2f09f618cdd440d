"""Autoscaling in the loop (`simulate_autoscaled`): a policy, evaluated every `interval_s`
over the fleet's own metrics, sets how many replicas take traffic.

    tick        every interval_s: the policy reads the serving replicas' snapshots (what the
                router sees: KV usage, waiting, running) and returns a replica count,
                clamped to [min_replicas, number of replica setups];
    scale up    a stopped replica starts: provisioned at once (it costs from then), it takes
                traffic `startup_s` later (model load: weights / disk bandwidth, plus a fixed
                engine start; `startup_s`);
    scale down  the newest serving replica stops taking traffic and drains: it finishes what
                it holds, then stops (it costs until its last step ends).
Replicas are the given setups, started in index order (the first `initial_replicas` serve
from t = 0). Output: a `ScalingTimeline` (serving and provisioned counts over time) and
GPU-hours; `simulate_fleet`'s records otherwise.

`KvThreshold` is llm-d's workload variant autoscaler as BLIS models it: scale up by one when
the mean KV usage of the serving replicas is above 0.8 (or the mean waiting queue is at least
`scale_up_waiting`), down by one when it has stayed below 0.3 for the whole down
stabilisation window (5 minutes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import simpy

from runtime.router import ReplicaSnapshot, RouterPolicy
from sim.fleet import ReplicaSetup, _Fleet
from sim.fleet_records import FleetResult
from sim.model_config import ModelSpec
from sim.simulator import Progress
from workloads import Trace

GB = 1e9


def model_load_s(model: ModelSpec, tensor_parallel_size: int = 1, disk_GBps: float = 2.0,
                 engine_start_s: float = 20.0) -> float:
    """Start-up delay of a replica: each GPU's weight shard read from disk (2 GB/s: one NVMe
    drive, an assumption) in parallel, plus a fixed engine start (CUDA graphs, profiling
    run; 20 s, an assumption)."""
    return model.weight_bytes / tensor_parallel_size / (disk_GBps * GB) + engine_start_s


class ScalingPolicy(Protocol):
    def desired(self, now_s: float, serving: Sequence[ReplicaSnapshot], current: int) -> int:
        """Replicas wanted, given the serving replicas' snapshots and the current target."""
        ...


@dataclass(slots=True)
class KvThreshold:
    """llm-d WVA-style thresholds (BLIS: tick 10 s, up 0.8, down 0.3, 5 min down window)."""

    scale_up_kv: float = 0.8
    scale_down_kv: float = 0.3
    scale_up_waiting: float = 4.0  # mean waiting requests per replica (an assumption)
    down_window_s: float = 300.0
    _low_since: float | None = field(default=None, repr=False)

    def desired(self, now_s: float, serving: Sequence[ReplicaSnapshot], current: int) -> int:
        if not serving:
            return current
        kv = sum(s.kv_usage for s in serving) / len(serving)
        waiting = sum(s.num_waiting for s in serving) / len(serving)
        if kv > self.scale_up_kv or waiting >= self.scale_up_waiting:
            self._low_since = None
            return current + 1
        if kv >= self.scale_down_kv:
            self._low_since = None
            return current
        if self._low_since is None:
            self._low_since = now_s
        if now_s - self._low_since >= self.down_window_s:
            self._low_since = now_s  # the window starts again after each step down
            return current - 1
        return current


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    interval_s: float = 10.0
    startup_s: float = 30.0
    initial_replicas: int = 1
    min_replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("interval_s", "startup_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0) or (name == "interval_s"
                                                              and value == 0):
                raise ValueError(f"{name} must be a finite number > 0 (startup_s >= 0), "
                                 f"got {value}")
        if not 1 <= self.min_replicas <= self.initial_replicas:
            raise ValueError(f"need 1 <= min_replicas ({self.min_replicas}) <= "
                             f"initial_replicas ({self.initial_replicas})")


@dataclass(slots=True)
class ScalingTimeline:
    """Replica counts over time: `times_s[k]` onwards, `serving[k]` take traffic and
    `provisioned[k]` are up (serving, starting or draining). `gpu_hours` integrates the
    provisioned replicas' GPUs up to `end_s` (the last request's finish)."""

    times_s: list[float] = field(default_factory=list)
    serving: list[int] = field(default_factory=list)
    provisioned: list[int] = field(default_factory=list)
    end_s: float = 0.0
    gpu_hours: float = 0.0


class _AutoscaledFleet(_Fleet):
    def __init__(self, trace: Trace, setups: Sequence[ReplicaSetup], gpus_per_replica: int,
                 policy: RouterPolicy, scaling: ScalingPolicy, config: AutoscaleConfig,
                 refresh_s: float, routing_latency_s: float,
                 progress: Progress | None) -> None:
        if config.initial_replicas > len(setups):
            raise ValueError(f"initial_replicas ({config.initial_replicas}) > the "
                             f"{len(setups)} replica setups")
        super().__init__(trace, setups, policy, refresh_s, routing_latency_s, progress)
        self.scaling = scaling
        self.config = config
        self.gpus = gpus_per_replica
        n = len(setups)
        self.serving = [i < config.initial_replicas for i in range(n)]
        self.up_since: list[float | None] = [0.0 if s else None for s in self.serving]
        self.draining: set[int] = set()
        self.target = config.initial_replicas
        self.gpu_seconds = 0.0
        self.timeline = ScalingTimeline()
        self._record(0.0)

    def start_processes(self) -> None:
        super().start_processes()
        self.env.process(self.autoscaler())

    def autoscaler(self) -> Generator[simpy.Event, object, None]:
        while self.done < len(self.trace):
            yield self.env.timeout(self.config.interval_s)
            if self.done >= len(self.trace):
                break
            now = self.env.now
            self._settle_drained()
            snapshots = self.snapshots(now)
            serving = [snapshots[i] for i, on in enumerate(self.serving) if on]
            wanted = self.scaling.desired(now, serving, self.target)
            wanted = min(max(wanted, self.config.min_replicas), len(self.replicas))
            if wanted > self.target:
                self._start(wanted - self.target, now)
            elif wanted < self.target:
                self._drain(self.target - wanted, now)
            self.target = wanted

    def _start(self, count: int, now: float) -> None:
        stopped = [i for i, up in enumerate(self.up_since) if up is None]
        for index in stopped[:count]:
            self.up_since[index] = now
            ready = self.env.timeout(self.config.startup_s)
            ready.callbacks.append(lambda _, i=index: self._ready(i))
        self._record(now)

    def _ready(self, index: int) -> None:
        self.serving[index] = True
        self._record(self.env.now)

    def _drain(self, count: int, now: float) -> None:
        newest = [i for i in reversed(range(len(self.replicas))) if self.serving[i]]
        for index in newest[:count]:
            self.serving[index] = False
            self.draining.add(index)
        self._record(now)

    def _settle_drained(self) -> None:
        """Stop draining replicas that hold nothing any more (at their last step's end)."""
        for index in sorted(self.draining):
            replica = self.replicas[index]
            if replica.core.has_work() or replica.pending:
                continue
            up = self.up_since[index]
            assert up is not None
            last = replica.end_s[-1] if replica.end_s else up
            self.gpu_seconds += (max(last, up) - up) * self.gpus
            self.up_since[index] = None
            self.draining.discard(index)
            self._record(self.env.now)

    def _record(self, now: float) -> None:
        line = self.timeline
        line.times_s.append(now)
        line.serving.append(sum(self.serving))
        line.provisioned.append(sum(up is not None for up in self.up_since))

    def result(self, wall_s: float) -> FleetResult:
        result = super().result(wall_s)
        end = max((r.finish_s for r in result.requests if r.finish_s is not None),
                  default=0.0)
        for index, up in enumerate(self.up_since):
            if up is not None:
                ends = self.replicas[index].end_s
                last = max(end, ends[-1] if ends else 0.0) if index not in self.draining \
                    else (ends[-1] if ends else up)
                self.gpu_seconds += (max(last, up) - up) * self.gpus
        self.timeline.end_s = end
        self.timeline.gpu_hours = self.gpu_seconds / 3600
        return result


def simulate_autoscaled(trace: Trace, replicas: Sequence[ReplicaSetup], policy: RouterPolicy,
                        scaling: ScalingPolicy, config: AutoscaleConfig | None = None,
                        gpus_per_replica: int = 1, refresh_s: float = 0.05,
                        routing_latency_s: float = 0.0,
                        progress: Progress | None = None) -> tuple[FleetResult, ScalingTimeline]:
    """`simulate_fleet` over up to `len(replicas)` replicas, as many serving as `scaling`
    wants (see the module docstring). Returns the records and the scaling timeline."""
    config = config if config is not None else AutoscaleConfig()
    started = time.perf_counter()
    fleet = _AutoscaledFleet(trace, replicas, gpus_per_replica, policy, scaling, config,
                             refresh_s, routing_latency_s, progress)
    fleet.run()
    result = fleet.result(time.perf_counter() - started)
    return result, fleet.timeline
