"""One `simulate()` of a trace's first N requests, for an instruction count.

    PYTHONHASHSEED=0 PYTHONPATH=. valgrind --tool=callgrind --collect-atstart=no \\
        --toggle-collect=dropwhile_next python docs/measure/simulate_once.py TRACE N

Llama-3.1-8B on one H200 with vLLM's defaults (`rt bench sim`'s set-up); the call runs inside
`itertools.dropwhile`, so callgrind collects the simulation only (not the imports, the
trace's loading or the exit).
"""

from __future__ import annotations

import sys
from collections import deque
from itertools import dropwhile
from pathlib import Path

import workloads
from sim.engine_args import EngineArgs, build_setup
from sim.simulator import simulate


def main(path: Path, first_n: int) -> None:
    trace = workloads.load_trace(path).trace
    trace = trace.replace_requests(list(trace)[:first_n])
    setup = build_setup(EngineArgs(), "llama-3.1-8b", "h200")
    deque(dropwhile(lambda _: simulate(trace, setup.config, setup.cost_model) is None, [0]),
          maxlen=0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
