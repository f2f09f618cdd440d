"""`rt replay` on the real engine: vLLM's start-up lines, the replay on the wall clock (one
progress bar), the run directory, vLLM's result block. Ctrl-C ends the replay early; the
records so far are written and the command exits 130."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from backends.engine.setup import RealSetup
from backends.replay.api_process import Tokenizer
from backends.replay.driver import ReplayConfig, replay
from backends.replay.run_output import INTERRUPTED, RunOutput
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
