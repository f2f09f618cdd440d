"""`rt bench fleet`: simulated requests per CPU second of the fleet simulator (`sim.fleet`)
against the single engine's on the same trace, against the same work on one engine per
replica (each replica's share, as routed), and across replica counts; and per wall second
with a pre-routed or lockstep fleet's replicas in worker processes (`--sim-workers`);
JSON-ready dicts."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from sim.benchmarks import rate_row, report_platform, timed
from workloads import Trace, TraceRequest


def bench_fleet(trace: Any, name: str, model: str = "llama-3.1-8b", gpu: str = "h200",
                replicas: int = 16, scaling: tuple[int, ...] = (4, 64),
                router: str = "round-robin", router_args: tuple[str, ...] = (),
                refresh_s: float = 0.05, baseline: bool = True,
                sim_workers: int | None = None, repeat: int = 1) -> dict[str, object]:
    """The `rt bench fleet` report: simulated requests per second of the fleet simulator.

    A fleet of N replicas replays the trace N times faster (arrival times x 1/N), so every
    replica carries the load one engine carries on the trace as recorded; one engine on the
    trace as recorded is the reference, in the same process. Rates are per wall second and
    per CPU second of this process (CPU time is steadier on a shared machine); the goals
    compare CPU seconds per request:

    - `replicas` (16): the fleet's rate per request >= the single engine's (routing and the
      fleet's bookkeeping are not the bottleneck);
    - `scaling` (4, 64): the largest fleet costs no more per request than the smallest
      (the median of `repeat` interleaved pairs);
    - with `baseline`: the `replicas` fleet stepping one by one (no decode-run
      fast-forward), and the speed-up of fast-forwarding.

    With a pre-routed router (`sim.fleet.pre_routable`: round-robin, random, session-hash)
    or one that runs in lockstep (`sim.fleet.runs_in_lockstep`: least-outstanding,
    power-of-two, sglang-cache-aware), the `replicas` fleet also runs in `sim_workers`
    processes (default: the CPUs it may use, at most `replicas`): its wall rate per request
    against the single engine's is the wall-clock goal (CPU seconds there are the parent's
    and its workers', spinning included); the CPU goals above stay the honest measure of the
    work.
    """
    from sim.engine_args import EngineArgs, build_setup
    from sim.fleet_workers import usable_cpus
    from sim.simulator import simulate

    setup = build_setup(EngineArgs(), model, gpu)
    n = len(trace)
    fleet = functools.partial(_fleet_run, trace, setup, router, router_args, refresh_s)
    single, wall, cpu = timed(lambda: simulate(trace, setup.config, setup.cost_model))
    rows = [rate_row("single engine, trace as recorded", n, single.num_steps, wall, cpu)]
    single_cpu = cpu / n
    runs, shares = _size_runs(fleet, _run_order(replicas, scaling, repeat), replicas, trace)
    rows += [_fleet_row(size_runs, n, single_cpu) for size_runs in runs.values()]
    per_request = _seconds(rows[1], "cpu_s_per_request")  # the `replicas` fleet's
    rows.append(_engines_row(shares, setup, f"{replicas} replicas' shares on one engine each"))
    engines_cpu = _seconds(rows[-1], "cpu_s") / n
    workers = sim_workers or min(usable_cpus(), replicas)
    parallel = _parallel_row(fleet, replicas, workers, n, router, router_args)
    if parallel is not None:
        rows.append(parallel)
    report: dict[str, object] = {
        "benchmark": "fleet", **report_platform(), "model": model, "gpu": gpu, "trace": name,
        "requests": n, "router": router, "router_args": list(router_args),
        "router_refresh_ms": refresh_s * 1e3, "repeat": repeat, "runs": rows,
        "fleet_vs_single_engine_per_request": round(single_cpu / per_request, 3),
        "meets_goal_rate": per_request <= single_cpu,
        # the same engine work without the fleet: routing and bookkeeping's cost
        "fleet_vs_replica_engines_per_request": round(engines_cpu / per_request, 3),
        **_wall_goal(parallel, workers, _seconds(rows[0], "wall_s")),
        **_scaling_keys(runs[min(scaling)], runs[max(scaling)]),
    }
    if baseline:
        rows.append(_stepped_row(fleet, replicas, setup, n))
        report["speedup_vs_stepped"] = round(_seconds(rows[-1], "cpu_s") / n / per_request, 2)
    report["goals"] = _goals(replicas, scaling, workers if parallel else None, router, repeat)
    return report


def _seconds(row: Mapping[str, object], key: str) -> float:
    """A report row's figure in seconds (`rate_row`'s and `_fleet_row`'s: a float)."""
    value = row[key]
    assert isinstance(value, int | float), (key, value)
    return float(value)


@dataclasses.dataclass(frozen=True, slots=True)
class FleetRun:
    """One timed run of a fleet: wall and CPU seconds, and the engine steps it simulated
    (summed over its replicas; the same in every run of a size: the simulation is
    deterministic)."""

    replicas: int
    wall_s: float
    cpu_s: float
    steps: int


def _run_order(replicas: int, scaling: tuple[int, ...], repeat: int) -> list[int]:
    """The fleet sizes in the order they run: the `replicas` fleet, the `scaling` sizes
    other than it, then `repeat - 1` more rounds of all the `scaling` sizes, every other
    round reversed (16, 4, 64, 64, 4, 4, 64, ...): a process's later fleets run slower than
    its first ones (its heap has grown), so no size takes all the early turns of the pairs.
    Each size's k-th run is run k of the pairs (`_scaling_keys`)."""
    first = list(dict.fromkeys((replicas, *scaling)))
    sizes = list(dict.fromkeys(scaling))
    return first + [count for k in range(1, repeat)
                    for count in (sizes[::-1] if k % 2 else sizes)]


def _size_runs(fleet: Callable[[int], tuple[Any, float, float]], order: Sequence[int],
               replicas: int, trace: Trace) -> tuple[dict[int, list[FleetRun]], list[Trace]]:
    """Each size's runs (sizes in the order of their first run, runs in run order) of the
    fleets in `order`, and each replica's share of the `trace` in the first `replicas`
    fleet."""
    from workloads.transforms import scale_time

    runs: dict[int, list[FleetRun]] = {}
    shares: list[Trace] = []
    for count in order:
        result, wall, cpu = fleet(count)
        runs.setdefault(count, []).append(
            FleetRun(count, wall, cpu, result.num_steps))
        if count == replicas and not shares:
            shares = _replica_shares(scale_time(trace, 1.0 / count), result)
        # Freed before the next size runs, not while it runs: each size after the sizes
        # before it freed theirs. A result freed mid-series raised glibc's mmap threshold
        # for the next size only (its step columns, ~5 MB arrays, then grew by copying in
        # the heap instead of mremap: ~0.2 s more for whichever size came after it).
        del result
    return runs, shares


def _scaling_keys(small: list[FleetRun], large: list[FleetRun]) -> dict[str, object]:
    """The scaling goal's keys: the largest fleet's CPU per request over the smallest's, run
    i against run i, the median of those pairs deciding `meets_goal_scaling`; and the same
    per simulated engine step (information: a larger fleet simulates more steps, each
    replica ramping up and draining on its own)."""
    s, g = small[0].replicas, large[0].replicas
    per_request = [big.cpu_s / one.cpu_s for one, big in zip(small, large, strict=True)]
    per_step = [(big.cpu_s / big.steps) / (one.cpu_s / one.steps)
                for one, big in zip(small, large, strict=True)]
    ratio = statistics.median(per_request)
    key = f"cost_per_request_{g}_vs_{s}"
    return {key: round(ratio, 3), "meets_goal_scaling": ratio <= 1.0,
            f"{key}_runs": [round(r, 3) for r in per_request],
            f"{key}_spread": [round(min(per_request), 3), round(max(per_request), 3)],
            f"cost_per_step_{g}_vs_{s}": round(statistics.median(per_step), 3)}


def _stepped_row(fleet: Callable[..., tuple[Any, float, float]], replicas: int, setup: Any,
                 n: int) -> dict[str, object]:
    """The `replicas` fleet stepping one by one (no decode-run fast-forward)."""
    result, wall, cpu = fleet(replicas, dataclasses.replace(setup.config, fast_forward=False))
    return rate_row(f"{replicas} replicas stepping one by one", n, result.num_steps, wall,
                    cpu)


def _wall_goal(parallel: dict[str, object] | None, workers: int, single_wall_s: float
               ) -> dict[str, object]:
    """The report's wall-clock keys: the single engine uses one core, a parallel fleet's
    `workers` several (None without a parallel row)."""
    if parallel is None:
        return {"sim_workers": None, "fleet_parallel_vs_single_engine_wall": None,
                "meets_goal_rate_wall": None}
    wall_s = float(cast(float, parallel["wall_s"]))
    return {"sim_workers": workers,
            "fleet_parallel_vs_single_engine_wall": round(single_wall_s / wall_s, 3),
            "meets_goal_rate_wall": wall_s <= single_wall_s}


def _goals(replicas: int, scaling: tuple[int, ...], workers: int | None, router: str,
           repeat: int) -> str:
    """The report's `goals` text: which key measures what."""
    small, large = min(scaling), max(scaling)
    wall = (f"{replicas} replicas in {workers} sim workers, wall seconds per request <= the "
            "single engine's (meets_goal_rate_wall, wall seconds: uses more than one core)"
            if workers is not None else f"no parallel row (router {router!r} neither pre-routes "
            "nor runs in lockstep)")
    return (f"{replicas} replicas: CPU per request <= the single engine's (meets_goal_rate, "
            f"CPU seconds: the work); {large} replicas: CPU per request <= {small} replicas' "
            f"(meets_goal_scaling, the median of {repeat} interleaved pairs; "
            f"cost_per_step_{large}_vs_{small}, CPU per simulated step, is information, not "
            f"a goal); wall: {wall}")


def _fleet_run(trace: Any, setup: Any, router: str, router_args: tuple[str, ...],
               refresh_s: float, count: int, config: Any = None, workers: int = 1
               ) -> tuple[Any, float, float]:
    """`count` replicas of `setup` (with `config` instead of its own, if given) on the trace
    replayed `count` times faster, in `workers` processes: the result, wall and CPU seconds
    (with workers, this process's and theirs)."""
    from runtime.router.registry import make_policy
    from sim.fleet import simulate_fleet
    from workloads.transforms import scale_time

    scaled = scale_time(trace, 1.0 / count)
    one = setup if config is None else dataclasses.replace(setup, config=config)
    policy = make_policy(router, router_args, setup.config.seed)
    run = functools.partial(simulate_fleet, scaled, [one] * count, policy, refresh_s,
                            workers=workers)
    return timed(run)  # CPU seconds: with workers, this process's and theirs


def _parallel_row(fleet: Callable[..., tuple[Any, float, float]], count: int, workers: int,
                  n: int, router: str, router_args: tuple[str, ...]
                  ) -> dict[str, object] | None:
    """The row of `count` replicas in `workers` processes (None: the router neither
    pre-routes nor runs in lockstep, so the fleet would run in one process)."""
    from runtime.router.registry import make_policy
    from sim.fleet import pre_routable, runs_in_lockstep

    policies = [make_policy(router, router_args)]
    if not (pre_routable(policies) or runs_in_lockstep(policies)):
        return None
    result, wall, cpu = fleet(count, workers=workers)
    row = rate_row(f"{count} replicas, trace x{count} faster, {workers} sim workers", n,
                   result.num_steps, wall, cpu)
    row["sim_workers"] = workers
    return row


def _fleet_row(runs: list[FleetRun], n: int, single_cpu: float) -> dict[str, object]:
    """A fleet size's report row: its median run's figures (the lower median by CPU
    seconds, `median_run` counting from 1 in run order) and every run's CPU seconds."""
    order = sorted(range(len(runs)), key=lambda i: runs[i].cpu_s)
    median = order[(len(runs) - 1) // 2]
    run = runs[median]
    row = rate_row(f"{run.replicas} replicas, trace x{run.replicas} faster", n, run.steps,
                   run.wall_s, run.cpu_s)
    row["replicas"] = run.replicas
    row["vs_single_engine_per_request"] = round(single_cpu / (run.cpu_s / n), 3)
    row["cpu_s_per_request"] = run.cpu_s / n
    row["cpu_s_runs"] = [round(r.cpu_s, 3) for r in runs]
    row["median_run"] = median + 1
    return row


def _replica_shares(scaled: Trace, result: Any) -> list[Trace]:
    """Each replica's requests of the fleet's (scaled) trace, in trace order, as routed."""
    where = {record.request_id: record.replica for record in result.requests}
    shares: list[list[TraceRequest]] = [[] for _ in result.replicas]
    for req in scaled:
        shares[where[req.request_id]].append(req)
    return [Trace(tuple(share)) for share in shares]


def _engines_row(shares: Sequence[Trace], setup: Any, label: str) -> dict[str, object]:
    """Each share on a single engine, one after another: the report row. With no
    routing latency or step noise these are the fleet's replicas, step for step
    (tests/sim/test_fleet_shares.py): the fleet's work without routing, hand-overs or cut
    runs."""
    from sim.simulator import simulate

    results, wall, cpu = timed(lambda: [simulate(share, setup.config, setup.cost_model)
                                        for share in shares])
    requests = sum(len(share) for share in shares)
    return rate_row(label, requests, sum(r.num_steps for r in results), wall, cpu)
