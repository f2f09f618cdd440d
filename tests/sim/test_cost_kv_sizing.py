"""KV-pool sizing after weights, and vLLM's two start-up lines."""

from __future__ import annotations

import math

import pytest

from sim.cost.kv_cache_sizing import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    kv_cache_sizing,
    startup_lines,
)
from sim.hardware import resolve_gpu
from sim.model_presets import resolve_model

LLAMA_8B = resolve_model("llama-3.1-8b")
LLAMA_70B = resolve_model("llama-3.1-70b")
H200 = resolve_gpu("h200")


def test_llama_8b_on_h200_by_hand() -> None:
    total = 150_119_844_413  # 139.81 GiB, what vLLM reports for an H200
    requested = math.ceil(total * 0.92)
    weights = 2 * 8_030_261_248
    reserve = 1_610_612_736  # 1.5 GiB
    kv_bytes = requested - weights - reserve
    blocks = kv_bytes // (16 * 131_072)
    sizing = kv_cache_sizing(LLAMA_8B, H200)
    assert DEFAULT_ACTIVATION_RESERVE_BYTES == reserve
    assert (sizing.requested_memory_bytes, sizing.weight_bytes_per_gpu) == (requested, weights)
    assert sizing.kv_cache_bytes == kv_bytes
    assert sizing.num_gpu_blocks == blocks == 57_429
    assert sizing.num_tokens == 918_864
    assert kv_cache_sizing(LLAMA_8B, H200).num_gpu_blocks == blocks


def test_startup_lines_for_llama_8b_on_h200() -> None:
    assert kv_cache_sizing(LLAMA_8B, H200).startup_lines(8192) == [
        "GPU KV cache size: 918,864 tokens",
        "Maximum concurrency for 8,192 tokens per request: 112.17x",
    ]


def test_startup_lines_format_exactly() -> None:
    # Concurrency is blocks / cdiv(max_model_len, block_size): 1000 tokens need 63 blocks.
    assert startup_lines(1000, 16, 1000) == [
        "GPU KV cache size: 16,000 tokens",
        "Maximum concurrency for 1,000 tokens per request: 15.87x",
    ]
    assert startup_lines(3, 16, 131072) == [
        "GPU KV cache size: 48 tokens",
        "Maximum concurrency for 131,072 tokens per request: 0.00x",
    ]
    with pytest.raises(ValueError, match="max_model_len .* got 0"):
        startup_lines(10, 16, 0)


def test_parameters_change_the_pool_as_vllm_would() -> None:
    base = kv_cache_sizing(LLAMA_8B, H200)
    lower = kv_cache_sizing(LLAMA_8B, H200, gpu_memory_utilization=0.5)
    assert lower.num_gpu_blocks < base.num_gpu_blocks
    bigger_blocks = kv_cache_sizing(LLAMA_8B, H200, block_size=32)
    assert bigger_blocks.num_gpu_blocks == base.kv_cache_bytes // (32 * 131_072)
    no_reserve = kv_cache_sizing(LLAMA_8B, H200, activation_reserve_bytes=0)
    assert no_reserve.kv_cache_bytes == base.kv_cache_bytes + DEFAULT_ACTIVATION_RESERVE_BYTES


def test_tensor_parallel_70b_on_h100() -> None:
    h100 = resolve_gpu("h100-sxm")
    sizing = kv_cache_sizing(LLAMA_70B, h100, tensor_parallel_size=8)
    weights = -(-2 * 70_553_706_496 // 8)
    requested = math.ceil(84_986_665_370 * 0.92)
    assert sizing.weight_bytes_per_gpu == weights
    assert sizing.kv_bytes_per_token_per_gpu == 40_960
    assert sizing.num_gpu_blocks == (requested - weights - 1_610_612_736) // (16 * 40_960)


def test_weights_that_do_not_fit_are_reported() -> None:
    with pytest.raises(ValueError) as info:
        kv_cache_sizing(LLAMA_70B, H200)
    text = str(info.value)
    assert "\n" not in text
    for part in ("Llama-3.1-70B", "H200", "tensor_parallel_size=1", "141,107,412,992 B"):
        assert part in text
    assert kv_cache_sizing(LLAMA_70B, H200, tensor_parallel_size=2).num_gpu_blocks > 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization .* got 1.2"):
        kv_cache_sizing(LLAMA_8B, H200, gpu_memory_utilization=1.2)
    with pytest.raises(ValueError, match="block_size .* got 0"):
        kv_cache_sizing(LLAMA_8B, H200, block_size=0)
