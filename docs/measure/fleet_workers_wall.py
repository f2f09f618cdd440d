"""Wall seconds of one fleet run on the default trace replayed N times faster, with W processes
(`simulate_fleet(workers=W)`: lockstep behind least-outstanding, power-of-two,
sglang-cache-aware; apart behind pre-routed routers). Run pairs interleaved, e.g.

    run="PYTHONPATH=. python docs/measure/fleet_workers_wall.py"
    for i in 1 2 3; do
        echo "W2 $($run 16 2 least-outstanding) W1 $($run 16 1 least-outstanding)"
    done

With a CPU taken (as for docs/fleet.md's "needs a free CPU per process"), a busy loop beside it:
`python3 -c "import time; e = time.time() + 60; exec('while time.time() < e: pass')" &`.
"""

from __future__ import annotations

import argparse
import time

import workloads
from runtime.router.registry import make_policy
from sim.engine_args import EngineArgs, build_setup
from sim.fleet import simulate_fleet
from workloads.transforms import scale_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("replicas", type=int)
    parser.add_argument("workers", type=int)
    parser.add_argument("router")
    args = parser.parse_args()
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "h200")
    trace = scale_time(workloads.default_trace(), 1.0 / args.replicas)
    policy = make_policy(args.router, (), setup.config.seed)
    start = time.perf_counter()
    simulate_fleet(trace, [setup] * args.replicas, policy, 0.05, workers=args.workers)
    print(f"{time.perf_counter() - start:.3f}")


if __name__ == "__main__":
    main()
