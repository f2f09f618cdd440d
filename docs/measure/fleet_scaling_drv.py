"""Instructions (or CPU) of one fleet run as `rt bench fleet --scaling` times it (fleet13c,
speed-log.md "Fleet simulator speed, round 11"): build the setup and the trace replayed N times
faster, collect, run `simulate_fleet` on N round-robin replicas (its end collection
included), `os._exit(0)`. MODE `setup` builds the same and runs nothing: subtract its count.

    PYTHONPATH=. valgrind --tool=cachegrind --cache-sim=no python \\
        docs/measure/fleet_scaling_drv.py fleet 64 azure      # then `setup 64 azure`
    SHOW=1 PYTHONPATH=. python docs/measure/fleet_scaling_drv.py fleet 64 azure  # CPU s

MODE: setup | single (one engine, the trace as recorded) | fleet; TRACE: default | azure
(the shared excerpt, /work/shared/traces/azure_conv_2023_head.csv). BLOCKS=n: pools of n
blocks (`--num-gpu-blocks-override`).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import workloads
from runtime.router.registry import make_policy
from sim.engine_args import EngineArgs, build_setup
from sim.fleet import simulate_fleet
from sim.simulator import simulate
from workloads.transforms import scale_time

AZURE = Path("/work/shared/traces/azure_conv_2023_head.csv")


def main(mode: str, replicas: int, which: str) -> None:
    blocks = os.environ.get("BLOCKS")
    args = EngineArgs(num_gpu_blocks_override=int(blocks)) if blocks else EngineArgs()
    setup = build_setup(args, "llama-3.1-8b", "h200")
    trace = workloads.default_trace() if which == "default" else workloads.load_trace(
        AZURE).trace
    scaled = scale_time(trace, 1.0 / replicas)
    policy = make_policy("round-robin", (), setup.config.seed)
    gc.collect()
    start = time.process_time()
    if mode == "single":
        simulate(trace, setup.config, setup.cost_model)
    elif mode == "fleet":
        simulate_fleet(scaled, [setup] * replicas, policy, 0.05)
    if os.environ.get("SHOW"):
        print(mode, replicas, which, len(trace), "cpu", round(time.process_time() - start, 3),
              file=sys.stderr)
    os._exit(0)  # no interpreter teardown in the count


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
