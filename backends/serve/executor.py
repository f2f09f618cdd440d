"""The executor of `rt serve`'s engine-core process (vLLM's `Executor`): what runs a
scheduled step and returns the sampled tokens, and the factory the engine process calls to
build it. The factory is picklable (a module-level function and its keyword arguments), so
the API process names it and the engine process runs it: `build_real_executor` loads the
model (`backends.engine`); `cli.py` injects the simulator's wall-clock executor
(`sim.live_executor`) instead for `--simulate`, which returns the same attributes as
`ExecutorSetup`. Durations are seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from backends.engine.sampling_options import SamplingOptions
from runtime import CacheConfig, ScheduledStep, SchedulerConfig
from runtime.perf import PerfShape


class Executor(Protocol):
    """Runs steps. `execute` returns the sampled tokens ({request id: [token]}, for the
    requests whose sequence completes in the step) and the step's duration in seconds."""

    def register(self, req_id: str, sampling: SamplingOptions) -> None: ...

    def execute(self, step: ScheduledStep) -> tuple[Mapping[str, Sequence[int]], float]: ...


@dataclass(slots=True)
class ExecutorSetup:
    """What an executor factory returns (the simulator's returns the same attributes)."""

    executor: Executor
    scheduler: SchedulerConfig
    cache: CacheConfig
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    description: dict[str, Any] = field(default_factory=dict)
    perf_shape: PerfShape | None = None  # the model facts of the MFU estimate (if known)


ExecutorFactory = Callable[..., Any]  # module-level, keyword arguments -> ExecutorSetup


class RunnerExecutor:
    """The real executor: `ModelRunner.execute` on the scheduler output."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def register(self, req_id: str, sampling: SamplingOptions) -> None:
        self.runner.register(req_id, sampling)

    def execute(self, step: ScheduledStep) -> tuple[Mapping[str, Sequence[int]], float]:
        result = self.runner.execute(step.output)
        return result.sampled, result.duration_s


def build_real_executor(args: Any) -> ExecutorSetup:
    """The factory of the real engine: `args` is a `RealEngineArgs` (model loaded here)."""
    from backends.engine.setup import build_engine

    setup = build_engine(args)
    return ExecutorSetup(RunnerExecutor(setup.runner), setup.scheduler, setup.cache,
                         setup.shape.vocab_size, tuple(setup.shape.eos_token_ids),
                         setup.describe(), setup.perf_shape())


def real_executor_spec(model: str | None, engine: Any, real: Any, seed: int
                       ) -> tuple[Callable[..., Any], dict[str, Any], str, Path]:
    """`rt serve`'s real executor: (factory, its keyword arguments, the served model name,
    the tokenizer's directory); the model is loaded in the engine process. `engine` and
    `real` are the EngineFlags and RealEngineFlags; ValueError when --model is not a model
    directory."""
    from backends.engine.setup import real_engine_args
    from backends.engine.tiny_model import build_tiny_llama

    model_dir = Path(model) if model is not None else build_tiny_llama()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: not a model directory (no config.json)")
    args = real_engine_args(model_dir, engine, real, seed)
    name = "tiny-llama" if model is None else model  # as typed: vLLM's default served name
    return build_real_executor, {"args": args}, name, model_dir
