"""`rt fidelity`'s runs: the real replays of the trace and the calibration replays of traces
resampled from it (out of sample), then the twin's simulations under the real engine's
configs, each written as a run directory under one root.

The real replay (backends/, which sim/ does not import) and the writing of a run directory
(analysis/) are the caller's, injected: `replay(trace) -> RunResult` (it raises to stop, e.g.
on Ctrl-C) and `save(path, kind, trace_info, result, describe, **extra)` (the CLI's
`CONSOLE.save`, `analysis.run_console.RunConsole.save`: it writes and returns None;
`trace_info`: `workloads.trace_info` of the run's trace). On the real engine, the engine
(a `RealEngine`) and the terminal (a `FidelityOutput`) come as one object each."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from runtime import CacheConfig, SchedulerConfig
from runtime.records import RunResult
from sim.calibrate import predict_step_rows, replay_api_cost
from sim.calibrate_run import GridEngine, grid_profile, save_profile, steps_profile
from sim.engine_args import SimSetup
from sim.fidelity import CalibrationFlags, FidelityFlags, TwinRun, twin_simulations
from sim.profile import Profile, load_profile
from workloads import Trace, check_max_model_len, resample_like, trace_info

Replay = Callable[[Trace], RunResult]


class Save(Protocol):
    """Writes one run directory: the CLI's `RunConsole.save` (`analysis.rundir.write_result`);
    `trace` is `workloads.trace_info` of the run's trace, `extra` more run.json fields."""

    def __call__(self, path: Path, kind: str, trace: Mapping[str, Any], result: RunResult,
                 describe: Mapping[str, Any], **extra: Any) -> None: ...


class FidelityOutput(Protocol):
    """Where `rt fidelity`'s runs are written and its lines go: the CLI's
    `analysis.run_console.RunConsole`."""

    def save(self, path: Path, kind: str, trace: Mapping[str, Any], result: RunResult,
             describe: Mapping[str, Any], **extra: Any) -> None:
        """Write a run directory (as `Save`)."""

    def say(self, line: str) -> None:
        """A status line (one per replay)."""

    def tell(self, line: str) -> None:
        """A plain line (a profile's fit)."""


class RealEngine(GridEngine, Protocol):
    """The loaded real engine as `rt fidelity` drives it: `backends.replay.real_run.
    LoadedEngine`."""

    @property
    def scheduler(self) -> SchedulerConfig: ...
    @property
    def cache(self) -> CacheConfig: ...
    @property
    def model(self) -> str: ...  # the model directory
    @property
    def seed(self) -> int: ...

    def describe(self) -> Mapping[str, Any]:
        """run.json's sections on the engine."""

    def replay(self, trace: Trace) -> RunResult:
        """Replay `trace` on the wall clock (Ctrl-C ends the command)."""


@dataclass(frozen=True)
class FidelityRuns:
    """Where `trace`'s runs go (`root`), the real engine's seed and run.json sections
    (`describe`), and the injected replay, save and log (one line per replay)."""

    trace: Trace
    root: Path
    seed: int
    describe: Mapping[str, Any]
    replay: Replay
    save: Save
    log: Callable[[str], None]

    def replays(self, order: Sequence[tuple[str, int]], **extra: Any
                ) -> tuple[list[Path], list[Path]]:
        """Replay in `order` ((kind, index) pairs, `analysis.fidelity.replay_order`):
        "real" replays the trace into root/real, root/real-2, ...; "calibration" a trace
        resampled from it (seed + index + 1) into root/calibration, ... Returns both lists."""
        dirs: dict[str, list[Path]] = {"real": [], "calibration": []}
        for kind, i in order:
            path = self.root / (kind + (f"-{i + 1}" if i else ""))
            source = self.trace if kind == "real" else resample_like(self.trace, self.seed + i + 1)
            result = self.replay(source)
            self.save(path, "replay", trace_info(source), result, self.describe, **extra)
            self.log(f"replayed {len(source)} requests, {result.num_steps} steps, "
                     f"{result.wall_s:.2f} s wall -> {path}")
            dirs[kind].append(path)
        return dirs["real"], dirs["calibration"]

    def twins(self, scheduler: SchedulerConfig, cache: CacheConfig, model: str,
              profile: Path, step_noise: bool, runs: int) -> tuple[list[Path], list[str]]:
        """The twin's simulations (`sim.fidelity.twin_simulations`) into root/sim,
        root/sim-2, ...; and the notes for the user."""
        sim, twins, notes = twin_simulations(self.trace, scheduler, cache, model, profile,
                                             self.seed, step_noise, runs)
        return save_twins(self.save, self.root, self.trace, sim, twins), notes


