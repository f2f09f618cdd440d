"""The real engine's own flags (torch-free, so the CLI can declare them without importing
torch): where the model runs and how its KV pool is sized. With the shared `EngineFlags`, a
model directory and a seed they make a `backends.engine.setup.RealEngineArgs`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.flags import flag

REAL_PANEL = "Real engine"
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True, slots=True)
class RealEngineFlags:
    device: str = flag("cpu", "--device", "cpu or cuda.", REAL_PANEL)
    dtype: str = flag("auto", "--dtype", "auto, float32, float16 or bfloat16 (auto: fp32 on "
                      "the CPU, the checkpoint's half type on CUDA).", REAL_PANEL)
    kv_cache_memory: int | None = flag(
        None, "--kv-cache-memory", "KV pool size in bytes (default: free GPU memory at "
        "--gpu-memory-utilization; 256 MiB on the CPU).", REAL_PANEL)
    gpu_memory_utilization: float = flag(DEFAULT_GPU_MEMORY_UTILIZATION,
                                         "--gpu-memory-utilization", None, REAL_PANEL)
    random_weights: bool = flag(
        False, "--random-weights", "Read only the model's config.json and initialise its "
        "weights at random from --seed on the device (seconds for an 8B model); --model may "
        "then also be a preset shape: llama-3.2-1b, llama-3.2-3b or llama-3.1-8b.", REAL_PANEL)


@dataclass(frozen=True, slots=True)
class ModelDirFlags:
    """`--model`: the real engine's checkpoint (`backends.engine.setup.load_real_engine`)."""

    model: Path | None = flag(
        None, "--model", "Local Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3). "
        "Default: a tiny random Llama, built once in ~/.cache/rt/tiny-llama-v2.", REAL_PANEL)
