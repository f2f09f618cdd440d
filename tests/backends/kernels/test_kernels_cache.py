"""The reshape_and_cache Triton kernel against its torch reference.

Without CUDA these run under TRITON_INTERPRET=1 (tests/conftest.py sets it before this module
imports the kernels), in fp32/fp16 only: the interpreter's bf16 `tl.dot` is wrong. Shapes are
kept tiny because every program iteration costs milliseconds in the interpreter. GPU-only
variants (bf16, bigger shapes) carry `@pytest.mark.gpu`.
"""

from __future__ import annotations

import math

import pytest
import torch

from backends.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
          dtype: torch.dtype, fill: float = math.nan) -> torch.Tensor:
    """A KV pool [num_blocks, block_size, num_kv_heads, head_dim] filled with `fill` (NaN by
    default, so that any read of an unwritten slot shows in the output)."""
    return torch.full((num_blocks, block_size, num_kv_heads, head_dim), fill,
                      dtype=dtype, device=DEVICE)


# %%
# reshape_and_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 32), (2, 64), (3, 128)])
def test_reshape_and_cache_writes_exactly_the_given_slots(
    dtype: torch.dtype, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_tokens = 7, 8, 13
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    k_cache = _pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, fill=-7.0)
    v_cache = _pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, fill=-7.0)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    flat = k_cache.view(-1, num_kv_heads, head_dim)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert bool((flat[untouched] == -7.0).all())
    assert torch.equal(flat[slots], key)


def test_reshape_and_cache_strided_input_and_padding_slots() -> None:
    """K/V as slices of a fused QKV tensor (token stride > row size); slot -1 is skipped."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim = 5, 2, 32
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(DEVICE)
    key, value = qkv[:, num_kv_heads:2 * num_kv_heads], qkv[:, 2 * num_kv_heads:]
    assert not key.is_contiguous()
    k_cache = _pool(4, 4, num_kv_heads, head_dim, torch.float32, fill=0.0)
    v_cache = _pool(4, 4, num_kv_heads, head_dim, torch.float32, fill=0.0)
    slots = torch.tensor([15, 0, -1, 6, 9], device=DEVICE)
    reshape_and_cache(key, value, k_cache, v_cache, slots)

    keep = slots >= 0
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reshape_and_cache_ref(key[keep], value[keep], k_ref, v_ref, slots[keep])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_reshape_and_cache_casts_to_the_cache_dtype() -> None:
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(3, 1, 32, generator=gen).to(DEVICE)
    value = torch.randn(3, 1, 32, generator=gen).to(DEVICE)
    k_cache = _pool(2, 4, 1, 32, torch.float16, fill=0.0)
    v_cache = _pool(2, 4, 1, 32, torch.float16, fill=0.0)
    slots = torch.tensor([1, 4, 7], device=DEVICE)
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 1, 32)[slots], key.half())
    assert torch.equal(v_cache.view(-1, 1, 32)[slots], value.half())
