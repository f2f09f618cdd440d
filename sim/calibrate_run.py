"""`rt calibrate`'s three ways to a profile, as the command runs them: client-timed runs
(`sim.client_calibrate`), replay steps alone (`sim.calibrate.profile_from_replays`), or the
real engine's grid (measured by backends/, which sim/ does not import: a `GridEngine`;
fitted by `sim.calibrate.profile_from_grid`); and the profile's fit summary, written out.
Which run directories are read, and how, is the caller's (`load`: a path -> its requests as
columns and its run.json)."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from runtime.config import EngineFlags
from sim.calibrate import profile_from_grid, profile_from_replays, read_replay_steps
from sim.client_calibrate import profile_from_client_runs
from sim.client_steps import client_run
from sim.endpoint_config import ExportedConfig, endpoint_configs
from sim.fidelity import CalibrationFlags
from sim.profile import Profile, write_profile

LoadRun = Callable[[Path], tuple[Mapping[str, Sequence[Any]], Mapping[str, Any]]]
NO_DRIFT = ("--step-drift: fewer than 2 windows of 0.25 s with 8+ steps in these replays; "
            "the profile has i.i.d. step-time scatter only")


class GridEngine(Protocol):
    """The real engine the calibration grid is measured on (`backends.replay.real_run.
    LoadedEngine`)."""

    def measure_grid(self, quick: bool, time_limit_s: float | None) -> Any:
        """Run the grid (the quick one, cut at `time_limit_s`) and time the API server: what
        `sim.calibrate.profile_from_grid` fits (`backends.engine.calibration_grid.
        GridCalibration`). ValueError when too few points fit the engine's limits."""


def grid_profile(engine: GridEngine, cal: CalibrationFlags, extra_steps: Sequence[Path],
                 rt_version: str) -> Profile:
    """The profile fitted on the grid measured on `engine` plus the wall-clock steps of the
    replays `extra_steps` (read first: a bad path fails before the grid runs)."""
    steps = [read_replay_steps(path, "wall") for path in extra_steps]
    return profile_from_grid(engine.measure_grid(cal.quick, cal.time_limit), steps, rt_version)


def steps_profile(paths: Sequence[Path], target: str, rt_version: str, api_server: Any = None,
                  drift: bool = False) -> tuple[Profile, list[str]]:
    """The profile fitted on replay steps alone, and notes (drift asked for, not found).
    ValueError naming --from-steps."""
    try:
        profile = profile_from_replays(paths, target, api_server=api_server, drift=drift,
                                       rt_version=rt_version)
    except ValueError as err:
        raise ValueError(f"--from-steps: {err}") from None
    missing = drift and profile.step_time_drift_quantiles is None
    return profile, [NO_DRIFT] if missing else []


def runs_profile(paths: Sequence[Path], load: LoadRun, engine: EngineFlags, seed: int,
                 rt_version: str) -> tuple[Profile, list[str]]:
    """The profile fitted on client-timed runs under the server's configuration (what its
    endpoint exported, recorded in the runs' run.json, else the engine flags) and model
    name, and the fit's lines per term. ValueError naming --from-run on a run without
    client timings."""
    runs, infos = [], []
    for path in paths:
        columns, info = load(path)
        replicas = (info.get("fleet") or {}).get("replicas", 1)
        if replicas != 1:  # (once fitted, their chunks read as one engine's steps)
            raise ValueError(f"--from-run {path}: a fleet's run ({replicas} replicas); the "
                             "client-side fit reads one engine's steps from its requests")
        try:
            runs.append(client_run(str(path), columns))
        except ValueError as err:
            raise ValueError(f"--from-run {err}") from None
        infos.append(info)
    names = [(i.get("model") or {}).get("name") for i in infos]
    exported = ExportedConfig.from_run_infos(infos)
    scheduler, cache, sources = endpoint_configs(engine, runs, exported)
    profile, result = profile_from_client_runs(
        runs, scheduler, cache, model=str(next((x for x in names if x), "unknown")),
        rt_version=rt_version, sources=sources, seed=seed,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    return profile, list(result.lines())


def fit_lines(profile: Profile) -> list[str]:
    """The fit's quality (held-out and all samples) and its coefficients (s)."""
    lines = []
    for name in ("held_out", "all_samples"):
        q = (profile.fit or {}).get(name) or {}
        if q.get("samples"):
            lines.append(f"fit on {name.replace('_', ' ')}: {q['samples']} steps, MAPE "
                         f"{q['mape']:.1%}, p90 {q['p90_ape']:.1%}, worst {q['worst_ape']:.1%}, "
                         f"total-time bias {q['bias']:+.1%}")
    stalls = (profile.fit or {}).get("left_out_stalls") or {}
    if stalls.get("steps"):
        lines.append(f"left out of the fit: {stalls['steps']} stall step(s), "
                     f"{stalls['seconds']:.2f} s in all (over {stalls['ratio']:g}x the "
                     "fitted time: a kernel compile, a pause)")
    lines += [f"  {key:<30} {value:.4g} s"
              for key, value in dataclasses.asdict(profile.coefficients).items()]
    return lines


def save_profile(profile: Profile, path: Path, log: Callable[[str], None] | None = None
                 ) -> Path:
    """Write the profile to `path` (its directory made), after each of its `fit_lines` to
    `log`; returns `path`."""
    if log is not None:
        for line in fit_lines(profile):
            log(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_profile(profile, path)
    return path
