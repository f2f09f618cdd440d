"""Write the step's new K/V rows into their cache slots.

    key, value      [num_tokens, num_kv_heads, head_dim]
    key_cache       [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache alike)
    slot_mapping    [num_tokens] int64: slot = block_id * block_size + offset in the block

`reshape_and_cache_ref` is the torch reference; `reshape_and_cache` is the Triton kernel with
the same signature. Both write in place.

In this file you will find:
  * `_reshape_and_cache_kernel`: one program per token copies that token's K and V rows
    (all KV heads) to its slot; slot offsets are computed in int64 so a pool larger than
    2^31 elements per layer is addressed correctly;
  * `reshape_and_cache`: the thin wrapper that checks dtypes, shapes and strides and launches it.
A negative slot (padding) is skipped by the kernel (the reference would index from the end, so
callers must not pass negative slots to the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k[slot_mapping.long()] = key.to(key_cache.dtype)
    flat_v[slot_mapping.long()] = value.to(value_cache.dtype)


# %%
# Kernel
# ------
# The cache is contiguous, so a slot's rows (num_kv_heads x head_dim elements) are one
# contiguous run starting at `slot * num_kv_heads * head_dim`. The new K/V may be strided views
# (e.g. slices of a fused QKV projection): token and head strides are passed, the last
# dimension must be contiguous.


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], strides (stride_kt, stride_kh, 1)
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], strides (stride_vt, stride_vh, 1)
    key_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim], contiguous
    value_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim], contiguous
    slot_mapping_ptr,  # [num_tokens] int64 slot ids, contiguous
    stride_kt,  # key stride over tokens (elements)
    stride_kh,  # key stride over heads (elements)
    stride_vt,  # value stride over tokens (elements)
    stride_vh,  # value stride over heads (elements)
    NUM_KV_HEADS: tl.constexpr,  # number of KV heads
    HEADS_PADDED: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HEAD_DIM: tl.constexpr,  # head dimension (a power of two)
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < NUM_KV_HEADS
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    # int64: slot * row_elems overflows int32 once the pool exceeds 2^31 elements.
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


# %%
# Wrapper
# -------


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key[i], value[i] ([num_kv_heads, head_dim] each) to slot slot_mapping[i] of the
    caches, in place; negative slots are skipped. Key/value are cast to the cache dtype."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert key_cache.dim() == 4 and key_cache.shape[2:] == (num_kv_heads, head_dim)
    assert value_cache.shape == key_cache.shape and value_cache.dtype == key_cache.dtype
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.is_contiguous()
    assert slot_mapping.dtype in (torch.int64, torch.int32), slot_mapping.dtype
    assert head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} is not a power of two"
    assert key.device == value.device == key_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
    )
