"""Sweep execution: the grid of engine flags, one simulation per point, and executors that
run many points in a local process pool or as Ray tasks with the same results.

Analysis of the runs is not here (sim/ does not import analysis/): the caller passes the
function each worker runs (it simulates with `simulate_point` and writes a run directory) and
gets back, in task order, whatever that function returns.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, fields, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any, TypeVar

from runtime.flags import FlagGroup, Typed, comma_list, flag, given_options
from sim.engine_args import EngineArgs, SimSetup, build_setup
from sim.simulator import SimResult, simulate
from workloads import ArrivalProcess, Trace, TransformSpec, apply_transforms, random_trace
from workloads.flags import WorkloadFlags, load_workload

T = TypeVar("T")
R = TypeVar("R")
EXECUTORS = ("local", "ray")


GRID_PANEL = "Sweep grid (comma-separated values)"
# The engine flags a sweep's grid takes (comma lists), and the workload flags it offers.
GRID_ENGINE_FLAGS = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
                     "num_gpu_blocks_override", "block_size")
SWEEP_WORKLOAD_FLAGS = ("fmt", "dataset_name", "num_prompts", "input_len", "output_len",
                        "range_ratio", "burstiness", "seed", "start_s", "duration_s", "first_n")
# How the grid is offered: the engine flags, models x GPUs (SWEEP_MODELS), fleets, as lists.
SWEEP_WORKLOAD = FlagGroup(only=SWEEP_WORKLOAD_FLAGS)
SWEEP_GRID = FlagGroup(only=GRID_ENGINE_FLAGS, lists=True, panel=GRID_PANEL)
SWEEP_MODELS = FlagGroup(only=("model", "gpu"), lists=True, panel=GRID_PANEL,
                         defaults={"model": "llama-3.1-8b", "gpu": "h200"})
SWEEP_FLEETS = FlagGroup(only=("replicas", "router"), lists=True, panel=GRID_PANEL)
SEARCH_PANEL = "SLO search"

# `rt sweep --help`'s description of the command, beside its flags.
SWEEP_HELP = """\
Simulate a grid of engine flags x request rates on one trace, in parallel; print a
results table and draw latency against each swept flag and against rate (knee marked).

