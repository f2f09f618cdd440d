"""Does a fleet slow down with the requests it has served? (fid15d) `rt fidelity --fleet`'s
first calibration window replayed again and again through 4 `rt serve --simulate` replicas,
other prompt tokens each time (token seed 100 + k), each replay through a fresh `rt route`,
by a schedule of letters: F = (re)start the replicas, then replay; R = replay on the
replicas as they are. Each request is then compared with itself: its client TTFT in each
replay minus its median over all replays (the first 6 requests, cold after an F, left
out); one line per replay: p10/p50/p90 TTFT and the median of those paired differences.

    PYTHONPATH=. python docs/measure/fleet_window_repeats.py TRACE ROUTER SCHEDULE OUT.json
    # e.g. mt160.jsonl round-robin FRRRFRRRFRRR /tmp/repeats.json  (about 3.5 min)
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np

from backends.route.fleet_fidelity import (
    _replay_once,
    calibration_windows,
    fleet_fidelity_plan,
    running_replicas,
)
from runtime.config import EngineFlags
from runtime.records import ttft_by_request
from sim.fleet_config import FleetFlags
from workloads.loaders import load_trace

COLD = 6  # requests of each replay left out of the comparison (a fresh fleet's first ones)


def replays(trace_path: Path, router: str, schedule: str) -> list[dict[str, float]]:
    """Each replay's client TTFT (seconds) by request id, in schedule order."""
    window, _ = calibration_windows(load_trace(trace_path).trace, 0)
    plan = fleet_fidelity_plan(Path("cli.py"), FleetFlags(replicas=4, router=router),
                               EngineFlags(max_model_len=8192), "llama-3.1-8b", "h200",
                               None, 0)
    ttfts: list[dict[str, float]] = []
    with contextlib.ExitStack() as fleet:
        backends: list[str] = []
        logs = Path()
        for k, letter in enumerate(schedule):
            if letter == "F":
                fleet.close()
                backends, logs = fleet.enter_context(running_replicas(plan))
            result, _, _ = _replay_once(plan, window, backends, logs, 100 + k, None)
            ttfts.append(ttft_by_request(result.requests))
            print(f"replay {k} ({letter}) done", file=sys.stderr, flush=True)
    return ttfts


def report(schedule: str, ttfts: list[dict[str, float]]) -> list[str]:
    """One line per replay (milliseconds)."""
    ids = sorted(set.intersection(*(set(t) for t in ttfts)), key=int)[COLD:]
    ms = np.array([[t[i] for i in ids] for t in ttfts]) * 1e3
    own = np.median(ms, axis=0)
    return [f"{k} {letter}: p10 {np.percentile(row, 10):.2f} p50 {np.median(row):.2f} p90 "
            f"{np.percentile(row, 90):.2f} ms; against each request's own median "
            f"{np.median(row - own):+.2f} ms"
            for k, (letter, row) in enumerate(zip(schedule, ms, strict=True))]


if __name__ == "__main__":
    trace_file, policy, letters, out = sys.argv[1:5]
    measured = replays(Path(trace_file), policy, letters)
    Path(out).write_text(json.dumps({"schedule": letters, "ttft_s": measured}))
    print("\n".join(report(letters, measured)))
