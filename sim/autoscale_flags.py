"""`rt simulate --autoscale POLICY`: the flags (`AutoscaleFlags`) and the fleet they run.

With --replicas N the fleet is one pool ("default") of at most N replicas (or
--max-replicas); with --fleet FILE each pool is scaled on its own, at most its `count` (or
--max-replicas) replicas. Every pool starts with --min-replicas serving. A replica costs its
pool's `cost_per_hour`, or --gpu-cost-per-hour x its GPUs where the pool names none.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from runtime.flags import Typed, flag, given_options
from sim.autoscale import (
    ScalingPool,
    ScalingTimeline,
    fixed_timeline,
    model_load_s,
    simulate_autoscaled,
)
from sim.engine_args import SimSetup
from sim.fleet_config import MAX_REPLICAS, FleetFlags, FleetSpec, build_fleet
from sim.fleet_records import FleetResult
from sim.hardware import MAX_USD_PER_GPU_HOUR
from sim.scaling_policies import (
    DEFAULT_INTERVAL_S,
    POLICIES,
    EngineBench,
    make_scaling_policy,
    scaling_args,
)
from sim.simulator import Progress
from workloads import Trace
from workloads.trace import MAX_ARRIVAL_S

AUTOSCALE_PANEL = "Autoscaling (replicas added and drained in the loop)"
# Seconds between scaling decisions: at least 0.1 s (1e-300 s hung, deciding forever at one
# instant), at most a trace's longest span (1e308 s failed: 'Maximum allowed size exceeded').
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, MAX_ARRIVAL_S
# What tunes the scaling loop: given without --autoscale, each would be ignored
AUTOSCALE_TUNING = ("autoscale_interval_s", "autoscale_arg", "min_replicas", "max_replicas",
                    "startup_s")


@dataclass(frozen=True, slots=True)
class AutoscaleFlags:
    """Which scaling policy, how often, within which bounds, and what a GPU costs."""

    autoscale: str | None = flag(None, "--autoscale", "Scale each pool in the loop: "
                                 "kv-threshold (llm-d's variant autoscaler: up above 0.8 KV "
                                 "use, down below 0.3 for 5 min) or dynamo-planner (Dynamo's "
                                 "throughput planner, TTFT 500 ms / ITL 50 ms targets). "
                                 "--replicas N (or each pool's count) is the most replicas.",
                                 AUTOSCALE_PANEL)
    autoscale_interval_s: float | None = flag(None, "--autoscale-interval-s", "Seconds "
                                              "between decisions (default: the policy's, "
                                              "kv-threshold 10, dynamo-planner 180).",
                                              AUTOSCALE_PANEL)
    autoscale_arg: list[str] | None = flag(None, "--autoscale-arg", "KEY=VALUE argument of "
                                           "the policy (repeat): kv-threshold scale_up_kv, "
                                           "scale_down_kv, scale_up_waiting, down_window_s; "
                                           "dynamo-planner ttft_ms, itl_ms, correction.",
                                           AUTOSCALE_PANEL)
    min_replicas: int = flag(1, "--min-replicas", "Fewest replicas per pool (serving at the "
                             "start).", AUTOSCALE_PANEL)
    max_replicas: int | None = flag(None, "--max-replicas", "Most replicas per pool "
                                    "(default: --replicas N or the pool's count).",
                                    AUTOSCALE_PANEL)
    startup_s: float | None = flag(None, "--startup-s", "Seconds from a replica's start to "
                                   "its first request (default: weights per GPU at 2 GB/s "
                                   "from disk + 20 s engine start).", AUTOSCALE_PANEL)
    gpu_cost_per_hour: float = flag(0.0, "--gpu-cost-per-hour", "Price of a GPU-hour, for "
                                    "--replicas and pools without cost_per_hour (also "
                                    "without --autoscale).", AUTOSCALE_PANEL)

    def __post_init__(self) -> None:
        if self.autoscale is not None and self.autoscale not in POLICIES:
            raise ValueError(f"--autoscale must be one of {', '.join(POLICIES)}, "
                             f"got {self.autoscale!r}")
        for name in ("autoscale_interval_s", "startup_s", "gpu_cost_per_hour"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.gpu_cost_per_hour > MAX_USD_PER_GPU_HOUR:
            raise ValueError(f"--gpu-cost-per-hour must be at most {MAX_USD_PER_GPU_HOUR:g}, "
                             f"got {self.gpu_cost_per_hour}")
        if self.autoscale_interval_s == 0:
            raise ValueError("--autoscale-interval-s must be > 0")
        interval = self.autoscale_interval_s
        if interval is not None and not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S:
            raise ValueError(f"--autoscale-interval-s must be in [{MIN_INTERVAL_S:g}, "
                             f"{MAX_INTERVAL_S:,.0f}] s, got {interval}")
        if self.min_replicas < 1 or (self.max_replicas is not None
                                     and self.max_replicas < self.min_replicas):
            raise ValueError(f"need 1 <= --min-replicas ({self.min_replicas}) <= "
                             f"--max-replicas ({self.max_replicas})")
        for name in ("min_replicas", "max_replicas"):  # as --replicas (1e14: a MemoryError)
            value = getattr(self, name)
            if value is not None and value > MAX_REPLICAS:
                raise ValueError(f"--{name.replace('_', '-')} must be at most {MAX_REPLICAS}, "
                                 f"got {value}")
        self.check_applies()
        if self.autoscale is not None:  # a bad --autoscale-arg: one line before any output
            scaling_args(self.autoscale, self.autoscale_arg or [])

    def check_applies(self, typed: Typed | None = None) -> None:
        """ValueError naming a flag of the scaling loop given without --autoscale
        (`given_options`: on the command line `typed`, else other than its default)."""
        if self.autoscale is None and (given := given_options(self, AUTOSCALE_TUNING, typed)):
            raise ValueError(f"{given[0]} needs --autoscale")

    def check_pool_sizes(self, spec: FleetSpec | None, replicas: int) -> None:
        """ValueError when --min-replicas is above a pool's most replicas (--replicas N or the
        pool's count, when --max-replicas does not set it), or when the pools' most replicas
        sum past a fleet's MAX_REPLICAS, before any output."""
        if self.autoscale is None:
            return
        if self.max_replicas is not None:  # (below --min-replicas: refused in __post_init__)
            pools = 1 if spec is None else len(spec.pools)
            if pools * self.max_replicas > MAX_REPLICAS:  # each pool holds that many
                raise ValueError(f"--max-replicas {self.max_replicas} for each of {pools} "
                                 f"pools is {pools * self.max_replicas:,} replicas; a fleet "
                                 f"holds at most {MAX_REPLICAS}")
            return
        sizes = ([("--replicas", replicas)] if spec is None
                 else [(f"pool {p.name!r}'s count", p.count) for p in spec.pools])
        for what, size in sizes:
            if self.min_replicas > size:
                raise ValueError(f"--min-replicas {self.min_replicas} is above {what} {size} "
                                 "(the most replicas of a pool; or give --max-replicas)")

    @property
    def enabled(self) -> bool:
        return self.autoscale is not None

    @property
    def interval_s(self) -> float:
        assert self.autoscale is not None
        return self.autoscale_interval_s or DEFAULT_INTERVAL_S[self.autoscale]

    def describe(self) -> dict[str, Any]:
        """run.json's "autoscale" section."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True, slots=True)
class _Pool:
    name: str
    count: int
    gpus: int  # per replica
    cost_per_hour: float  # per replica
    setup: SimSetup | None  # its replicas' (None: not built)


def _pools(setup: SimSetup, spec: FleetSpec | None, replicas: int, flags: AutoscaleFlags,
           size: int | None = None, build: bool = False) -> list[_Pool]:
    """The fleet's pools, each of `size` replicas (None: as given), with their setups when
    `build` (ValueError naming a pool that cannot be built)."""
    if spec is None:
        tp = setup.engine_args.tensor_parallel_size
        return [_Pool("default", size or replicas, tp, flags.gpu_cost_per_hour * tp, setup)]
    sized = FleetSpec(tuple(dataclasses.replace(p, count=size or p.count) for p in spec.pools))
    config = setup.config
    setups = build_fleet(sized, config.seed, config.check_invariants,
                         config.step_noise is not None) if build else None
    pools, start = [], 0
    for pool in sized.pools:
        tp = pool.engine_args.tensor_parallel_size
        cost = pool.cost_per_hour or flags.gpu_cost_per_hour * tp
        pools.append(_Pool(pool.name, pool.count, tp, cost, setups[start] if setups else None))
        start += pool.count
    return pools


def simulate_autoscaled_fleet(trace: Trace, setup: SimSetup, spec: FleetSpec | None,
                              fleet: FleetFlags, flags: AutoscaleFlags,
                              progress: Progress | None = None
                              ) -> tuple[FleetResult, ScalingTimeline]:
    """The fleet of `--replicas`/`--fleet` (`setup`: the engine flags' replica), each pool
    scaled by `flags.autoscale` (`sim.autoscale.simulate_autoscaled`)."""
    assert flags.autoscale is not None
    setups: list[SimSetup] = []
    scaling = []
    for pool in _pools(setup, spec, fleet.replicas, flags, flags.max_replicas, build=True):
        assert pool.setup is not None
        bench = EngineBench.of(pool.setup.config, pool.setup.cost_model, pool.gpus)
        policy = make_scaling_policy(flags.autoscale, flags.autoscale_arg or [], bench)
        startup = (flags.startup_s if flags.startup_s is not None
                   else model_load_s(pool.setup.model, pool.gpus))
        indices = range(len(setups), len(setups) + pool.count)
        scaling.append(ScalingPool(pool.name, indices, policy, startup, pool.gpus,
                                   pool.cost_per_hour, flags.min_replicas))
        setups.extend([pool.setup] * pool.count)
    timing = fleet.timing()
    return simulate_autoscaled(trace, setups, fleet.policies(setup.config.seed), scaling,
                               flags.interval_s, timing["refresh_s"],
                               timing["routing_latency_s"], progress, flags.autoscale,
                               timing["kv_event_delay_s"])


def fixed_scaling(setup: SimSetup, spec: FleetSpec | None, fleet: FleetFlags,
                  flags: AutoscaleFlags, result: FleetResult) -> ScalingTimeline:
    """The timeline, GPU-hours and cost of a fleet that does not scale."""
    pools = _pools(setup, spec, fleet.replicas, flags)
    end = max((r.finish_s for r in result.requests if r.finish_s is not None), default=0.0)
    return fixed_timeline([p.name for p in pools], [p.count for p in pools],
                          [p.gpus for p in pools], [p.cost_per_hour for p in pools], end)