With --slo and --find-max-rate: bisect the rate for the highest one meeting every SLO.
"""


@dataclass(frozen=True, slots=True)
class SweepFlags:
    """`rt sweep`'s own flags: the rate axis (comma lists, as typed), the SLO search and
    where the runs execute."""

    request_rate: str | None = flag(
        None, "--request-rate", "Rates (req/s): vLLM's arrival rate for --dataset-name, the "
        "trace rescaled to this mean rate for a trace.", GRID_PANEL)
    time_scale: str | None = flag(None, "--time-scale", "Trace arrival-time factors (0.5 = "
                                  "twice the rate).", GRID_PANEL)
    slo: str | None = flag(None, "--slo", "Upper bounds on result keys, e.g. "
                           "p99_ttft_ms=500,p99_itl_ms=50.", SEARCH_PANEL)
    find_max_rate: bool = flag(False, "--find-max-rate", "Bisect the request rate for the "
                               "highest one meeting every --slo, per engine configuration.",
                               SEARCH_PANEL)
    rate_range: str | None = flag(
        None, "--rate-range", "LO,HI req/s bracket of the search (default: the --request-rate "
        "extremes, else 0.5x to 8x the trace's rate).", SEARCH_PANEL)
    rate_tolerance: float = flag(0.05, "--rate-tolerance", "Stop when (hi - lo) / hi is this "
                                 "small.", SEARCH_PANEL)
    executor: str = flag("local", "--executor", "local (process pool) or ray (Ray tasks; pip "
                         "install 'rt[ray]').")
    address: str | None = flag(None, "--address", "Ray cluster address (default: a local Ray "
                               "instance).")
    jobs: int | None = flag(None, "--jobs", "Parallel runs (default: the CPU count).",
                            short="-j")

    def __post_init__(self) -> None:
        if not 0 < self.rate_tolerance < 1:
            raise ValueError(f"--rate-tolerance must be in (0, 1), got {self.rate_tolerance}")
        if self.jobs is not None and self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")
        if self.address is not None and self.executor != "ray":  # (once ignored)
            raise ValueError(f"--address {self.address!r} needs --executor ray")
        self.check_search()

    def check_search(self, typed: Typed | None = None) -> None:
        """ValueError for a search flag that would be ignored: the search's own without
        --find-max-rate (given: `given_options` with the command line's `typed`); with it,
        a --time-scale axis (the search bisects request rates) or --request-rate beside
        --rate-range (the range is the bracket)."""
        if not self.find_max_rate:
            given = given_options(self, ("rate_range", "rate_tolerance"), typed)
            if given:
                raise ValueError(f"{given[0]} needs --find-max-rate")
            return
        if self.time_scale is not None:
            raise ValueError(f"--time-scale {self.time_scale!r} does not combine with "
                             "--find-max-rate (it bisects the request rate)")
        if self.rate_range is not None and self.request_rate is not None:
            raise ValueError("--find-max-rate brackets with --request-rate or --rate-range, "
                             "not both")

    def axis(self) -> tuple[str | None, list[float] | None]:
        """The rate axis as (key, values): request rates, time scales, or (None, None).
        ValueError naming the flag for a bad list, a value <= 0, or both given."""
        rates = _positive_floats("--request-rate", self.request_rate)
        scales = _positive_floats("--time-scale", self.time_scale)
        if rates and scales:
            raise ValueError("give --request-rate or --time-scale, not both")
        if rates:
            return "request_rate", rates
        return ("time_scale", scales) if scales else (None, None)

    def check_rescalable(self, trace: Trace) -> None:
        """ValueError naming the sweep's rate flag when `trace` is to be rescaled to request
        rates (--request-rate, --find-max-rate) but has no span (all arrivals coincide):
        once named as --target-rate, a flag the sweep does not have."""
        if not (self.find_max_rate or self.axis()[0] == "request_rate"):
            return
        if len(trace) >= 2 and trace[-1].arrival_s > trace[0].arrival_s:
            return
        given = (f"--rate-range {self.rate_range}" if self.find_max_rate and self.rate_range
                 else "--find-max-rate" if self.find_max_rate
                 else f"--request-rate {self.request_rate}")
        raise ValueError(f"{given}: the trace has no time span to rescale to a request rate "
                         "(all arrivals coincide)")

    def bracket(self) -> list[float] | None:
        return _positive_floats("--rate-range", self.rate_range)

    def run_all(self, fn: Callable[[T], R], tasks: Sequence[T],
                progress: Progress | None = None) -> list[R]:
        """`run_all` on this --executor (--jobs, --address)."""
        return run_all(fn, tasks, self.executor, self.jobs, self.address, progress)


def _positive_floats(option: str, text: str | None) -> list[float] | None:
    if text is None:
        return None
    values = comma_list(option, text, float)
    if any(not v > 0 for v in values):
        raise ValueError(f"{option}: each value must be > 0, got {text!r}")
    return values


@dataclass(frozen=True)
class SweepPoint:
    """One simulation of a sweep: the (transformed) trace, the engine flags, and the
    values that name this point in the results (flag values, rate)."""

    trace: Trace
    engine_args: EngineArgs
    model: str
    gpu: str
    profile: str | None
    seed: int
    labels: Mapping[str, Any]
    replicas: int = 1  # > 1: a fleet of identical replicas behind `router`
    router: str = "round-robin"

    def identity(self) -> dict[str, Any]:
        """What besides its trace and labels decides this point's run (run.json's "point"):
        a sweep run again into its directory reuses a run only where they agree (it once
        reused an H200 run for `--gpu a100`, the same labels). Every other field, so that
        a field added later is part of it."""
        identity = {f.name: getattr(self, f.name) for f in fields(self)
                    if f.name not in ("trace", "labels")}
        identity["engine_args"] = asdict(self.engine_args)  # JSON-ready, in its place
        return identity


def engine_grid(base: EngineArgs, values: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """The Cartesian product of flag values (EngineArgs field names), in the given order;
    each combination as a dict. Unknown names raise ValueError."""
    fields = set(EngineArgs.__dataclass_fields__)
    unknown = [name for name in values if name not in fields]
    if unknown:
        raise ValueError(f"unknown engine flag {', '.join(unknown)}")
    names = list(values)
    combos = itertools.product(*(values[name] for name in names))
    grid = [dict(zip(names, combo, strict=True)) for combo in combos]
    for combo in grid:
        replace(base, **combo)  # validates the names
    return grid


@dataclass(frozen=True)
class SweepConfig:
    """One engine configuration of the grid; `labels` are the values that vary."""

    labels: dict[str, Any]
    engine_args: EngineArgs
    model: str
    gpu: str
    replicas: int = 1
    router: str = "round-robin"


def sweep_configs(flag_lists: Mapping[str, Sequence[Any]], models: Sequence[str],
                  gpus: Sequence[str], replicas: Sequence[int] = (1,),
                  routers: Sequence[str] = ("round-robin",)) -> list[SweepConfig]:
    """The Cartesian product of engine-flag values x models x GPUs x replica counts x
    routers, in that order; a model, GPU, replica count or router is a label only when more
    than one is swept."""
    configs = []
    for named, model, gpu, count, router in itertools.product(
            engine_grid(EngineArgs(), flag_lists), models, gpus, replicas, routers):
        labels = dict(named)
        for key, value, values in (("model", model, models), ("gpu", gpu, gpus),
                                   ("replicas", count, replicas), ("router", router, routers)):
            labels.update({key: value} if len(values) > 1 else {})
        configs.append(SweepConfig(labels, EngineArgs(**named), model, gpu, count, router))
    return configs


def _check_fleets(fleets: Mapping[str, Sequence[Any]], seed: int) -> None:
    """ValueError naming the flag for a --replicas value outside [1, MAX_REPLICAS] or an
    unknown --router, before any point runs (99999 replicas ran; 'nope' was accepted with
    one replica and 0 failed once the sweep had started), as `rt simulate` refuses them."""
    from runtime.router import make_policy
    from sim.fleet_config import MAX_REPLICAS

    for count in fleets.get("replicas", []):
        if not 1 <= count <= MAX_REPLICAS:
            raise ValueError(f"--replicas: each value must be in [1, {MAX_REPLICAS}], got "
                             f"{count}")
    for router in fleets.get("router", []):
        make_policy(router, [], seed)


# The most simulations one sweep runs (configurations x rates): ~1 s each on the embedded
# trace, so ~3 hours on one core; more is a typo in a list (the product of 4 lists of 100
# values was built in memory before anything ran: 10^8 configurations).
MAX_SWEEP_RUNS = 10_000


def _check_size(grid: Mapping[str, Sequence[Any]], targets: Mapping[str, Sequence[str]],
                fleets: Mapping[str, Sequence[Any]], axis: str | None,
                rates: Sequence[float] | None) -> None:
    """ValueError naming the lists (as flags) when the grid x the rate axis (`axis`, its
    `rates`) is more than MAX_SWEEP_RUNS runs, before the grid is built."""
    lists = {**grid, **targets, **fleets, axis or "rate": rates or [None]}
    runs = math.prod(len(values) or 1 for values in lists.values())
    if runs > MAX_SWEEP_RUNS:
        sizes = " x ".join(f"{len(values)} --{name.replace('_', '-')}"
                           for name, values in lists.items() if len(values) > 1)
        raise ValueError(f"the sweep is {runs:,} runs ({sizes}); at most {MAX_SWEEP_RUNS:,}")


def point_name(index: int, labels: Mapping[str, Any]) -> str:
    """A run directory's name: its index, then each label's initials and value."""
    name = "_".join(f"{''.join(w[0] for w in k.split('_'))}{v:g}"
                    if isinstance(v, int | float) else f"{k}-{v}"
                    for k, v in labels.items()) or "run"
    return f"{index:03d}-{name}"


def simulate_point(point: SweepPoint) -> tuple[SimResult, SimSetup]:
    """Build the setup from the point's flags and run the simulation (a fleet behind the
    point's router when it has more than one replica)."""
    setup = build_setup(point.engine_args, point.model, point.gpu, point.profile, point.seed)
    if point.replicas == 1:
        return simulate(point.trace, setup.config, setup.cost_model), setup
    from runtime.router import make_policy
    from sim.fleet import simulate_fleet

    policy = make_policy(point.router, [], point.seed)
    return simulate_fleet(point.trace, [setup] * point.replicas, policy), setup


