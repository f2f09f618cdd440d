"""Offline, on runs of docs/measure/fleet_fidelity.sh with two calibration windows: the
twin's p50/p90 TTFT error against the recorded real replay when the serving stack is fitted
on both windows (as `rt fidelity --fleet` runs; it reproduces the recorded figures), on the
window before only and on the window after only (each alone as the first window: its
requests arriving before its first request's first token left out). Seed 0 and the engine
flags of the script (`--max-model-len 8192`, llama-3.1-8b, h200, 4 replicas).

    PYTHONPATH=. python docs/measure/fleet_fidelity_windows.py TRACE RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from analysis.rundir import load_run
from backends.route.fleet_fidelity import CalibrationReplay, calibration_windows
from runtime.config import EngineFlags
from runtime.records import ttft_by_request
from sim.fidelity import fleet_twin
from sim.fleet_config import FleetFlags
from workloads.loaders import load_trace


def _numbers(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: math.nan if v is None else v for k, v in figures.items()}  # JSON null: NaN


def windows(root: Path, trace: Any) -> list[CalibrationReplay]:
    """The run's calibration windows as the twin reads them."""
    out = []
    for name, replayed in zip(("calibration", "calibration-after"),
                              calibration_windows(trace, 0), strict=True):
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
