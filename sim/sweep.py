"""Sweep execution: the grid of engine flags, one simulation per point, and executors that
run many points in a local process pool or as Ray tasks with the same results.

Analysis of the runs is not here (sim/ does not import analysis/): the caller passes the
function each worker runs (it simulates with `simulate_point` and writes a run directory) and
gets back, in task order, whatever that function returns.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from multiprocessing import get_context
from typing import Any, TypeVar

from sim.engine_args import EngineArgs, SimSetup, build_setup
from sim.simulator import SimResult, simulate
from workloads import Trace

T = TypeVar("T")
R = TypeVar("R")
EXECUTORS = ("local", "ray")


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


def simulate_point(point: SweepPoint) -> tuple[SimResult, SimSetup]:
    """Build the setup from the point's flags and run the simulation."""
    setup = build_setup(point.engine_args, point.model, point.gpu, point.profile, point.seed)
    return simulate(point.trace, setup.config, setup.cost_model), setup


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