Progress = Callable[[int, int], None]  # (runs done, runs in total)


def run_all(fn: Callable[[T], R], tasks: Sequence[T], executor: str = "local",
            jobs: int | None = None, address: str | None = None,
            progress: Progress | None = None) -> list[R]:
    """`[fn(t) for t in tasks]`, in parallel: a local process pool (spawned workers; `jobs`
    of them, default the CPU count) or Ray tasks (`address`: an existing cluster; default a
    local instance, or the one already initialised). Results come back in task order, so
    both executors give the same list."""
    if executor == "local":
        return _run_local(fn, tasks, jobs, progress)
    if executor == "ray":
        return _run_ray(fn, tasks, jobs, address, progress)
    raise ValueError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")


def _run_local(fn: Callable[[T], R], tasks: Sequence[T], jobs: int | None,
               progress: Progress | None) -> list[R]:
    workers = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    results: dict[int, R] = {}
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        pending = {pool.submit(fn, task): i for i, task in enumerate(tasks)}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                results[pending.pop(future)] = future.result()
            if progress is not None:
                progress(len(results), len(tasks))
    return [results[i] for i in range(len(tasks))]


def _run_ray(fn: Callable[[T], R], tasks: Sequence[T], jobs: int | None, address: str | None,
             progress: Progress | None) -> list[R]:
    try:
        import ray
    except ImportError as err:
        raise ValueError("--executor ray needs Ray: pip install 'rt[ray]'") from err
    if not ray.is_initialized():
        if address is None:
            ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    remote = ray.remote(num_cpus=1)(fn)
    refs = [remote.remote(task) for task in tasks]
    index = {ref: i for i, ref in enumerate(refs)}
    results: dict[int, R] = {}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        for ref in done:
            results[index[ref]] = ray.get(ref)
        if progress is not None:
            progress(len(results), len(tasks))
    return [results[i] for i in range(len(tasks))]


