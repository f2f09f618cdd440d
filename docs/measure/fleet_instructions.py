"""One piece of a fleet run behind a router that decides at each arrival, alone, to be counted
in instructions by cachegrind (exact where CPU seconds vary by 10-30% on a shared machine):
a piece's count less the `setup` count is what the piece costs.

    setup        the trace, the engine setup and the fleet's routing of it (`where`); nothing run
    fleet        + the fleet (`simulate_fleet`, trace replayed N times faster)
    interleaved  + each replica's share as engines of one SimPy environment, a step an event
                 (`fleet_split.py`'s `interleaved`)
    sequential   + the shares on one engine each, one after another
    route        + `_Fleet.route` for every request in trace order, no engine running: the
                 router's choice and the hand-over (record, token ids, engine request, API
                 server time, its timeout)
    handovers    + the single-engine simulator's own hand-over of every request
                 (`KnownHandovers._hand_over`: record, token ids, engine request): the part
                 of `route` a replica's share does as well

    for m in setup fleet route handovers; do OMP_NUM_THREADS=1 PYTHONHASHSEED=0 PYTHONPATH=. \\
      valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \\
      python docs/measure/fleet_instructions.py least-outstanding 16 $m 2>&1 | grep 'I *refs'
    done

The collector is off during `route` and `handovers` (they keep what they build).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import cast

import workloads
from runtime.router.registry import make_policy
from sim.engine_args import EngineArgs, build_setup
from sim.fleet import FleetRequestRecord, _Fleet, simulate_fleet
from sim.run_gc import run_with_gc
from sim.simulator import _Simulation, simulate
from workloads import Trace
from workloads.transforms import scale_time

sys.path.insert(0, str(Path(__file__).parent))
from fleet_split import _interleaved  # noqa: E402

MODES = ("setup", "fleet", "interleaved", "sequential", "route", "handovers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("router")
    parser.add_argument("replicas", type=int)
    parser.add_argument("mode", choices=MODES)
    args = parser.parse_args()
    trace = workloads.default_trace()
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "h200")
    scaled = scale_time(trace, 1.0 / args.replicas)
    policy = make_policy(args.router, (), setup.config.seed)
    routed = simulate_fleet(scaled, [setup] * args.replicas,
                            make_policy(args.router, (), setup.config.seed), 0.05)
    where = {r.request_id: cast(FleetRequestRecord, r).replica for r in routed.requests}
    shares = [Trace(tuple(r for r in scaled if where[r.request_id] == i))
              for i in range(args.replicas)]
    if args.mode == "fleet":
        simulate_fleet(scaled, [setup] * args.replicas, policy, 0.05)
    elif args.mode == "interleaved":
        run_with_gc(lambda: _interleaved(shares, setup))
    elif args.mode == "sequential":
        for share in shares:
            simulate(share, setup.config, setup.cost_model)
    elif args.mode == "route":
        fleet = _Fleet(scaled, [setup] * args.replicas, policy, 0.05, 0.0, None)
        gc.disable()
        for i, req in enumerate(scaled):
            fleet.route(req)
            fleet.next_index = i + 1
    elif args.mode == "handovers":
        engine = _Simulation(scaled, setup.config, setup.cost_model, None)
        gc.disable()
        for i in range(len(scaled)):
            engine._hand_over(i)


if __name__ == "__main__":
    main()
