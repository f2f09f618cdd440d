"""Offline, on runs of docs/measure/fleet_fidelity.sh with two calibration windows: the
twin's p50/p90 TTFT error against the recorded real replay when the serving stack is fitted
on both windows (as `rt fidelity --fleet` runs; it reproduces the recorded figures), on the
window before only and on the window after only (each alone as the first window: its
requests arriving before its first request's first token left out). Either layout of the
windows: the same requests in both (since fid15d) or the calibration trace's two halves
(fid15c's runs). Seed 0 and the engine flags of the script (`--max-model-len 8192`,
llama-3.1-8b, h200, 4 replicas).

    PYTHONPATH=. python docs/measure/fleet_fidelity_windows.py TRACE RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from analysis.rundir import load_run
from backends.route.fleet_fidelity import (
    CalibrationReplay,
    calibration_trace,
    calibration_windows,
)
from runtime.config import EngineFlags
from runtime.records import ttft_by_request
from sim.fleet_config import FleetFlags
from sim.fleet_twin import fleet_twin
from workloads import Trace
from workloads.loaders import load_trace


def _numbers(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: math.nan if v is None else v for k, v in figures.items()}  # JSON null: NaN


def _halves(trace: Any) -> tuple[Trace, Trace]:
    """fid15c's windows (before fid15d): the calibration trace's two halves by arrival, the
    second's arrivals shifted to start its gap after the first's last request."""
    whole = calibration_trace(trace, 0)
    half = (len(whole) + 1) // 2
    origin = whole.requests[half - 1].arrival_s
    return (Trace(whole.requests[:half], f"{whole.name}:before"),
            Trace(tuple(dataclasses.replace(r, arrival_s=r.arrival_s - origin)
                        for r in whole.requests[half:]), f"{whole.name}:after"))


def windows(root: Path, trace: Any) -> list[CalibrationReplay]:
    """The run's calibration windows as the twin reads them (the same requests in both
    since fid15d; two halves of the calibration trace in fid15c's runs)."""
    after_ids = set(load_run(root / "calibration-after").requests["request_id"])
    same = calibration_windows(trace, 0)
    layout = same if after_ids <= {r.request_id for r in same[0]} else _halves(trace)
    out = []
    for name, replayed in zip(("calibration", "calibration-after"), layout, strict=True):
        run = load_run(root / name)
        r = run.requests[run.requests["first_token_s"].notna()]
        out.append(CalibrationReplay(replayed, dict(zip(r["request_id"], r["first_token_s"]
                                                        - r["arrival_s"], strict=True)),
                                     _numbers(run.info["router"]["overheads"])))
    return out


def errors(root: Path, trace: Any) -> str:
    """One line: the recorded errors, then the twin's fitted on both, before, after."""
    router = root.name.rsplit("-", 2)[0]
    comparison = json.loads((root / "fleet_fidelity.json").read_text())
    real = [comparison["latency"][f"p{q}_ttft_ms"]["real"] for q in (50, 90)]
    both = windows(root, trace)
    parts = [root.name, "recorded " + "/".join(
        f"{100 * comparison['latency'][f'p{q}_ttft_ms']['error']:+.1f}" for q in (50, 90))]
    for label, fitted in (("both", both), ("before", both[:1]), ("after", both[1:])):
        result, _ = fleet_twin(trace, FleetFlags(replicas=4, router=router),
                               EngineFlags(max_model_len=8192), "llama-3.1-8b", "h200", None,
                               0, _numbers(comparison["router_overheads"]["real"]),
                               tuple(fitted))
        ttft = np.array(list(ttft_by_request(result.requests).values())) * 1e3
        sim = np.percentile(ttft, [50, 90])
        parts.append(f"{label} " + "/".join(f"{100 * (s - r) / r:+.1f}"
                                            for s, r in zip(sim, real, strict=True)))
    return " | ".join(parts)


if __name__ == "__main__":
    loaded = load_trace(Path(sys.argv[1])).trace
    for run_dir in sys.argv[2:]:
        print(errors(Path(run_dir), loaded), flush=True)
