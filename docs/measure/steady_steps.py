"""The measured steps of `rt bench scheduler`'s steady decode rows, for an instruction count.

    PYTHONHASHSEED=0 PYTHONPATH=. valgrind --tool=callgrind --collect-atstart=no \\
        --toggle-collect=dropwhile_next python docs/measure/steady_steps.py N STEPS CACHING NAMED

`sim.benchmarks.bench_steady_decode`'s set-up and loop (N running requests, prefix caching
on when CACHING is 1, blocks under the requests' own names when NAMED is 1), its 40 warm-up
steps, then STEPS steps inside `itertools.dropwhile`: callgrind collects only those (its
"Collected" total / STEPS = instructions a step, without the set-up or the exit).
"""

from __future__ import annotations

import sys
from collections import deque
from itertools import dropwhile

from sim.benchmarks import steady_decode_core, steady_decode_step


def main(num_running: int, num_steps: int, caching: bool, named: bool) -> None:
    core = steady_decode_core(num_running, num_steps + 64, 0, caching, named)
    now = [0.0]

    def step(_: int) -> bool:  # bench_steady_decode's loop body
        t = now[0]
        steady_decode_step(core, t)
        now[0] = t + 0.01
        return True

    for k in range(40):  # prefill and the first decodes (joining): not measured
        step(k)
    deque(dropwhile(step, range(num_steps)), maxlen=0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1")
