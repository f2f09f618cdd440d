"""Compile, before an engine's first step, every Triton kernel variant its steps can launch.

Triton compiles a kernel the first time it is launched with a new set of constexprs and
specialised arguments: on an H200 that cost 0.5-3 s per variant, inside the timed steps of
the first replay of a run. `warm_up_kernels` launches each variant once at start instead:
`reshape_and_cache` (one variant), the attention kernel for every `KernelVariant` that
`kernel_variants` lists for the engine's shapes, and so the reduce kernel for every segment
count above 1.

The launches run on scratch tensors with the real cache's dtype, device, head counts,
head_dim, block size and strides (a cache of `SCRATCH_BLOCKS` blocks has the strides of one
of N blocks: only dimension 0 differs), and queries laid out as the model lays them out
(contiguous [T, H, D]), so every specialised argument matches a real step's. The arguments
that vary between steps (`num_seqs`, the block table's width) are not specialised
(`_attention_kernel`'s `do_not_specialize`), so the tiny scratch batches hit the same
compiled variants as real ones. (`_reshape_and_cache_kernel` needs no such list: its only
int arguments are the new K/V rows' strides, fixed by the model; the token count is its
grid.) The real KV cache is only read for its shape, dtype and
strides; nothing of it (or of the prefix cache) is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.kernels.paged_attention import (
    KernelConfig,
    choose_config,
    choose_num_segments,
    device_sm_count,
    paged_attention,
)
from backends.kernels.reshape_and_cache import reshape_and_cache


@dataclass(frozen=True)
class KernelVariant:
    """One compiled variant of a paged-attention launch: the tiles (decode or prefill
    `KernelConfig`) and the split-KV segment count, the constexprs that change between the
    launches of one engine (the rest are fixed by the model and the cache). NUM_SEGMENTS > 1
    also launches `_reduce_segments_kernel` with that count."""

    config: KernelConfig
    num_segments: int  # a power of two; 1 = no split

    def __post_init__(self) -> None:
        if self.num_segments < 1 or self.num_segments & (self.num_segments - 1):
            raise ValueError(f"num_segments must be a power of two >= 1, got "
                             f"{self.num_segments}")


def choose_variant(num_tokens: int, num_seqs: int, group: int, num_kv_heads: int,
                   max_kv_len: int, sm_count: int) -> KernelVariant:
    """What `paged_attention` launches for a batch of these shapes (`max_kv_len`: the block
    table's width x block size, tokens): the same two choices it makes per launch."""
    return KernelVariant(
        choose_config(num_tokens, num_seqs, group),
        choose_num_segments(num_tokens, num_seqs, num_kv_heads, max_kv_len, sm_count))


def kernel_variants(group: int, num_kv_heads: int, max_kv_len: int,
                    sm_count: int) -> tuple[KernelVariant, ...]:
    """Every variant `choose_variant` can return on a device of `sm_count` SMs for batches
    whose block tables span at most `max_kv_len` tokens: prefill (never split), then decode
    with 1, 2, 4, ... segments up to the most it can split into.

    The decode count is min(wanted, cap, MAX_SEGMENTS), all powers of two; `wanted` is
    largest for one sequence and `cap` for the longest table, so their choice is the most,
    and every smaller power of two p is reached by one sequence with a table of
    p * MIN_TOKENS_PER_SEGMENT keys.
    """
    prefill = KernelVariant(choose_config(2, 1, group), 1)
    most = choose_num_segments(1, 1, num_kv_heads, max_kv_len, sm_count)
    decode = choose_config(1, 1, group)
    return (prefill, *(KernelVariant(decode, 1 << i) for i in range(most.bit_length())))


SCRATCH_BLOCKS = 2  # blocks of the scratch cache
_SCRATCH_TOKENS = 2  # K/V rows written to the scratch cache (slots 0 and 1)


def warm_up_kernels(key_cache: torch.Tensor, num_q_heads: int, max_kv_len: int,
                    scale: float, sm_count: int | None = None) -> tuple[KernelVariant, ...]:
    """Launch each kernel variant an engine over caches like `key_cache` ([num_blocks,
    block_size, num_kv_heads, head_dim], one layer's) can use, once; returns the attention
    variants launched. `max_kv_len`: the most keys a sequence's block table can span
    (tokens); `sm_count`: the device's SMs (default: read from `key_cache`'s device)."""
    num_kv_heads = key_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads must be a multiple of num_kv_heads ({num_kv_heads}), "
                         f"got {num_q_heads}")
    sms = device_sm_count(key_cache.device) if sm_count is None else sm_count
    variants = kernel_variants(num_q_heads // num_kv_heads, num_kv_heads, max_kv_len, sms)
    scratch_k, scratch_v = _scratch_cache(key_cache)
    query, block_tables, seq_lens, query_start_loc = _scratch_batch(num_q_heads, key_cache)
    for variant in variants:
        paged_attention(query, scratch_k, scratch_v, block_tables, seq_lens, query_start_loc,
                        scale, num_segments=variant.num_segments, config=variant.config)
    if key_cache.device.type == "cuda":
        torch.cuda.synchronize(key_cache.device)
    return variants


def _scratch_cache(key_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches of SCRATCH_BLOCKS blocks with `key_cache`'s strides, dtype and device,
    their first _SCRATCH_TOKENS slots written by `reshape_and_cache` (its one variant)."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    shape = (SCRATCH_BLOCKS, block_size, num_kv_heads, head_dim)
    caches = tuple(torch.zeros(shape, dtype=key_cache.dtype, device=key_cache.device)
                   for _ in range(2))
    if caches[0].stride() != key_cache.stride():
        raise ValueError(f"the KV cache must be contiguous, got strides {key_cache.stride()} "
                         f"for shape {tuple(key_cache.shape)}")
    # The model's new K/V rows: [T, num_kv_heads, head_dim] contiguous, the cache's dtype;
    # the slot mapping int64 (the runner's).
    rows = torch.ones((_SCRATCH_TOKENS, num_kv_heads, head_dim), dtype=key_cache.dtype,
                      device=key_cache.device)
    slots = torch.arange(_SCRATCH_TOKENS, dtype=torch.int64, device=key_cache.device)
    reshape_and_cache(rows, rows.clone(), caches[0], caches[1], slots)
    return caches[0], caches[1]


def _scratch_batch(num_q_heads: int, key_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(query, block_tables, seq_lens, query_start_loc): two sequences of one new token each
    over the scratch cache's written slots (KV lengths 1 and 2; both tables [0, 1], block 1
    only read when a block holds one slot), the query [2, num_q_heads, head_dim] contiguous
    in the cache's dtype. Every variant runs on it: the launch forces the variant's tiles and
    segment count, so only the layouts must be a real step's."""
    device = key_cache.device
    query = torch.ones((_SCRATCH_TOKENS, num_q_heads, key_cache.shape[3]),
                       dtype=key_cache.dtype, device=device)
    block_tables = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([1, 2], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    return query, block_tables, seq_lens, query_start_loc
