"""Paged attention over a block-table KV cache, for mixed prefill + decode batches.

Layout (one layer):
    query           [num_tokens, num_q_heads, head_dim]   the step's new tokens, request by
                                                          request (query_start_loc offsets)
    key_cache       [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables    [num_seqs, max_blocks_per_seq] int32  block ids; entries past a sequence's
                                                          blocks are ignored
    seq_lens        [num_seqs] int32                      KV length after this step's tokens
                                                          are written (context + new tokens)
    query_start_loc [num_seqs + 1] int32                  query rows of sequence s are
                                                          [query_start_loc[s], query_start_loc[s+1])
Query row i of sequence s (q_len rows) sits at position p = seq_len - q_len + i and attends
causally to keys [0, p]. GQA: query head h reads KV head h // (num_q_heads // num_kv_heads).
The new tokens' K/V must already be in the cache (`reshape_and_cache`).

`paged_attention_ref` is the torch reference (fp32 accumulation); the Triton kernel, when
present, has the same signature.
"""

from __future__ import annotations

import torch


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Returns the attention output, [num_tokens, num_q_heads, head_dim], query's dtype."""
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[s, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_q_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [q_len, num_q_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(seq_len - q_len, seq_len, device=query.device)
        keys = torch.arange(seq_len, device=query.device)
        mask = keys[None, :] > positions[:, None]  # [q_len, seq_len]: future keys
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