@dataclass
class SweepPlan:
    """The jobs of a sweep: each engine configuration at each value of the rate axis
    (`request_rate`: the trace rescaled to that mean rate, or vLLM's random dataset drawn at
    that rate; `time_scale`: arrival times multiplied), each with its run directory under
    `root`, numbered in the order jobs are made."""

    configs: list[SweepConfig]
    base: Trace | None  # the (windowed) trace file; None for the synthetic workload
    synthetic: WorkloadFlags | None  # vLLM's random dataset, regenerated per rate
    profile: str | None
    seed: int
    root: Path
    made: int = 0

    @classmethod
    def build(cls, trace_file: Path | None, work: WorkloadFlags,
              grid: Mapping[str, Sequence[Any]], targets: Mapping[str, Sequence[str]],
              fleets: Mapping[str, Sequence[Any]], profile: str | None, how: SweepFlags,
              root: Path) -> tuple[SweepPlan, list[str]]:
        """`rt sweep`'s plan from its flags (the comma lists as {field: [values]}): every
        configuration of the grid x models x GPUs x fleets, on the trace file (windowed; the
        loader's notes are returned) or the synthetic workload. ValueError on a bad axis,
        grid or workload."""
        scaled = how.axis()[0] == "time_scale"  # (an axis error before the grid's)
        _check_fleets(fleets, work.seed)
        _check_size(grid, targets, fleets, *how.axis())
        configs = sweep_configs(grid, targets["model"], targets["gpu"],
                                fleets.get("replicas", [1]), fleets.get("router", ["round-robin"]))
        if work.dataset_name is None:
            loaded = load_workload(work, trace_file)
            how.check_rescalable(loaded.trace)
            return cls(configs, loaded.trace, None, profile, work.seed, root), list(loaded.notes)
        if work.dataset_name != "random" or trace_file is not None or scaled:
            raise ValueError("sweep's synthetic workload is --dataset-name random, without "
                             "--trace or --time-scale")
        return cls(configs, None, work, profile, work.seed, root), []

    def trace(self, key: str | None, value: float | None) -> Trace:
        if self.synthetic is not None:
            s = self.synthetic
            rate = value if key == "request_rate" and value is not None else math.inf
            return random_trace(s.num_prompts, s.lengths, ArrivalProcess(rate, s.burstiness,
                                                                         s.seed))
        assert self.base is not None
        if key is None or value is None:
            return self.base
        spec = (TransformSpec(target_rate=value) if key == "request_rate"
                else TransformSpec(time_scale=value))
        return apply_transforms(self.base, spec)[0]

    def job(self, index: int, key: str | None, value: float | None) -> tuple[SweepPoint, str]:
        """One simulation: the point and its run directory."""
        config = self.configs[index]
        labels = {**config.labels, **({} if key is None else {key: value})}
        point = SweepPoint(self.trace(key, value), config.engine_args, config.model,
                           config.gpu, self.profile, self.seed, labels, config.replicas,
                           config.router)
        self.made += 1
        return point, str(self.root / point_name(self.made - 1, labels))

    def grid(self, key: str | None, axis: Sequence[float | None]) -> list[tuple[SweepPoint, str]]:
        """Every configuration at every axis value (configurations outermost)."""
        return [self.job(i, key, v) for i in range(len(self.configs)) for v in axis]

    def trace_rate(self) -> float | None:
        """The base trace's mean arrival rate (req/s), or None for the synthetic workload."""
        if self.base is None:
            return None
        arrivals = [r.arrival_s for r in self.base]
        return len(arrivals) / max(arrivals[-1] - arrivals[0], 1e-9)
