"""One fleet run in a fresh process with `simulate_fleet(workers=W)` (fleet13p, speed-log.md
"Parallel pre-routed fleets"): N round-robin replicas on the trace replayed N times faster;
prints wall and CPU seconds (this process, its waited-for children) and peak RSS (this
process; the largest child: `RUSAGE_CHILDREN`'s ru_maxrss is a maximum, not a sum; a
forked child's RSS counts the pages it shares with the parent).

    PYTHONPATH=. python docs/measure/fleet_workers_rss.py 16 azure 1   # then ... 16 azure 2

TRACE: default | azure (the shared excerpt, /work/shared/traces/azure_conv_2023_head.csv).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

import workloads
from runtime.router.registry import make_policy
from sim.engine_args import EngineArgs, build_setup
from sim.fleet import simulate_fleet
from workloads.transforms import scale_time

AZURE = Path("/work/shared/traces/azure_conv_2023_head.csv")


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def main(replicas: int, which: str, workers: int) -> None:
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "h200")
    trace = workloads.default_trace() if which == "default" else workloads.load_trace(
        AZURE).trace
    scaled = scale_time(trace, 1.0 / replicas)
    policy = make_policy("round-robin", (), setup.config.seed)
    gc.collect()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cpu, children, wall = (_cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN),
                           time.perf_counter())
    result = simulate_fleet(scaled, [setup] * replicas, policy, 0.05, workers=workers)
    wall = time.perf_counter() - wall
    print(json.dumps({
        "replicas": replicas, "trace": which, "workers": workers, "requests": len(trace),
        "steps": result.num_steps, "wall_s": round(wall, 3),
        "cpu_s_parent": round(_cpu(resource.RUSAGE_SELF) - cpu, 3),
        "cpu_s_children": round(_cpu(resource.RUSAGE_CHILDREN) - children, 3),
        "max_rss_mib_before_run": round(rss_before, 1),
        "max_rss_mib_parent": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                    1),
        "max_rss_mib_largest_child": round(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
    }))
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
