"""The inputs of the attention benchmarks: the heads and cache geometry of a case
(`AttentionShape`), a random paged batch (`make_paged_batch`, blocks handed out in a shuffled
order), and what a launch must move and compute (`decode_bytes`, `attention_flops`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from backends.kernels.paged_attention_torch import PagedAttentionInputs

Report = dict[str, Any]
Seqs = tuple[tuple[int, int], ...]  # (context_len, q_len) per sequence


@dataclass(frozen=True)
class AttentionShape:
    """Heads and cache geometry of one benchmark case."""

    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def to_json(self) -> Report:
        return {"num_q_heads": self.num_q_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "block_size": self.block_size,
                "dtype": str(self.dtype).removeprefix("torch.")}


LLAMA_8B = AttentionShape()


@dataclass
class PagedBatch(PagedAttentionInputs):
    """paged_attention inputs and the (context_len, q_len) of each sequence."""

    seqs: Seqs

    @property
    def scale(self) -> float:
        scale: float = float(self.query.shape[-1]) ** -0.5  # float ** float is typed Any
        return scale

    def kv_bytes(self) -> int:
        """K and V bytes the attention must read: every key of every sequence, every KV head."""
        _, _, num_kv_heads, head_dim = self.key_cache.shape
        tokens = sum(ctx + q for ctx, q in self.seqs)
        return 2 * tokens * num_kv_heads * head_dim * self.key_cache.element_size()


def make_paged_batch(seqs: Seqs, shape: AttentionShape, seed: int = 0,
                     nan_tails: bool = False, device: str | torch.device = "cuda") -> PagedBatch:
    """A random pool whose blocks are handed out in a shuffled order (no repeats), one block
    table row per sequence, random queries. `nan_tails` writes NaN into each last block's
    slots past seq_len (a correct kernel never reads them)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = shape.block_size
    blocks = [-(-(ctx + q) // bs) for ctx, q in seqs]
    num_blocks = sum(blocks)
    pool = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(pool, dtype=shape.dtype, device=device, generator=gen)
    value_cache = torch.randn(pool, dtype=shape.dtype, device=device, generator=gen)
    order = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    table = torch.zeros((len(seqs), max(blocks)), dtype=torch.int32, device=device)
    used = 0
    for s, ((ctx, q), n) in enumerate(zip(seqs, blocks, strict=True)):
        table[s, :n] = order[used:used + n]
        used += n
        tail = (ctx + q) % bs
        if nan_tails and tail:
            last = int(table[s, n - 1])
            key_cache[last, tail:] = math.nan
            value_cache[last, tail:] = math.nan
    q_lens = [q for _, q in seqs]
    query = torch.randn((sum(q_lens), shape.num_q_heads, shape.head_dim), dtype=shape.dtype,
                        device=device, generator=gen)
    starts = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([ctx + q for ctx, q in seqs], dtype=torch.int32, device=device)
    return PagedBatch(query, key_cache, value_cache, table, seq_lens, starts, tuple(seqs))


# %%
# Bytes and FLOPs


def decode_bytes(batch: PagedBatch, num_segments: int) -> int:
    """Bytes a decode launch must move: K/V of every context token, Q and O, the block-table
    entries, and (split-KV) the fp32 partials written and read back."""
    num_tokens, num_q_heads, head_dim = batch.query.shape
    block_size = batch.key_cache.shape[1]
    q_and_o = 2 * batch.query.numel() * batch.query.element_size()
    table = 4 * sum(-(-(ctx + q) // block_size) for ctx, q in batch.seqs)
    partials = 0 if num_segments == 1 else (
        2 * num_tokens * num_q_heads * num_segments * (head_dim + 2) * 4)
    return batch.kv_bytes() + q_and_o + table + partials


def attention_flops(seqs: Seqs, shape: AttentionShape) -> float:
    """Causal matmul FLOPs (QK^T and PV): 4 Hq D (q c + q^2 / 2) per sequence, the
    convention of FlashAttention and the Triton tutorial."""
    return sum(4 * shape.num_q_heads * shape.head_dim * (q * ctx + q * q / 2)
               for ctx, q in seqs)
