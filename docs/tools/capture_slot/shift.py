"""How much the twin's own TTFT moves when a run's arrivals are moved later by a few ms (a
stand-in for an admission delay the twin does not have), with no server at all:
`rt simulate`'s core (`sim.benchmarks.serve_twin`, llama-3.1-8b on H200, max-model-len 4096)
on the sent arrivals of one `bench_dump.py` run, every arrival moved by the same 1 or 3 ms,
or each by a random 0-1, 0-3 or 0-6 ms. Prints, per case, the mean and p50 of the TTFT added
per request, the share within 5 ms, and the change of the p50 TTFT (the goal's statistic).
A measuring aid for docs/serve.md, not part of rt.

    PYTHONPATH=$PWD python docs/tools/capture_slot/shift.py run.pkl
"""

from __future__ import annotations

import pickle
import sys

import numpy as np

from runtime.config import EngineFlags
from sim.benchmarks import serve_twin
from sim.engine_args import SimFlags
from workloads import Trace, TraceRequest

CASES = [(1, 0), (3, 0), (0, 1), (0, 3), (0, 6)]  # (shift of all, random jitter of each), ms


def main(path: str) -> None:
    with open(path, "rb") as f:
        records = sorted(pickle.load(f)["server"], key=lambda r: r.arrival_s)
    _, simulate = serve_twin(SimFlags(), EngineFlags(max_model_len=4096), 0)

    def ttft_ms(shift_ms: float, jitter_ms: float) -> dict[str, float]:
        rng, t0 = np.random.default_rng(0), records[0].arrival_s
        moved = [TraceRequest(r.request_id, prompt_len=r.prompt_len, output_len=r.max_tokens,
                              arrival_s=r.arrival_s - t0 + (shift_ms + rng.uniform(0, jitter_ms))
                              / 1e3) for r in records]
        done = simulate(Trace(tuple(sorted(moved, key=lambda q: q.arrival_s)), name="t"))
        return {r.request_id: (r.first_token_s - r.arrival_s) * 1e3 for r in done.requests
                if r.first_token_s is not None}

    base = ttft_ms(0, 0)
    print(f"twin p50 TTFT {np.median(list(base.values())):.1f} ms")
    for shift, jitter in CASES:
        moved = ttft_ms(shift, jitter)
        added = np.array([moved[k] + shift - base[k] for k in base])  # from the first arrival
        p50_change = np.median(list(moved.values())) + shift - np.median(list(base.values()))
        print(f"shift {shift} ms, jitter [0, {jitter}) ms: added per request mean "
              f"{added.mean():+.1f} p50 {np.median(added):+.1f}; within 5 ms "
              f"{np.mean(abs(added) < 5) * 100:.0f}%; p50 TTFT change {p50_change:+.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
