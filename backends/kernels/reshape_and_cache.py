"""Write the step's new K/V rows into their cache slots.

    key, value      [num_tokens, num_kv_heads, head_dim]
    key_cache       [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache alike)
    slot_mapping    [num_tokens] int64: slot = block_id * block_size + offset in the block

`reshape_and_cache_ref` is the torch reference; the Triton kernel, when present, has the same
signature. Both write in place.
"""

from __future__ import annotations

import torch


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
