"""`rt bench gpu`'s flags (torch-free, so the CLI can declare them without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.flags import flag


@dataclass(frozen=True, slots=True)
class GpuBenchFlags:
    """The engine-throughput section of `rt bench gpu`: which model, how many requests."""

    engine: bool = flag(True, "--engine/--no-engine", "Engine output tokens/s against "
                        "transformers' generate with static batching (goal >= 5x).")
    engine_model: str = flag("1b", "--engine-model", "1b or 3b (Llama-3.2 shape, random bf16 "
                             "weights built once under ~/.cache/rt), tiny, or a local model "
                             "directory.")
    engine_requests: int = flag(64, "--engine-requests")
    engine_prompt_len: int = flag(512, "--engine-prompt-len", "Mean prompt tokens.")
    engine_output_len: int = flag(128, "--engine-output-len", "New tokens each.")
    hf_batch_size: int | None = flag(None, "--hf-batch-size", "transformers' static batch "
                                     "size [default: as many as rt runs at once]")

    def __post_init__(self) -> None:
        for name in ("engine_requests", "engine_prompt_len", "engine_output_len",
                     "hf_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
