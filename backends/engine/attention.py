"""Attention-kernel dispatch: the Triton kernels on CUDA when they exist, the batched torch
path otherwise (CPU, or before the kernels land).

Both ops have the signatures of `backends.kernels.paged_attention` and
`backends.kernels.reshape_and_cache` (layouts in those modules' docstrings). The per-sequence
torch references stay available as `REFERENCE_OPS` (tests compare against them).
`warm_up_attention` compiles the Triton kernels' variants once per process, at engine start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from backends.kernels.paged_attention_torch import paged_attention_ref, paged_attention_torch
from backends.kernels.reshape_and_cache import reshape_and_cache_ref

PagedAttention = Callable[..., torch.Tensor]
ReshapeAndCache = Callable[..., None]


@dataclass(frozen=True, slots=True)
class AttentionOps:
    """The two ops one forward pass needs, and which implementation they are."""

    paged_attention: PagedAttention
    reshape_and_cache: ReshapeAndCache
    kind: str  # "triton", "torch" (batched) or "torch-reference" (per-sequence loop)


def _triton_ops() -> AttentionOps | None:
    """The Triton kernels, or None while `backends/kernels/` has only the references."""
    try:
        from backends.kernels import paged_attention as pa
        from backends.kernels import reshape_and_cache as rc
    except ImportError:  # pragma: no cover - the reference modules always import
        return None
    attention = getattr(pa, "paged_attention", None)
    cache = getattr(rc, "reshape_and_cache", None)
    if attention is None or cache is None:
        return None
    return AttentionOps(attention, cache, "triton")


REFERENCE_OPS = AttentionOps(paged_attention_ref, reshape_and_cache_ref, "torch-reference")
TORCH_OPS = AttentionOps(paged_attention_torch, reshape_and_cache_ref, "torch")


def select_ops(device: torch.device, use_triton: bool | None = None) -> AttentionOps:
    """Triton on CUDA when available (or when `use_triton` forces it), the batched torch path
    otherwise. `use_triton=True` without the kernels raises ValueError."""
    want = device.type == "cuda" if use_triton is None else use_triton
    if not want:
        return TORCH_OPS
    ops = _triton_ops()
    if ops is None:
        if use_triton:
            raise ValueError("the Triton kernels are not available in backends/kernels/")
        return TORCH_OPS
    return ops


@dataclass(frozen=True, slots=True)
class KernelWarmup:
    """What `warm_up_attention` did (run.json's `kernel_warmup`)."""

    seconds: float  # wall time of the launches, compiles included (0 when already warm)
    variants: tuple[str, ...]  # the attention variants, "<block_m>x<tile_n>/<segments>"
    already_warm: bool  # an engine of the same shapes warmed this process's kernels before

    def describe(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "variants": list(self.variants),
                "already_warm": self.already_warm}


# The warm-ups this process has done: Triton keeps compiled variants per process (and on
# disk), so a second engine of the same shapes finds them compiled.
_WARMED: set[tuple[object, ...]] = set()


def warm_up_attention(ops: AttentionOps, key_cache: torch.Tensor, num_q_heads: int,
                      max_kv_len: int, scale: float) -> KernelWarmup | None:
    """With the Triton ops, compile every kernel variant an engine over caches like
    `key_cache` (one layer's, [num_blocks, block_size, num_kv_heads, head_dim]) can launch
    for block tables of up to `max_kv_len` tokens (`backends.kernels.warmup`), before its
    first step; None with the torch ops (nothing to compile)."""
    if ops.kind != "triton":
        return None
    from backends.kernels.warmup import warm_up_kernels

    key = (str(key_cache.device), key_cache.dtype, tuple(key_cache.shape[1:]),
           key_cache.stride(), num_q_heads, max_kv_len)
    if key in _WARMED:
        return KernelWarmup(0.0, (), True)
    started = time.perf_counter()
    variants = warm_up_kernels(key_cache, num_q_heads, max_kv_len, scale)
    seconds = time.perf_counter() - started  # warm_up_kernels synchronises a CUDA device
    _WARMED.add(key)
    names = tuple(f"{v.config.block_m}x{v.config.tile_n}/{v.num_segments}" for v in variants)
    return KernelWarmup(seconds, names, False)
