"""Frozen, validated configuration of the scheduler and the paged KV cache.

Field names and defaults follow vLLM's V1 `SchedulerConfig` and `CacheConfig` (vLLM 0.33).
Every check raises `ValueError` naming the field and its value; nothing is mutated after
construction. Variants come from `dataclasses.replace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from runtime.flags import flag

Policy = Literal["fcfs", "priority"]


ENGINE_PANEL = "Engine (vLLM flags)"
# `--block-size` as vLLM takes it on CUDA: a user's block size the attention backend does not
# support is refused at start-up (vLLM's `Platform.update_block_size_for_backend`), and the
# CUDA backends' kernel block sizes are multiples of 16 (FlashAttention's and Triton's
# `get_supported_kernel_block_sizes` = `MultipleOf(16)`; vLLM's default is 16).
BLOCK_SIZE_MULTIPLE = 16
# Blocks in a pool at most: the free queue's range of unbuilt blocks has a C length (a
# 64-bit ssize_t); the pool builds blocks lazily, so any count up to it simulates.
MAX_NUM_BLOCKS = 2**63 - 1


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineFlags:
    """The scheduler and KV-cache flags of `vllm serve` that the simulated and the real
    engine both take, by their vLLM names. None means "as vLLM would choose"
    (`resolve_scheduler_config` decides). Keyword-only, so a subclass's own required
    fields can come first."""

    max_num_batched_tokens: int | None = flag(
        None, "--max-num-batched-tokens", "Token budget per step (default: vLLM's for the "
        "device).", ENGINE_PANEL)
    max_num_seqs: int | None = flag(
        None, "--max-num-seqs", "Running requests at most (default: vLLM's for the device).",
        ENGINE_PANEL)
    max_model_len: int | None = flag(
        None, "--max-model-len", "Default: the model's max_position_embeddings.", ENGINE_PANEL)
    block_size: int = flag(16, "--block-size", "Tokens per KV block: a multiple of 16, as "
                           "vLLM's CUDA attention backends take.", ENGINE_PANEL)
    enable_prefix_caching: bool = flag(
        True, "--enable-prefix-caching/--no-enable-prefix-caching", None, ENGINE_PANEL)
    enable_chunked_prefill: bool = flag(
        True, "--enable-chunked-prefill/--no-enable-chunked-prefill", None, ENGINE_PANEL)
    long_prefill_token_threshold: int = flag(0, "--long-prefill-token-threshold", None,
                                             ENGINE_PANEL)
    policy: str = flag("fcfs", "--policy", "fcfs or priority.", ENGINE_PANEL)
    num_gpu_blocks_override: int | None = flag(
        None, "--num-gpu-blocks-override", "KV blocks (overrides every other sizing).",
        ENGINE_PANEL)

    def __post_init__(self) -> None:
        _require(self.block_size >= 1 and self.block_size % BLOCK_SIZE_MULTIPLE == 0,
                 f"--block-size must be a multiple of {BLOCK_SIZE_MULTIPLE} (vLLM's CUDA "
                 f"attention backends' kernel block sizes), got {self.block_size}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """The paged KV pool.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: blocks in the pool, including block 0, the null block, which is never
            allocated; `num_blocks - 1` blocks are usable.
        enable_prefix_caching: reuse full blocks across requests by chained block hash.
    """

    block_size: int = 16
    num_blocks: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(
            self.num_blocks >= 2,
            f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}",
        )
        _require(
            self.num_blocks <= MAX_NUM_BLOCKS,
            f"num_blocks must be <= {MAX_NUM_BLOCKS}, got {self.num_blocks}",
        )

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can hold: all but the null block."""
        return self.num_blocks - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """The step scheduler (vLLM V1 semantics).

    Attributes:
        max_num_batched_tokens: per-step token budget, shared by prefill chunks and decodes.
        max_num_seqs: cap on RUNNING requests; admission stops at it.
        max_model_len: longest sequence (prompt + output tokens) a request may reach.
        long_prefill_token_threshold: per-request cap on tokens scheduled in one step (0 = off);
            ignored while only one request is running or waiting.
        long_prefill_token_threshold_adaptive: raise the cap to
            `max_num_batched_tokens // (running + waiting)` when that is larger.
        enable_chunked_prefill: a prompt may be split over several steps. When off, a waiting
            request whose remaining prompt exceeds the budget stops admission.
        policy: "fcfs", or "priority" (lower `priority` first, then earlier arrival).
        watermark: fraction of all blocks kept free when admitting while others run.
        scheduler_reserve_full_isl: admit a waiting request only if its whole current sequence
            fits in the free blocks, not only its first chunk.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    enable_chunked_prefill: bool = True
    policy: Policy = "fcfs"
    watermark: float = 0.0
    scheduler_reserve_full_isl: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            _require(value >= 1, f"{name} must be >= 1, got {value}")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
            f"max_num_seqs ({self.max_num_seqs})",
        )
        _require(
            self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
            f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) "
            f"must be >= max_model_len ({self.max_model_len})",
        )
        _require(
            0 <= self.long_prefill_token_threshold <= self.max_model_len,
            f"long_prefill_token_threshold must be in [0, max_model_len={self.max_model_len}], "
            f"got {self.long_prefill_token_threshold}",
        )
        _require(
            self.policy in ("fcfs", "priority"),
            f"policy must be 'fcfs' or 'priority', got {self.policy!r}",
        )
        _require(0.0 <= self.watermark < 1.0, f"watermark must be in [0, 1), got {self.watermark}")


_GIB = 2**30


def default_batch_limits(device_memory_bytes: int | None, device_name: str = "") -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that `vllm serve` picks for a device (vLLM's
    `EngineArgs.get_batch_defaults`, API-server column): 16384 / 1024 from 160 GiB of device
    memory, 8192 / 1024 from 70 GiB except A100s, else (and on the CPU: None) 2048 / 256."""
    if device_memory_bytes is not None and device_memory_bytes >= 160 * _GIB:
        return 16384, 1024
    if (device_memory_bytes is not None and device_memory_bytes >= 70 * _GIB
            and "a100" not in device_name.lower()):
        return 8192, 1024
    return 2048, 256


def resolve_scheduler_config(
    *,
    max_num_batched_tokens: int | None,
    max_num_seqs: int | None,
    max_model_len: int | None,
    model_max_len: int,
    model_name: str,
    device_memory_bytes: int | None,
    device_name: str = "",
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
    policy: str = "fcfs",
) -> SchedulerConfig:
    """A `SchedulerConfig` from `vllm serve`-style flags, None meaning "as vLLM chooses":
    batch limits by device, max_model_len = the model's context (longer is refused, as
    vLLM does), and without chunked prefill a budget of at least max_model_len."""
    default_batched, default_seqs = default_batch_limits(device_memory_bytes, device_name)
    seqs = default_seqs if max_num_seqs is None else max_num_seqs
    if max_model_len is None:
        max_model_len = model_max_len
    elif max_model_len > model_max_len:
        raise ValueError(f"max_model_len={max_model_len} is longer than the model's "
                         f"max_position_embeddings={model_max_len} ({model_name})")
    batched = max_num_batched_tokens
    if batched is None:
        batched = max(default_batched, seqs)
        if not enable_chunked_prefill:
            batched = max(batched, max_model_len)
    return SchedulerConfig(
        max_num_batched_tokens=batched, max_num_seqs=seqs, max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,  # type: ignore[arg-type]  # a str: SchedulerConfig checks the value
    )
