"""`rt bench fleet`: simulated requests per CPU second of the fleet simulator (`sim.fleet`)
against the single engine's on the same trace, against the same work on one engine per
replica (each replica's share, as routed), and across replica counts; and per wall second
with a pre-routed fleet's replicas in worker processes (`--sim-workers`); JSON-ready dicts."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, cast

from sim.benchmarks import rate_row, report_platform, timed
from workloads import Trace, TraceRequest


def bench_fleet(trace: Any, name: str, model: str = "llama-3.1-8b", gpu: str = "h200",
                replicas: int = 16, scaling: tuple[int, ...] = (4, 64),
                router: str = "round-robin", router_args: tuple[str, ...] = (),
                refresh_s: float = 0.05, baseline: bool = True,
                sim_workers: int | None = None) -> dict[str, object]:
    """The `rt bench fleet` report: simulated requests per second of the fleet simulator.

    A fleet of N replicas replays the trace N times faster (arrival times x 1/N), so every
    replica carries the load one engine carries on the trace as recorded; one engine on the
    trace as recorded is the reference, in the same process. Rates are per wall second and
    per CPU second of this process (CPU time is steadier on a shared machine); the goals
    compare CPU seconds per request:

    - `replicas` (16): the fleet's rate per request >= the single engine's (routing and the
      fleet's bookkeeping are not the bottleneck);
    - `scaling` (4, 64): the largest fleet costs no more per request than the smallest;
    - with `baseline`: the `replicas` fleet stepping one by one (no decode-run
      fast-forward), and the speed-up of fast-forwarding.

    With a pre-routed router (`sim.fleet.pre_routable`: round-robin, random, session-hash),
    the `replicas` fleet also runs in `sim_workers` processes (default: the CPUs it may use, at
    most `replicas`): its wall rate per request against the single engine's is the
    wall-clock goal (CPU seconds there are the parent's and its workers'); the CPU goals
    above stay the honest measure of the work.
    """
    from sim.engine_args import EngineArgs, build_setup
    from sim.simulator import simulate
    from workloads.transforms import scale_time

    setup = build_setup(EngineArgs(), model, gpu)
    n = len(trace)
    fleet = functools.partial(_fleet_run, trace, setup, router, router_args, refresh_s)
    single, wall, cpu = timed(lambda: simulate(trace, setup.config, setup.cost_model))
    rows = [rate_row("single engine, trace as recorded", n, single.num_steps, wall, cpu)]
    single_cpu = cpu / n
    per_request: dict[int, float] = {}
    shares: list[Trace] = []
    for count in dict.fromkeys((replicas, *scaling)):
        result, row = _fleet_row(fleet, count, n, single_cpu)
        rows.append(row)
        per_request[count] = float(row["cpu_s_per_request"])
        if count == replicas:
            shares = _replica_shares(scale_time(trace, 1.0 / count), result)
        # Freed before the next size runs, not while it runs: each size after the sizes
        # before it freed theirs. A result freed mid-series raised glibc's mmap threshold
        # for the next size only (its step columns, ~5 MB arrays, then grew by copying in
        # the heap instead of mremap: ~0.2 s more for whichever size came after it).
        del result
    rows.append(_engines_row(shares, setup, f"{replicas} replicas' shares on one engine each"))
    engines_cpu = float(rows[-1]["cpu_s"]) / n
    workers = sim_workers or min(_usable_cpus(), replicas)
    parallel = _parallel_row(fleet, replicas, workers, n, router, router_args)
    if parallel is not None:
        rows.append(parallel)
    report: dict[str, object] = {
        "benchmark": "fleet", **report_platform(), "model": model, "gpu": gpu, "trace": name,
        "requests": n, "router": router, "router_args": list(router_args),
        "router_refresh_ms": refresh_s * 1e3, "runs": rows,
        "fleet_vs_single_engine_per_request": round(single_cpu / per_request[replicas], 3),
        "meets_goal_rate": per_request[replicas] <= single_cpu,
        # the same engine work without the fleet: routing and bookkeeping's cost
        "fleet_vs_replica_engines_per_request": round(engines_cpu / per_request[replicas], 3),
        **_wall_goal(parallel, workers, float(rows[0]["wall_s"])),
    }
    small, large = min(scaling), max(scaling)
    ratio = per_request[large] / per_request[small]
    report[f"cost_per_request_{large}_vs_{small}"] = round(ratio, 3)
    report["meets_goal_scaling"] = per_request[large] <= per_request[small]
    if baseline:
        rows.append(_stepped_row(fleet, replicas, setup, n))
        report["speedup_vs_stepped"] = round(
            float(rows[-1]["cpu_s"]) / n / per_request[replicas], 2)
    report["goals"] = _goals(replicas, small, large, workers if parallel else None, router)
    return report


def _stepped_row(fleet: Callable[..., tuple[Any, float, float]], replicas: int, setup: Any,
                 n: int) -> dict[str, object]:
    """The `replicas` fleet stepping one by one (no decode-run fast-forward)."""
    result, wall, cpu = fleet(replicas, dataclasses.replace(setup.config, fast_forward=False))
    steps = sum(r.num_steps for r in result.replicas)
    return rate_row(f"{replicas} replicas stepping one by one", n, steps, wall, cpu)


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the platform has one; a
    container's or `taskset`'s limit), not the host's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _wall_goal(parallel: dict[str, object] | None, workers: int, single_wall_s: float
               ) -> dict[str, object]:
    """The report's wall-clock keys: the single engine uses one core, a pre-routed fleet's
    `workers` several (None without a parallel row)."""
    if parallel is None:
        return {"sim_workers": None, "fleet_parallel_vs_single_engine_wall": None,
                "meets_goal_rate_wall": None}
    wall_s = float(cast(float, parallel["wall_s"]))
    return {"sim_workers": workers,
            "fleet_parallel_vs_single_engine_wall": round(single_wall_s / wall_s, 3),
            "meets_goal_rate_wall": wall_s <= single_wall_s}


def _goals(replicas: int, small: int, large: int, workers: int | None, router: str) -> str:
    """The report's `goals` text: which key measures what."""
    wall = (f"{replicas} replicas in {workers} sim workers, wall seconds per request <= the "
            "single engine's (meets_goal_rate_wall, wall seconds: uses more than one core)"
            if workers is not None else f"no parallel row (router {router!r} is not pre-routed)")
    return (f"{replicas} replicas: CPU per request <= the single engine's (meets_goal_rate, "
            f"CPU seconds: the work); {large} replicas: CPU per request <= {small} replicas' "
            f"(meets_goal_scaling); wall: {wall}")


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
    """The row of `count` replicas in `workers` processes (None: the router does not
    pre-route, so the fleet would run in one process)."""
    from runtime.router.registry import make_policy
    from sim.fleet import pre_routable

    if not pre_routable([make_policy(router, router_args)]):
        return None
    result, wall, cpu = fleet(count, workers=workers)
    steps = sum(r.num_steps for r in result.replicas)
    row = rate_row(f"{count} replicas, trace x{count} faster, {workers} sim workers", n, steps,
                   wall, cpu)
    row["sim_workers"] = workers
    return row


def _fleet_row(fleet: Callable[[int], tuple[Any, float, float]], count: int, n: int,
               single_cpu: float) -> tuple[Any, dict[str, object]]:
    """The fleet's result and its report row."""
    result, wall, cpu = fleet(count)
    steps = sum(r.num_steps for r in result.replicas)
    row = rate_row(f"{count} replicas, trace x{count} faster", n, steps, wall, cpu)
    row["replicas"] = count
    row["vs_single_engine_per_request"] = round(single_cpu / (cpu / n), 3)
    row["cpu_s_per_request"] = cpu / n
    return result, row


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
