"""How fast a fleet behind a router that decides at each arrival could run in W processes:
an upper bound on parallel lockstep, measured on the serial fleet.

Such a router reads every replica's completions at each arrival, so no replica may step past
the next undecided arrival (plus the routing latency and the API server's time, ~ms) before
that decision: W processes holding replicas round-robin (replica i in process i mod W) would
meet at every arrival. Between two decisions each process runs its replicas' engine work
(`Replica.one_step`, `Replica.fast_forward`, `Replica.plan_run`, timed here in the serial fleet
and summed by the decision they precede), and the decision waits for the slowest process. So, with
synchronization free and everything outside the engine calls (SimPy, routing, hand-overs,
the records' join) split perfectly over the W processes:

    wall >= sum over decisions of max over processes (engine work) + (fleet - engine) / W

Printed: the fleet's CPU, its engine work, that sum of maxima, the engine work's parallel
efficiency (engine / W / sum of maxima) and the bound's ratio to one engine on the trace as
recorded (`rt bench fleet`'s reference, timed in the same run), all wall seconds of this
process (perf_counter; run it on a quiet machine, OMP_NUM_THREADS=1).

    PYTHONPATH=. python docs/measure/fleet_lockstep_bound.py least-outstanding 16 [--workers 2 4]
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from functools import wraps
from typing import Any

import workloads
from runtime.router.registry import make_policy
from sim import fleet_replica
from sim.engine_args import EngineArgs, build_setup
from sim.fleet import simulate_fleet
from sim.simulator import simulate
from workloads.transforms import scale_time

# a replica's engine work: its steps, its runs, and the runs it plans before sleeping through
# them (`Replica.sleep_through_run`: least-outstanding's 16 replicas plan 0.083 s there)
ENGINE_CALLS = ("one_step", "fast_forward", "plan_run")


def _classes(base: type) -> list[type]:
    """`base` and every subclass of it, at any depth."""
    found: list[type] = [base]
    for cls in found:  # grows as it is walked
        subclasses: list[type] = cls.__subclasses__()
        found.extend(sub for sub in subclasses if sub not in found)
    return found


def _timed_per_decision(work: dict[tuple[int, int], float],
                        base: type = fleet_replica.Replica) -> Callable[[], None]:
    """Wrap the replicas' engine calls so that each adds its seconds to
    work[(decision it precedes, replica index)]; returns the undo. Every class's own
    `ENGINE_CALLS` are wrapped, `base`'s inherited ones too: `KvReplica.fast_forward`
    overrides the method without calling it (untimed, its seconds would count as work
    outside the engine, split over the processes); a call made inside a timed one
    (`KvReplica.one_step`'s `super().one_step`) counts in the outer one only."""
    originals = {(cls, name): vars(cls).get(name) for cls in _classes(base)
                 for name in ENGINE_CALLS if cls is base or name in vars(cls)}
    timing = [False]  # inside a timed call

    def wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(original)
        def call(self: Any, *args: Any) -> Any:
            if timing[0]:
                return original(self, *args)
            timing[0] = True
            start = time.perf_counter()
            try:
                result = original(self, *args)
            finally:
                timing[0] = False
            work[(self.fleet.next_index, self.index)] += time.perf_counter() - start
            return result
        return call

    for (cls, name), original in originals.items():
        setattr(cls, name, wrapped(original or getattr(cls, name)))

    def undo() -> None:
        for (cls, name), original in originals.items():
            if original is None:  # inherited: inherit again
                delattr(cls, name)
            else:
                setattr(cls, name, original)

    return undo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("router")
    parser.add_argument("replicas", type=int)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    trace = workloads.default_trace()
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "h200")
    scaled = scale_time(trace, 1.0 / args.replicas)
    start = time.perf_counter()
    simulate(trace, setup.config, setup.cost_model)
    single = time.perf_counter() - start
    work: dict[tuple[int, int], float] = collections.defaultdict(float)
    undo = _timed_per_decision(work)
    start = time.perf_counter()
    simulate_fleet(scaled, [setup] * args.replicas,
                   make_policy(args.router, (), setup.config.seed), 0.05)
    fleet = time.perf_counter() - start
    undo()
    engine = sum(work.values())
    print(f"single engine {single:.3f} s; fleet {fleet:.3f} s, of it engine calls "
          f"{engine:.3f} s over {len({d for d, _ in work})} decisions")
    for workers in args.workers:
        per_decision: dict[int, list[float]] = {}
        for (decision, replica), seconds in work.items():
            per_decision.setdefault(decision, [0.0] * workers)[replica % workers] += seconds
        slowest = sum(max(parts) for parts in per_decision.values())
        bound = slowest + (fleet - engine) / workers
        print(f"{workers} processes: sum of maxima {slowest:.3f} s, efficiency "
              f"{engine / workers / slowest:.2f}, wall >= {bound:.3f} s, "
              f"vs one engine <= {single / bound:.2f}")


if __name__ == "__main__":
    main()
