"""Attention-kernel dispatch: the Triton kernels on CUDA when they exist, the batched torch
path otherwise (CPU, or before the kernels land).

Both ops have the signatures of `backends.kernels.paged_attention` and
`backends.kernels.reshape_and_cache` (layouts in those modules' docstrings). The per-sequence
torch references stay available as `REFERENCE_OPS` (tests compare against them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