def save_twins(save: Save, root: Path, trace: Trace, sim: SimSetup, twins: Sequence[TwinRun],
               **extra: Any) -> list[Path]:
    """Each twin simulation of `trace` saved into root/<its name> (run.json: its step-noise
    seed and `extra`); their directories."""
    info, describe = trace_info(trace), sim.describe()
    for twin in twins:
        save(root / twin.name, "simulate", info, twin.result, describe,
             step_noise_seed=twin.noise_seed, **extra)
    return [root / twin.name for twin in twins]


def predicted_steps(profile: Path, steps: Mapping[str, Sequence[Any]]) -> np.ndarray:
    """The profile's predicted seconds of each recorded step."""
    return predict_step_rows(load_profile(profile).coefficients, steps)


@dataclass(frozen=True)
class FidelityDirs:
    """What a fidelity run wrote, for `analysis.fidelity.report_fidelity_dirs`: the real and
    twin run directories, the profile simulated, the calibration replays (the report's
    drift) and fidelity.json's extra sections."""

    reals: list[Path]
    sims: list[Path]
    profile: Path
    calibrations: list[Path] = field(default_factory=list)
    extra: dict[str, Any] | None = None

    def predict(self, steps: Mapping[str, Sequence[Any]]) -> np.ndarray:
        """The profile's predicted seconds of each of these recorded steps."""
        return predicted_steps(self.profile, steps)


@dataclass(frozen=True)
class RealFidelity:
    """`rt fidelity` on the real engine: its `runs` (replays and twins), the engine's configs
    and model, `grid()` (the injected calibration grid, measured on the engine and fitted),
    rt's `version` (recorded in a profile fitted on replays) and where a profile's fit lines
    go (`log`)."""

    runs: FidelityRuns
    scheduler: SchedulerConfig
    cache: CacheConfig
    model: str
    grid: Callable[[], Profile]
    version: str
    log: Callable[[str], None]

    @classmethod
    def of(cls, engine: RealEngine, console: FidelityOutput, trace: Trace, root: Path,
           cal: CalibrationFlags, version: str) -> RealFidelity:
        """`trace`'s fidelity runs on `engine` into `root`, calibrating on its grid (`cal`)
        when it must, shown on `console`."""
        runs = FidelityRuns(trace, root, engine.seed, engine.describe(), engine.replay,
                            console.save, console.say)
        return cls(runs, engine.scheduler, engine.cache, engine.model, functools.partial(
            grid_profile, engine, cal, [], version), version, console.tell)

    def run(self, how: FidelityFlags, order: Sequence[tuple[str, int]], step_drift: bool,
            step_noise: bool, **extra: Any) -> tuple[FidelityDirs, list[str]]:
        """Check the trace fits the engine (ValueError), calibrate (on the grid before the
        replays, or on calibration/real replays after: `sim.calibrate_run.steps_profile` on
        their wall-clock steps), replay in `order`, simulate the twins. Returns the real and
        twin run directories and the profile's path, and notes."""
        check_max_model_len(self.runs.trace, self.scheduler.max_model_len)
        self.runs.root.mkdir(parents=True, exist_ok=True)
        profile, path = how.profile, self.runs.root / "profile.json"
        if profile is None and how.calibrate_on == "grid" and not how.fit_on_replay:
            profile = save_profile(self.grid(), path, self.log)
        reals, calibrations = self.runs.replays(order, **extra)
        fit_notes: list[str] = []
        if replays := calibrations or (reals if how.fit_on_replay else []):
            fitted, fit_notes = steps_profile(replays, "wall", self.version,
                                              replay_api_cost(replays), step_drift)
            profile = save_profile(fitted, path, self.log)
        assert profile is not None  # the grid's, the replays' or --profile
        sims, notes = self.runs.twins(self.scheduler, self.cache, self.model, profile,
                                      step_noise, how.sim_runs)
        return FidelityDirs(reals, sims, profile), fit_notes + notes
