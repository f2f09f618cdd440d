"""Paged attention in torch: the per-sequence reference and the CPU engine's batched path.

`paged_attention_ref` loops over sequences in fp32: the reference the Triton kernel
(`backends.kernels.paged_attention`, whose docstring gives the semantics) and the batched
path are tested against. `paged_attention_torch` has the same signature, layouts and
semantics:
    query           [num_tokens, num_q_heads, head_dim]
    key_cache       [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache the same)
    block_tables    [num_seqs, max_blocks_per_seq] int32  entries past a sequence's blocks
                                                          are ignored (never dereferenced)
    seq_lens        [num_seqs] int32    KV length after this step's tokens are written
    query_start_loc [num_seqs + 1] int32
    returns         [num_tokens, num_q_heads, head_dim], query's dtype

The reference loops over sequences (~14 ops each, per layer). Here every decode (q_len 1) of
the batch is one batched computation: each sequence's K/V are gathered slot by slot through
its block table into [B, num_kv_heads, L, head_dim], L = the longest decode's seq_len, and a
length mask hides keys >= seq_len. Padding positions re-read the sequence's last written slot,
so padding is finite (unwritten slots may hold NaN, and 0 * NaN = NaN in P @ V). Prefill
chunks (q_len > 1, few per step) are computed one sequence at a time, causally. Sequences with
q_len 0 produce no rows. Scores, softmax and P @ V are fp32.

GQA without copying K/V per query head: query heads are viewed as [num_kv_heads, group]
(query head h = kv_head * group + g, as `h // group` in the reference), so one matmul per
(sequence, KV head) covers the group's heads.

The host reads seq_lens and query_start_loc once per call (`tolist`): cheap on the CPU, where
this path runs; CUDA uses the Triton kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedAttentionInputs:
    """The tensors of one paged-attention call (every implementation's signature, less
    `scale`); shapes in the module docstring."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor, torch.Tensor]:
        """The six tensors in the implementations' positional order (the fixed length lets
        `fn(*batch.args(), scale)` be checked against their signatures)."""
        return (self.query, self.key_cache, self.value_cache, self.block_tables,
                self.seq_lens, self.query_start_loc)


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


def paged_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Returns the attention output, [num_tokens, num_q_heads, head_dim], query's dtype."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[s + 1] - starts[s] for s in range(len(lens))]
    decodes = [s for s, n in enumerate(q_lens) if n == 1]
    if decodes:
        rows = torch.tensor([starts[s] for s in decodes], device=query.device)
        seqs = torch.tensor(decodes, device=query.device)
        max_len = max(lens[s] for s in decodes)
        out[rows] = _decode_batch(query[rows], key_cache, value_cache, block_tables[seqs],
                                  seq_lens[seqs], max_len, scale).to(query.dtype)
    for s, q_len in enumerate(q_lens):
        if q_len > 1:
            start, end = starts[s], starts[s + 1]
            out[start:end] = _prefill_one(query[start:end], key_cache, value_cache,
                                          block_tables[s], seq_lens[s:s + 1],
                                          scale).to(query.dtype)
    return out


def _decode_batch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """B decodes at once. query [B, H, D] (the token at position seq_len - 1), block_tables
    [B, >= cdiv(max_len, block_size)], seq_lens [B] in [1, max_len]. Returns [B, H, D] fp32."""
    slots = _slots(block_tables, seq_lens, max_len, key_cache.shape[1])  # [B, L]
    key, value = _gather(key_cache, slots), _gather(value_cache, slots)  # [B, KVH, L, D]
    positions = torch.arange(max_len, device=query.device)
    hidden = positions[None, :] >= seq_lens[:, None]  # [B, L]: keys past the sequence
    return _attend(query[:, None], key, value, hidden[:, None, :], scale)[:, 0]


def _prefill_one(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One prefill chunk: query [Q, H, D] at positions [seq_len - Q, seq_len), block_table
    [max_blocks_per_seq], seq_len [1]. Returns [Q, H, D] fp32."""
    q_len = query.shape[0]
    length = int(seq_len)
    slots = _slots(block_table[None], seq_len, length, key_cache.shape[1])  # [1, seq_len]
    key, value = _gather(key_cache, slots), _gather(value_cache, slots)
    positions = torch.arange(length, device=query.device)
    hidden = positions[None, :] > positions[length - q_len:, None]  # [Q, seq_len]: future keys
    return _attend(query[None], key, value, hidden[None], scale)[0]


def _slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, length: int,
           block_size: int) -> torch.Tensor:
    """Cache slot (block * block_size + offset) of positions [0, length) of each sequence,
    [B, length] int64. Positions past a sequence's seq_len (>= 1) read its last written slot,
    so the gathered padding is finite and the table's padding entries are never read."""
    positions = torch.arange(length, device=block_tables.device)
    positions = torch.minimum(positions[None, :], seq_lens[:, None].long() - 1)  # [B, length]
    blocks = block_tables.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, KVH, D], slots [B, L] -> [B, KVH, L, D] fp32.

    Indexes rows of D elements: row slot * KVH + kv_head of the cache seen as [-1, D] (a view
    for the engine's contiguous per-layer caches)."""
    batch, length = slots.shape
    num_kv_heads, head_dim = cache.shape[2:]
    heads = torch.arange(num_kv_heads, device=slots.device)
    rows = slots[:, None, :] * num_kv_heads + heads[None, :, None]  # [B, KVH, L]
    picked = cache.reshape(-1, head_dim).index_select(0, rows.view(-1))
    return picked.view(batch, num_kv_heads, length, head_dim).float()


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked softmax attention, fp32.

    query [B, Q, H, D]; key, value [B, KVH, L, D] fp32 and finite; hidden [B, Q, L] bool,
    True = key not visible to that query row (every row must see at least one key).
    Returns [B, Q, H, D] fp32.
    """
    batch, q_len, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_q_heads // num_kv_heads
    # [B, KVH, Q * G, D]: row r = token r // G, query head kv_head * G + r % G.
    q = (query.float() * scale).view(batch, q_len, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, q_len * group, head_dim)
    scores = q @ key.transpose(2, 3)  # [B, KVH, Q * G, L]
    scores.view(batch, num_kv_heads, q_len, group, -1).masked_fill_(
        hidden[:, None, :, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ value  # [B, KVH, Q * G, D]
    out = out.view(batch, num_kv_heads, q_len, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(batch, q_len, num_q_heads, head_dim)
