"""The paged KV cache: per layer, K and V tensors [num_blocks, block_size, Hkv, D].

Pool size, in blocks: `--num-gpu-blocks-override`, else `--kv-cache-memory` bytes, else (CUDA)
what the device has free after the weights at a utilisation fraction, minus an activation
reserve; on the CPU a fixed default budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GIB = 1 << 30
DEFAULT_CPU_KV_BYTES = 256 << 20  # CPU pool when no size is given


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one block across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block in every layer, bytes."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True, slots=True)
class KVPoolSize:
    """How the pool was sized (for run.json)."""

    num_blocks: int
    source: str  # "override", "kv_cache_memory", "gpu_free_memory" or "cpu_default"
    kv_bytes: int


def size_pool(spec: KVCacheSpec, device: torch.device, num_blocks_override: int | None,
              kv_cache_memory: int | None, gpu_memory_utilization: float,
              activation_reserve: int) -> KVPoolSize:
    """Number of blocks (block 0, the null block, included). ValueError when the memory
    does not hold two blocks."""
    if num_blocks_override is not None:
        if num_blocks_override < 2:
            raise ValueError(f"--num-gpu-blocks-override must be >= 2, got "
                             f"{num_blocks_override}")
        _fits(device, num_blocks_override * spec.bytes_per_block,
              f"--num-gpu-blocks-override {num_blocks_override}")
        return KVPoolSize(num_blocks_override, "override",
                          num_blocks_override * spec.bytes_per_block)
    if kv_cache_memory is not None:
        _fits(device, kv_cache_memory, f"--kv-cache-memory {kv_cache_memory}")
        budget, source = kv_cache_memory, "kv_cache_memory"
    elif device.type == "cuda":
        budget, source = _gpu_budget(device, gpu_memory_utilization, activation_reserve), \
            "gpu_free_memory"
    else:
        budget, source = DEFAULT_CPU_KV_BYTES, "cpu_default"
    num_blocks = budget // spec.bytes_per_block
    if num_blocks < 2:
        raise ValueError(f"KV cache memory of {budget / GIB:.3f} GiB holds {num_blocks} "
                         f"blocks of {spec.bytes_per_block} bytes; at least 2 are needed")
    return KVPoolSize(int(num_blocks), source, int(num_blocks * spec.bytes_per_block))


def _fits(device: torch.device, pool_bytes: int, given: str) -> None:
    """ValueError naming `given` when a pool of `pool_bytes` exceeds the device's memory
    (CUDA: its total; the CPU: physical memory), which no allocation could hold."""
    total = (torch.cuda.mem_get_info(device)[1] if device.type == "cuda"
             else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    if pool_bytes > total:
        raise ValueError(f"{given}: a KV pool of {pool_bytes / GIB:,.1f} GiB is more than "
                         f"the device's {total / GIB:,.1f} GiB")


def _gpu_budget(device: torch.device, utilization: float, reserve: int) -> int:
    """Bytes for the KV pool: total * utilization - what is in use now - reserve."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    free, total = torch.cuda.mem_get_info(device)
    return int(total * utilization) - (total - free) - reserve


class KVCache:
    """Per-layer K and V caches, each [num_blocks, block_size, num_kv_heads, head_dim],
    zero-filled (a slot never written is never read, but zeros keep NaN out)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.key_caches = [torch.zeros(shape, dtype=spec.dtype, device=device)
                           for _ in range(spec.num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=spec.dtype, device=device)
                             for _ in range(spec.num_layers)]
