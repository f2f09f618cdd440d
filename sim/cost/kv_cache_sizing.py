"""The KV pool vLLM would allocate on each GPU (`kv_cache_sizing`), and vLLM's two start-up
lines that report it (`startup_lines`, from `runtime.kv_startup`: the real engine prints them
too). Sizes are in bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.kv_startup import check_int, startup_lines
from sim.cost.base import _check_number
from sim.hardware import GIB, GpuSpec
from sim.model_config import ModelSpec

# Memory vLLM's profiling run finds taken besides weights and KV: the activation peak of a
# max_num_batched_tokens forward pass plus non-torch allocations (NCCL, CUDA context). vLLM
# profiling logs for Llama-3.1-8B bf16 on 80 GB parts print "PyTorch activation peak memory
# takes 1.19GiB" / "1.20GiB" with "non_torch_memory takes 0.11GiB" / "0.12GiB", ~1.31 GiB in
# all; rounded up to 1.5 GiB to leave room for CUDA graph buffers, which newer V1 versions
# also subtract. A constant: larger models and longer batches need a larger value.
DEFAULT_ACTIVATION_RESERVE_BYTES = 3 * GIB // 2
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92  # the stated vLLM default
DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size on CUDA


@dataclass(frozen=True, slots=True)
class KvCacheSizing:
    """The KV pool vLLM would allocate on each GPU, and how it was derived (bytes).

    Attributes:
        num_gpu_blocks: KV blocks per GPU (the engine's num_gpu_blocks).
        block_size: tokens per block.
        requested_memory_bytes: ceil(total visible memory · gpu_memory_utilization).
        weight_bytes_per_gpu: the model's weights / tensor-parallel degree.
        activation_reserve_bytes: activation peak and non-torch memory set aside.
        kv_cache_bytes: what is left for the KV cache.
        kv_bytes_per_token_per_gpu: one token's K and V over all layers on one GPU.
    """

    num_gpu_blocks: int
    block_size: int
    requested_memory_bytes: int
    weight_bytes_per_gpu: int
    activation_reserve_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token_per_gpu: int

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds: num_gpu_blocks · block_size."""
        return self.num_gpu_blocks * self.block_size

    def startup_lines(self, max_model_len: int) -> list[str]:
        """vLLM's two start-up lines for this pool."""
        return startup_lines(self.num_gpu_blocks, self.block_size, max_model_len)


def kv_cache_sizing(
    model: ModelSpec,
    gpu: GpuSpec,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    block_size: int = DEFAULT_BLOCK_SIZE,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> KvCacheSizing:
    """vLLM V1's KV pool per GPU: requested = ceil(total · utilisation) (vllm/v1/worker/
    utils.py); KV memory = requested - weights per GPU - reserve (gpu_worker.py); blocks =
    KV memory // (block_size · KV bytes per token per GPU) (kv_cache_utils.get_num_blocks).
    ValueError when the weights and reserve leave no room for one block."""
    t = check_int("tensor_parallel_size", tensor_parallel_size, 1)
    check_int("block_size", block_size, 1)
    check_int("activation_reserve_bytes", activation_reserve_bytes, 0)
    utilization = gpu_memory_utilization
    _check_number("kv_cache_sizing", "gpu_memory_utilization", utilization, positive=True)
    if utilization > 1:
        raise ValueError(f"gpu_memory_utilization must be at most 1, got {utilization!r}")
    kv_per_token = model.kv_bytes_per_token_per_gpu(t)
    requested = math.ceil(gpu.total_memory_bytes * utilization)
    weights = -(-model.weight_bytes // t)
    available = requested - weights - activation_reserve_bytes
    block_bytes = block_size * kv_per_token
    if available < block_bytes:
        raise ValueError(
            f"{model.name} does not fit on {gpu.name} at tensor_parallel_size={t}: weights "
            f"{weights:,} B per GPU + reserve {activation_reserve_bytes:,} B leave "
            f"{available:,} B of {requested:,} B ({utilization} x {gpu.total_memory_bytes:,} B), "
            f"less than one KV block of {block_bytes:,} B"
        )
    return KvCacheSizing(
        num_gpu_blocks=available // block_bytes,
        block_size=block_size,
        requested_memory_bytes=requested,
        weight_bytes_per_gpu=weights,
        activation_reserve_bytes=activation_reserve_bytes,
        kv_cache_bytes=available,
        kv_bytes_per_token_per_gpu=kv_per_token,
    )
