"""`sim.fidelity_run.FidelityRuns.replays`: the replay order, the directories, and the
calibration traces resampled out of sample (seed + index + 1), with replay and save
injected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import workloads
from runtime.records import RunResult
from sim.fidelity_run import FidelityRuns

TRACE = workloads.first_n(workloads.default_trace(), 10)


def test_replays_follow_the_order_into_numbered_directories(tmp_path: Path) -> None:
    replayed: list[workloads.Trace] = []
    saved: list[tuple[Any, ...]] = []
    logged: list[str] = []

    def replay(trace: workloads.Trace) -> RunResult:
        replayed.append(trace)
        return RunResult([], {"step": [0, 1]}, 0, 0, 1.5)

    def save(path: Path, kind: str, trace: workloads.Trace, result: RunResult,
             describe: Any, **extra: Any) -> None:
        saved.append((path.name, kind, describe, extra))

    runs = FidelityRuns(TRACE, tmp_path, 7, {"engine": 1}, replay, save, logged.append)
    order = [("calibration", 0), ("real", 0), ("calibration", 1), ("real", 1)]
    reals, calibrations = runs.replays(order, tokenizer=False)
    assert reals == [tmp_path / "real", tmp_path / "real-2"]
    assert calibrations == [tmp_path / "calibration", tmp_path / "calibration-2"]
    assert [s[0] for s in saved] == ["calibration", "real", "calibration-2", "real-2"]
    assert all(s[1:] == ("replay", {"engine": 1}, {"tokenizer": False}) for s in saved)
    assert replayed[1] is TRACE and replayed[3] is TRACE
    assert replayed[0] == workloads.resample_like(TRACE, 8)
    assert replayed[2] == workloads.resample_like(TRACE, 9)
    assert logged[1] == f"replayed 10 requests, 2 steps, 1.50 s wall -> {tmp_path / 'real'}"
