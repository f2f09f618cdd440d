"""vLLM's two start-up lines that report the KV pool, for every driver (the simulator sizes
the pool from the GPU, the real engine from its device; both print the same lines)."""

from __future__ import annotations


def startup_lines(num_gpu_blocks: int, block_size: int, max_model_len: int) -> list[str]:
    """vLLM's two start-up lines, character for character (vllm/v1/core/kv_cache_utils.py,
    `_report_kv_cache_config`): the pool in tokens (num_blocks · block_size) and the number
    of max_model_len requests it holds, num_blocks / cdiv(max_model_len, block_size); both
    counts with thousands separators, the ratio to two decimals. ValueError on a count
    below its minimum (blocks 0, block size and length 1)."""
    check_int("num_gpu_blocks", num_gpu_blocks, 0)
    check_int("block_size", block_size, 1)
    check_int("max_model_len", max_model_len, 1)
    num_tokens = num_gpu_blocks * block_size
    max_concurrency = num_gpu_blocks / -(-max_model_len // block_size)
    return [
        f"GPU KV cache size: {num_tokens:,} tokens",
        f"Maximum concurrency for {max_model_len:,} tokens per request: {max_concurrency:.2f}x",
    ]


def check_int(name: str, value: object, minimum: int) -> int:
    """`value` if it is an int (not a bool) >= `minimum`; else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
