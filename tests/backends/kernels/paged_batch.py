"""Paged-attention inputs for the kernel tests: a poisoned pool with shuffled block ids.

Every pool is filled with `poison` (NaN by default) before the sequences' K/V are written, and
block-table entries past a sequence's blocks point at an unwritten block (or at
`padding_block`, e.g. an id past the pool), so any read outside [0, seq_len) shows in the
output. Layouts are those of `backends.kernels.paged_attention`.
"""

from __future__ import annotations

import math

import torch

from backends.kernels.paged_attention_torch import PagedAttentionInputs
from backends.kernels.reshape_and_cache import reshape_and_cache_ref

Batch = PagedAttentionInputs  # the inputs of one paged_attention call


def make_batch(
    seqs: list[tuple[int, int]],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    poison: float = math.nan,
    padding_block: int | None = None,
    device: str = "cpu",
) -> Batch:
    """A batch of sequences given as (context_len, q_len) over a `poison`-filled pool whose
    blocks are handed out in shuffled order; each sequence's K/V (context + new tokens)
    written to its slots; block-table padding = `padding_block`, default an unwritten block
    of the pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(ctx + q) // block_size) for ctx, q in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, poison, dtype=dtype)
    value_cache = torch.full(shape, poison, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen)
    padding = int(order[-1]) if padding_block is None else padding_block
    table = torch.full((len(seqs), max(blocks_per_seq) + 2), padding, dtype=torch.int32)
    used = 0
    for s, ((ctx, q), n) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        table[s, :n] = order[used:used + n]
        used += n
        positions = torch.arange(ctx + q)
        slots = table[s, positions // block_size].long() * block_size + positions % block_size
        kv_shape = (ctx + q, num_kv_heads, head_dim)
        reshape_and_cache_ref(torch.randn(kv_shape, generator=gen),
                              torch.randn(kv_shape, generator=gen),
                              key_cache, value_cache, slots)
    q_lens = [q for _, q in seqs]
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([ctx + q for ctx, q in seqs], dtype=torch.int32)
    return Batch(*(t.to(device) for t in (query, key_cache, value_cache, table, seq_lens,
                                          starts)))
