"""From vLLM-style engine flags, a model and a GPU to a ready simulation: configs, the cost
model and the KV pool size, as `vllm serve` would derive them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from runtime import CacheConfig, SchedulerConfig
from runtime.config import ENGINE_PANEL, EngineFlags, resolve_scheduler_config
from runtime.flags import flag
from runtime.kv_startup import startup_lines
from runtime.native import implementation
from sim.cost.base import CostModel
from sim.cost.kv_cache_sizing import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KvCacheSizing,
    kv_cache_sizing,
)
from sim.cost.roofline import RooflineCostModel
from sim.hardware import GpuSpec, resolve_gpu
from sim.model_config import ModelSpec
from sim.model_presets import resolve_model
from sim.profile import load_profile, shipped_profile
from sim.simulator import SimConfig
from sim.step_noise import StepNoise


@dataclass(frozen=True, slots=True)
class EngineArgs(EngineFlags):
    """`vllm serve` engine flags of the simulated engine: the shared `EngineFlags` and the
    device-sizing ones."""

    gpu_memory_utilization: float = flag(DEFAULT_GPU_MEMORY_UTILIZATION,
                                         "--gpu-memory-utilization", None, ENGINE_PANEL)
    tensor_parallel_size: int = flag(1, "--tensor-parallel-size", None, ENGINE_PANEL,
                                     short="-tp")


def args_from_configs(scheduler: SchedulerConfig, cache: CacheConfig) -> EngineArgs:
    """The flags that reproduce resolved configs exactly (a real engine's, for its twin)."""
    args = EngineArgs(
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs, max_model_len=scheduler.max_model_len,
        enable_prefix_caching=cache.enable_prefix_caching,
        enable_chunked_prefill=scheduler.enable_chunked_prefill,
        long_prefill_token_threshold=scheduler.long_prefill_token_threshold,
        policy=scheduler.policy, num_gpu_blocks_override=cache.num_blocks)
    # The measured engine's block size is a fact, not a flag to check against vLLM's CUDA
    # rule (a server on another platform may export 8): set past `EngineFlags`' check.
    object.__setattr__(args, "block_size", cache.block_size)
    return args


def with_noise_seed(config: SimConfig, seed: int) -> SimConfig:
    """`config` with its step-time noise drawn from `seed` (unchanged without noise)."""
    if config.step_noise is None:
        return config
    return replace(config, step_noise=replace(config.step_noise, seed=seed))


# `rt simulate --help`'s description of the command, beside its flags.
SIMULATE_HELP = """\
Simulate a trace through the vLLM-V1 core on a simulated clock (no GPU); with
--replicas N or --fleet FILE, a fleet of such engines behind a router.

Prints vLLM's start-up lines and "Serving Benchmark Result" block, then where the time
went. TPOT = (E2EL - TTFT) / (output tokens - 1), vLLM's definition (guidellm calls
this ITL); ITL = every gap between consecutive tokens.
"""


@dataclass(frozen=True, slots=True)
class SimFlags:
    """What is simulated: the model, the GPU and the cost model (roofline, or a profile)."""

    model: str = flag("llama-3.1-8b", "--model", "Preset (llama-3.1-8b, llama-3.1-70b, "
                      "qwen2.5-7b, mistral-7b, ...) or a local HF model directory / config.json.")
    gpu: str = flag("h200", "--gpu", "a100-80gb, h100-sxm, h200, b200 or l40s.")
    profile: str | None = flag(None, "--profile", "Calibrated cost-model profile (JSON); "
                               "default: the roofline.")
    step_noise: bool = flag(
        False, "--step-noise/--no-step-noise", "Scatter each step's predicted time as the "
        "profile's calibration steps scattered around the fit (needs a profile fitted on "
        "replay steps; seeded; raises the tails of TTFT, which waits for the step in "
        "progress; with the profile's drift table, also per the profile's drift window).")


@dataclass(frozen=True, slots=True)
class SimSetup:
    """Everything `simulate` needs, plus what it was derived from (for run.json)."""

    config: SimConfig
    cost_model: CostModel
    model: ModelSpec
    gpu: GpuSpec
    kv_sizing: KvCacheSizing | None  # None when num_gpu_blocks_override is given
    engine_args: EngineArgs
    profile_path: str | None

    @property
    def startup_lines(self) -> list[str]:
        cache, sched = self.config.cache, self.config.scheduler
        return startup_lines(cache.num_blocks, cache.block_size, sched.max_model_len)

    def describe(self) -> dict[str, Any]:
        """JSON-ready: every config value the run used."""
        cfg = self.config
        return {
            "engine_args": asdict(self.engine_args),
            "scheduler_config": asdict(cfg.scheduler),
            "cache_config": asdict(cfg.cache),
            "api_server": asdict(cfg.api_server),
            "token_times": token_times([cfg]),
            "seed": cfg.seed,
            "vocab_size": cfg.vocab_size,
            "model": asdict(self.model),
            "gpu": asdict(self.gpu),
            "kv_cache_sizing": asdict(self.kv_sizing) if self.kv_sizing else None,
            "cost_model": self.cost_model.describe(),
            "profile": self.profile_path,
            "step_noise": cfg.step_noise is not None,
            "runtime": implementation(),  # the core's modules: "compiled" or "pure"
        }


def token_times(configs: Iterable[SimConfig]) -> str:
    """run.json's "token_times": "client" when a front end delays the tokens (an output cost,
    a profile fitted on client-side times: `sim.api_server.deliver_to_clients`), else
    "engine" (step ends, then also when clients see them)."""
    return "client" if any(c.api_server.per_output_token_s > 0 for c in configs) else "engine"


def build_setup(args: EngineArgs, model: str, gpu: str, profile: str | None = None,
                seed: int = 0, check_invariants: bool = False,
                step_noise: bool = False) -> SimSetup:
    """Resolve model and GPU, size the KV pool, pick the cost model; with `step_noise`, the
    profile's measured step-time scatter (`sim.step_noise`), with its slow drift when the
    profile has one. ValueError (one line, naming the value) on any bad input."""
    model_spec = resolve_model(model)
    gpu_spec = resolve_gpu(gpu)
    scheduler = resolve_scheduler_config(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, model_max_len=model_spec.max_position_embeddings,
        model_name=model_spec.name, device_memory_bytes=gpu_spec.total_memory_bytes,
        device_name=gpu_spec.name, long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=args.enable_chunked_prefill, policy=args.policy)
    sizing = None
    num_blocks = args.num_gpu_blocks_override
    if num_blocks is None:
        sizing = kv_cache_sizing(model_spec, gpu_spec, args.tensor_parallel_size,
                                 args.gpu_memory_utilization, args.block_size)
        num_blocks = sizing.num_gpu_blocks
    cache = CacheConfig(block_size=args.block_size, num_blocks=num_blocks,
                        enable_prefix_caching=args.enable_prefix_caching)
    cost_model: CostModel
    if profile is None:
        if step_noise:
            raise ValueError("--step-noise needs a --profile (the roofline model has no "
                             "measured step-time scatter)")
        cost_model = RooflineCostModel(model_spec, gpu_spec, args.tensor_parallel_size)
        config = SimConfig(scheduler, cache, vocab_size=model_spec.vocab_size, seed=seed,
                           check_invariants=check_invariants)
    else:
        if profile == "calibrated":
            profile = str(shipped_profile(gpu, model))
        loaded = load_profile(Path(profile))
        cost_model = loaded.cost_model()
        noise = None
        if step_noise:
            if loaded.step_time_quantiles is None:
                raise ValueError(f"--step-noise: {profile} has no step_time_quantiles (a "
                                 "profile fitted on replay steps has them)")
            noise = StepNoise(loaded.step_time_quantiles, seed,
                              loaded.step_time_drift_quantiles, loaded.step_time_drift_window_s,
                              loaded.step_time_stall_probability,
                              loaded.step_time_stall_quantiles_s)
        config = SimConfig(scheduler, cache, api_server=loaded.api_server,
                           vocab_size=model_spec.vocab_size, seed=seed,
                           check_invariants=check_invariants, step_noise=noise)
    return SimSetup(config, cost_model, model_spec, gpu_spec, sizing, args, profile)
