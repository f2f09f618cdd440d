"""`rt replay` on the real engine: vLLM's start-up lines, the replay on the wall clock (one
progress bar), the run directory, vLLM's result block. Ctrl-C ends the replay early; the
records so far are written and the command exits 130. The CLI drives the loaded engine as
one object, `LoadedEngine` (for `rt fidelity` and `rt calibrate`: a
`sim.fidelity_run.RealEngine`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.engine.calibration_grid import GridCalibration, calibrate_engine
from backends.engine.setup import RealSetup
from backends.replay.api_process import Tokenizer
from backends.replay.driver import ReplayConfig, replay
from backends.replay.run_output import INTERRUPTED, RunOutput
from runtime import CacheConfig, SchedulerConfig
from runtime.kv_startup import startup_lines
from runtime.records import RunResult
from workloads import Trace, check_max_model_len, trace_info


def replay_on(trace: Trace, setup: RealSetup, tokenizer: Tokenizer | None, out: RunOutput,
              check_invariants: bool = False, stop_if_interrupted: bool = False) -> RunResult:
    """Replay `trace` on the loaded engine under `out`'s progress bar; Ctrl-C ends the replay
    early, and with `stop_if_interrupted` the command (exit 130)."""
    with out.progress("replaying", len(trace)) as update:
        result = replay(trace, ReplayConfig.of(setup, check_invariants), setup.runner,
                        tokenizer, update)
    if result.interrupted and stop_if_interrupted:
        out.exit(130)
    return result


def run_replay(trace: Trace, setup: RealSetup, tokenizer: Tokenizer | None, path: Path,
               percentiles: Sequence[float], check_invariants: bool, out: RunOutput) -> None:
    """Check every request fits the engine's max_model_len (ValueError), print the pool's
    start-up lines and the engine, replay, write run directory `path` and show it; exit 130
    when Ctrl-C cut the replay short."""
    check_max_model_len(trace, setup.scheduler.max_model_len)
    for line in startup_lines(setup.cache.num_blocks, setup.cache.block_size,
                              setup.scheduler.max_model_len):
        out.tell(line)
    out.say(f"note: model {setup.args.model_dir} ({setup.shape.model_type}) on "
            f"{setup.args.device}, {setup.dtype}, attention: {setup.attention}")
    result = replay_on(trace, setup, tokenizer, out, check_invariants)
    out.save(path, "replay", trace_info(trace), result, setup.describe(),
             interrupted=result.interrupted, tokenizer=tokenizer is not None)
    out.show(path, result, percentiles)
    if result.interrupted:
        out.say(INTERRUPTED)
        out.exit(130)


@dataclass(frozen=True)
class LoadedEngine:
    """The loaded engine and its tokenizer with the run's output, as `rt replay` replays on
    it, and `rt fidelity` replays and calibrates on it (`sim.fidelity_run.RealEngine`)."""

    setup: RealSetup
    tokenizer: Tokenizer | None
    out: RunOutput

    @property
    def scheduler(self) -> SchedulerConfig:
        return self.setup.scheduler

    @property
    def cache(self) -> CacheConfig:
        return self.setup.cache

    @property
    def model(self) -> str:
        return str(self.setup.args.model_dir)

    @property
    def seed(self) -> int:
        return self.setup.args.seed

    @property
    def tokenized(self) -> bool:
        """Whether replays send the prompts' text through the tokenizer (run.json)."""
        return self.tokenizer is not None

    def describe(self) -> dict[str, Any]:
        return self.setup.describe()

    def replay_into(self, trace: Trace, path: Path, percentiles: Sequence[float],
                    check_invariants: bool) -> None:
        """`rt replay`: `run_replay` into run directory `path`."""
        run_replay(trace, self.setup, self.tokenizer, path, percentiles, check_invariants,
                   self.out)

    def replay(self, trace: Trace) -> RunResult:
        """`replay_on`; Ctrl-C ends the command (exit 130)."""
        return replay_on(trace, self.setup, self.tokenizer, self.out, stop_if_interrupted=True)

    def measure_grid(self, quick: bool, time_limit_s: float | None) -> GridCalibration:
        """`calibrate_engine` under one progress bar."""
        with self.out.progress("calibrating") as update:
            return calibrate_engine(self.setup, self.tokenizer, quick, time_limit_s, update)
