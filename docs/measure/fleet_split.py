"""Where a fleet behind a router that decides at each arrival spends its CPU, beyond its
replicas' own work: four runs of the same engine work, in turns, CPU seconds each.

    single       one engine on the trace as recorded (`rt bench fleet`'s reference)
    sequential   each replica's share (as the fleet routed it) on one engine, one after
                 another (`rt bench fleet`'s "shares on one engine each" row)
    interleaved  the same shares as engines of one SimPy environment, every step an event:
                 the replicas' steps interleave in time as in the fleet, with no router
    fleet        the fleet (`simulate_fleet`), trace replayed N times faster

interleaved - sequential is what interleaving costs (an event per step, and each replica's
data cold again when its turn comes); fleet - interleaved is the fleet layer (routing at
each arrival, hand-overs, sleeping through runs, the records' join).

    PYTHONPATH=. python docs/measure/fleet_split.py least-outstanding 16 [--trace F] [--runs 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import cast

import simpy

import workloads
from runtime.router.registry import make_policy
from sim.engine_args import EngineArgs, SimSetup, build_setup
from sim.fleet import FleetRequestRecord, FleetResult, simulate_fleet
from sim.run_gc import release_pools, run_with_gc
from sim.simulator import _Simulation, simulate
from workloads import Trace
from workloads.transforms import scale_time


class _Stepping(_Simulation):
    """A share's engine that yields to the event loop at every step's end."""

    def steps_ahead_until(self) -> float:
        return -math.inf


def _interleaved(shares: list[Trace], setup: SimSetup) -> None:
    env = simpy.Environment()
    engines = [_Stepping(share, setup.config, setup.cost_model, None) for share in shares]
    for engine in engines:
        engine.env = env
        env.process(engine.engine())
    env.run()
    release_pools(e.core.scheduler.kv_cache_manager for e in engines)


def _cpu(run: Callable[[], object]) -> float:
    start = time.process_time()
    run()  # each kind manages the collector as `sim.run_gc` says
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("router")
    parser.add_argument("replicas", type=int)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    trace = (workloads.load_trace(args.trace).trace if args.trace
             else workloads.default_trace())
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "h200")
    scaled = scale_time(trace, 1.0 / args.replicas)

    def fleet() -> FleetResult:
        return simulate_fleet(scaled, [setup] * args.replicas,
                              make_policy(args.router, (), setup.config.seed), 0.05)

    where = {r.request_id: cast(FleetRequestRecord, r).replica for r in fleet().requests}
    shares = [Trace(tuple(r for r in scaled if where[r.request_id] == i))
              for i in range(args.replicas)]
    runs: dict[str, Callable[[], object]] = {
        "single": lambda: simulate(trace, setup.config, setup.cost_model),
        "sequential": lambda: [simulate(s, setup.config, setup.cost_model) for s in shares],
        "interleaved": lambda: run_with_gc(lambda: _interleaved(shares, setup)),
        "fleet": fleet,
    }
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.runs):  # in turns, so that a slower moment hits every kind
        for name, run in runs.items():
            cpu[name].append(_cpu(run))
    n = len(trace)
    for name, values in cpu.items():
        median = statistics.median(values)
        print(f"{name:12} {median:7.3f} s  {median / n * 1e6:6.1f} us/request  "
              f"runs {' '.join(f'{v:.3f}' for v in values)}")


if __name__ == "__main__":
    main()
