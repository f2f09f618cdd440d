"""From vLLM-style engine flags, a model and a GPU to a ready simulation: configs, the cost
model and the KV pool size, as `vllm serve` would derive them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runtime import CacheConfig, SchedulerConfig
from sim.cost_model import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    CostModel,
    KvCacheSizing,
    RooflineCostModel,
    kv_cache_sizing,
    startup_lines,
)
from sim.hardware import GIB, GpuSpec, resolve_gpu
from sim.model_config import ModelSpec, resolve_model
from sim.profile import load_profile
from sim.simulator import SimConfig


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """`vllm serve` engine flags, by their vLLM names. None means "as vLLM would choose"."""

    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    tensor_parallel_size: int = 1


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
            "seed": cfg.seed,
            "vocab_size": cfg.vocab_size,
            "model": asdict(self.model),
            "gpu": asdict(self.gpu),
            "kv_cache_sizing": asdict(self.kv_sizing) if self.kv_sizing else None,
            "cost_model": self.cost_model.describe(),
            "profile": self.profile_path,
        }


def default_batch_limits(gpu: GpuSpec) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that `vllm serve` picks for a GPU
    (vLLM's `EngineArgs.get_batch_defaults`, OpenAI API server column): 16384 / 1024 from
    160 GiB of memory, 8192 / 1024 from 70 GiB except A100s, else 2048 / 256."""
    memory = gpu.total_memory_bytes
    if memory >= 160 * GIB:
        return 16384, 1024
    if memory >= 70 * GIB and "a100" not in gpu.name.lower():
        return 8192, 1024
    return 2048, 256


def build_setup(args: EngineArgs, model: str, gpu: str, profile: str | None = None,
                seed: int = 0, check_invariants: bool = False) -> SimSetup:
    """Resolve model and GPU, size the KV pool, pick the cost model. ValueError (one line,
    naming the value) on any bad input."""
    model_spec = resolve_model(model)
    gpu_spec = resolve_gpu(gpu)
    batched, seqs = _batch_limits(args, gpu_spec)
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = model_spec.max_position_embeddings
    elif max_model_len > model_spec.max_position_embeddings:
        raise ValueError(  # vLLM refuses this too
            f"max_model_len={max_model_len} is longer than {model_spec.name}'s "
            f"max_position_embeddings={model_spec.max_position_embeddings}")
    if not args.enable_chunked_prefill and args.max_num_batched_tokens is None:
        batched = max(batched, max_model_len)  # vLLM's default without chunked prefill
    scheduler = SchedulerConfig(
        max_num_batched_tokens=batched, max_num_seqs=seqs, max_model_len=max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=args.enable_chunked_prefill,
        policy=args.policy,  # type: ignore[arg-type]
    )
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
        cost_model = RooflineCostModel(model_spec, gpu_spec, args.tensor_parallel_size)
        config = SimConfig(scheduler, cache, vocab_size=model_spec.vocab_size, seed=seed,
                           check_invariants=check_invariants)
    else:
        loaded = load_profile(Path(profile))
        cost_model = loaded.cost_model()
        config = SimConfig(scheduler, cache, api_server=loaded.api_server,
                           vocab_size=model_spec.vocab_size, seed=seed,
                           check_invariants=check_invariants)
    return SimSetup(config, cost_model, model_spec, gpu_spec, sizing, args, profile)


def _batch_limits(args: EngineArgs, gpu: GpuSpec) -> tuple[int, int]:
    default_batched, default_seqs = default_batch_limits(gpu)
    seqs = default_seqs if args.max_num_seqs is None else args.max_num_seqs
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = max(default_batched, seqs)
    return batched, seqs
