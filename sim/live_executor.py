"""The simulator's executor on the wall clock: `rt serve --simulate`.

The engine-core process of `rt serve` calls `execute(step)` with each scheduled step; this
executor asks the cost model for the step's time and sleeps until `step.start_s + time`
(monotonic seconds, the engine's clock), so the engine's loop overhead is absorbed into the
step as long as it is shorter than the step. Tokens are synthetic: a per-request seeded
stream of ids in [10, vocab_size) that never produces a stop token (nor EOS, ids < 10), so
requests run to `max_tokens` unless a request asks for a stop token id the stream avoids.
With step noise (`--step-noise`), step k (counted from the server's start) takes the cost
model's time through the profile's `StepNoise.duration` (factor, stall), as in the simulator.

`cli.py` injects `build_live_executor` (a picklable module-level function and its keyword
arguments) into the engine process; `backends` never imports `sim`.
"""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime import CacheConfig, ScheduledStep, SchedulerConfig, SchedulerOutput
from runtime.perf import PerfShape
from sim.cost.base import CostModel
from sim.engine_args import EngineArgs, build_setup
from sim.model_config import ModelSpec
from sim.step_noise import StepNoise

_FIRST_ID = 10  # synthetic ids start above the special tokens, as the simulator's


class LiveSimExecutor:
    """Cost-model step times on the wall clock, synthetic tokens."""

    def __init__(self, cost_model: CostModel, vocab_size: int, seed: int = 0,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 step_noise: StepNoise | None = None) -> None:
        self.cost_model = cost_model
        self.step_noise = step_noise
        self.steps = 0  # steps executed (the noise's step index)
        self.vocab_size = vocab_size
        self.seed = seed
        self.clock = clock
        self.sleep = sleep
        self.rngs: dict[str, random.Random] = {}
        self.stops: dict[str, frozenset[int]] = {}
        self.num_tokens: dict[str, int] = {}  # tokens the request's sequence holds

    def register(self, req_id: str, sampling: Any) -> None:
        """`sampling` has `seed` and `stop_token_ids` (backends' SamplingOptions)."""
        seed = sampling.seed if sampling.seed is not None else \
            zlib.crc32(req_id.encode()) ^ self.seed
        self.rngs[req_id] = random.Random(seed)
        self.stops[req_id] = frozenset(sampling.stop_token_ids)

    def execute(self, step: ScheduledStep) -> tuple[Mapping[str, Sequence[int]], float]:
        duration = self.cost_model.step_time(step.features)
        if self.step_noise is not None:
            duration = self.step_noise.duration(duration, self.steps, step.start_s)
        self.steps += 1
        sampled = self.sample(step.output)
        remaining = step.start_s + duration - self.clock()
        if remaining > 0:
            self.sleep(remaining)
        return sampled, duration

    def sample(self, output: SchedulerOutput) -> dict[str, list[int]]:
        """One token for each request whose sequence is complete after the step."""
        for req_id in output.finished_req_ids:
            self.rngs.pop(req_id, None)
            self.stops.pop(req_id, None)
            self.num_tokens.pop(req_id, None)
        computed = {}
        for new in output.scheduled_new_reqs:
            tokens = new.prefill_token_ids if new.prefill_token_ids is not None \
                else new.prompt_token_ids
            self.num_tokens[new.req_id] = len(tokens)
            computed[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled = {}
        for req_id, count in output.num_scheduled_tokens.items():
            if computed[req_id] + count >= self.num_tokens[req_id]:
                sampled[req_id] = [self._next_token(req_id)]
                self.num_tokens[req_id] += 1
        return sampled

    def _next_token(self, req_id: str) -> int:
        rng = self.rngs.get(req_id)
        if rng is None:  # not registered: a fixed stream
            rng = self.rngs[req_id] = random.Random(zlib.crc32(req_id.encode()))
        stops = self.stops.get(req_id, frozenset())
        while True:
            token = rng.randrange(_FIRST_ID, self.vocab_size)
            if token not in stops:
                return token


@dataclass(slots=True)
class LiveSimSetup:
    """What the engine process needs (the attributes of `backends`' ExecutorSetup)."""

    executor: LiveSimExecutor
    scheduler: SchedulerConfig
    cache: CacheConfig
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    description: dict[str, Any] = field(default_factory=dict)
    perf_shape: PerfShape | None = None


def build_live_executor(engine_args: EngineArgs, model: str, gpu: str,
                        profile: str | None = None, seed: int = 0,
                        step_noise: bool = False) -> LiveSimSetup:
    """The executor factory of `rt serve --simulate` (runs in the engine process)."""
    setup = build_setup(engine_args, model, gpu, profile, seed, step_noise=step_noise)
    config = setup.config
    executor = LiveSimExecutor(setup.cost_model, config.vocab_size, seed,
                               step_noise=config.step_noise)
    return LiveSimSetup(executor, config.scheduler, config.cache, config.vocab_size, (),
                        setup.describe(), perf_shape(setup.model,
                                                     engine_args.tensor_parallel_size))


def perf_shape(spec: ModelSpec, tensor_parallel_size: int) -> PerfShape:
    """The simulated model's facts for vLLM's MFU estimate (`runtime.perf`): weights,
    activations and KV cache in the model's dtype, no pipeline parallelism."""
    b = spec.dtype_bytes
    return PerfShape(spec.hidden_size, spec.num_layers, spec.num_q_heads, spec.num_kv_heads,
                     spec.head_dim, spec.intermediate_size, spec.vocab_size, b, b, b,
                     tensor_parallel_size)


def live_executor_spec(engine_args: EngineArgs, model: str | None, gpu: str,
                       profile: str | None, seed: int, step_noise: bool = False
                       ) -> tuple[Callable[..., Any], dict[str, Any], str, Path | None]:
    """`rt serve --simulate`'s executor: (factory, its keyword arguments, the served model
    name, the tokenizer's directory if the model is a local one). The setup is built once
    here so that a bad flag is a ValueError before the engine process starts."""
    sim_model = model or "llama-3.1-8b"
    build_setup(engine_args, sim_model, gpu, profile, seed, step_noise=step_noise)
    kwargs = {"engine_args": engine_args, "model": sim_model, "gpu": gpu, "profile": profile,
              "seed": seed, "step_noise": step_noise}
    return build_live_executor, kwargs, sim_model, (Path(sim_model) if Path(sim_model).is_dir()
                                                    else None)
