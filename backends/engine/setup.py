"""From vLLM-style engine flags and a local model directory to a ready real engine: the
scheduler and cache configs, the loaded model, the KV cache and the runner."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from backends.engine.attention import select_ops, warm_up_attention
from backends.engine.flags import DEFAULT_GPU_MEMORY_UTILIZATION, RealEngineFlags
from backends.engine.kv_cache import GIB, KVCache, KVCacheSpec, KVPoolSize, size_pool
from backends.engine.model import ModelShape, PagedModel, load_model
from backends.engine.model_runner import ModelRunner
from runtime import CacheConfig, SchedulerConfig
from runtime.config import EngineFlags, resolve_scheduler_config
from runtime.native import implementation
from runtime.perf import PerfShape


@dataclass(frozen=True, slots=True)
class RealEngineArgs(EngineFlags):
    """`vllm serve`-style flags of the real engine: the shared `EngineFlags`, the model and
    where it runs."""

    model_dir: Path
    device: str = "cpu"
    dtype: str = "auto"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    seed: int = 0
    use_triton: bool | None = None  # None: Triton on CUDA when available
    random_weights: bool = False  # read only config.json; random weights from `seed`

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"--kv-cache-memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:  # nan too; vLLM refuses it anywhere
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")


def real_engine_args(model_dir: Path, engine: EngineFlags, real: RealEngineFlags,
                     seed: int) -> RealEngineArgs:
    """The shared engine flags, the real engine's own, the model and the seed in one."""
    return RealEngineArgs(model_dir=model_dir, seed=seed, **asdict(engine), **asdict(real))


@dataclass(slots=True)
class RealSetup:
    """Everything `replay` needs, plus what it was derived from (for run.json)."""

    args: RealEngineArgs
    scheduler: SchedulerConfig
    cache: CacheConfig
    runner: ModelRunner
    shape: ModelShape
    pool: KVPoolSize
    attention: str
    dtype: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> PagedModel:
        return self.runner.model

    def perf_shape(self) -> PerfShape:
        """The model facts of vLLM's MFU estimate (`runtime.perf`): weights, activations and
        the KV cache all in the model's dtype, one GPU. The MLP width as vLLM reads it
        (`intermediate_size`, else 4 x hidden)."""
        config, shape = self.model.config, self.shape
        element = torch.empty((), dtype=self.model.dtype).element_size()
        return PerfShape(shape.hidden_size, shape.num_layers, shape.num_heads,
                         shape.num_kv_heads, shape.head_dim,
                         getattr(config, "intermediate_size", None) or 4 * shape.hidden_size,
                         shape.vocab_size, element, element, element)

    def describe(self) -> dict[str, Any]:
        """JSON-ready: every config value the run used."""
        args = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.args).items()}
        return {
            "engine_args": args,
            "scheduler_config": asdict(self.scheduler),
            "cache_config": asdict(self.cache),
            "seed": self.args.seed,
            "runtime": implementation(),  # the scheduler/KV core: "compiled" or "pure"
            "vocab_size": self.shape.vocab_size,
            "model": {**asdict(self.shape), "dir": str(self.args.model_dir)},
            "device": _device_name(self.runner.device),
            "dtype": self.dtype,
            "attention": self.attention,
            "kv_cache_sizing": asdict(self.pool),
            **self.extra,
        }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def _scheduler_config(args: RealEngineArgs, shape: ModelShape,
                      device: torch.device) -> SchedulerConfig:
    memory = name = None
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        memory, name = properties.total_memory, properties.name
    return resolve_scheduler_config(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, model_max_len=shape.max_position_embeddings,
        model_name=str(args.model_dir), device_memory_bytes=memory, device_name=name or "",
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=args.enable_chunked_prefill, policy=args.policy)


def activation_reserve(shape: ModelShape, max_num_batched_tokens: int,
                       dtype: torch.dtype) -> int:
    """Bytes kept free for a step's activations on a GPU: ~16 hidden-sized and 4
    MLP-sized rows per batched token (fp32 upcasts included), at least 1 GiB."""
    element = torch.empty((), dtype=dtype).element_size()
    per_token = (16 * shape.hidden_size + 4 * 4 * shape.hidden_size) * max(element, 4)
    return max(GIB, max_num_batched_tokens * per_token)


def build_engine(args: RealEngineArgs) -> RealSetup:
    """Load the model, size and allocate the KV pool, build the runner. ValueError (one
    line) on any bad input: model directory, flags, a pool too small for one block."""
    device = resolve_device(args.device)
    ops = select_ops(device, args.use_triton)
    model = load_model(Path(args.model_dir), args.dtype, device, ops,
                       args.seed if args.random_weights else None)
    shape = model.shape
    scheduler = _scheduler_config(args, shape, device)
    spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, args.block_size,
                       model.dtype)
    pool = size_pool(spec, device, args.num_gpu_blocks_override, args.kv_cache_memory,
                     args.gpu_memory_utilization,
                     activation_reserve(shape, scheduler.max_num_batched_tokens, model.dtype))
    cache = CacheConfig(block_size=args.block_size, num_blocks=pool.num_blocks,
                        enable_prefix_caching=args.enable_prefix_caching)
    kv_cache = KVCache(spec, pool.num_blocks, device)
    # Compile the attention kernels' variants now, not inside the first timed steps.
    warmup = warm_up_attention(ops, kv_cache.key_caches[0], shape.num_heads,
                               max_kv_len(scheduler.max_model_len, cache), model.scale)
    runner = ModelRunner(model, kv_cache, seed=args.seed)
    dtype_name = str(model.dtype).removeprefix("torch.")
    extra = {} if warmup is None else {"kernel_warmup": warmup.describe()}
    return RealSetup(args, scheduler, cache, runner, shape, pool, ops.kind, dtype_name, extra)


def max_kv_len(max_model_len: int, cache: CacheConfig) -> int:
    """The most keys one sequence's block table can span, tokens: its blocks hold at most
    max_model_len tokens, and they are distinct blocks of the pool."""
    blocks = min(-(-max_model_len // cache.block_size), cache.num_blocks)
    return blocks * cache.block_size


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model directory's own tokenizer, or None when it has none (the tiny model)."""
    if not any((Path(model_dir) / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--model {model_dir}: cannot load its tokenizer: {first}") from err


def load_real_engine(model: Path | None, engine: EngineFlags, real: RealEngineFlags,
                     seed: int) -> tuple[RealSetup, Any | None]:
    """The real engine and the model's tokenizer (None if it has none): --model's directory,
    by default the tiny random Llama; with --random-weights --model may also name a preset
    shape (llama-3.1-8b, ...)."""
    from backends.engine.tiny_model import build_tiny_llama, preset_config_dir

    model_dir = model if model is not None else build_tiny_llama()
    if real.random_weights and not model_dir.is_dir():
        model_dir = preset_config_dir(str(model_dir))
    args = real_engine_args(model_dir, engine, real, seed)
    return build_engine(args), load_tokenizer(model_dir)
