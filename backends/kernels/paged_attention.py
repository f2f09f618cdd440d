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

`paged_attention` is the Triton kernel; `paged_attention_torch.py` holds the torch versions
with the same signature: `paged_attention_ref`, the per-sequence reference (fp32
accumulation), and the batched CPU engine path.

In this file you will find:
  * `_attention_kernel`: one program per (query block, KV head[, KV segment]). A query block
    holds BLOCK_Q tokens of one sequence times the GROUP query heads that share the KV head,
    stacked as the BLOCK_M rows of `tl.dot` (row r = token r // GROUP, head r % GROUP), so K/V
    are read once per group and a decode (one token) still feeds `tl.dot` M >= 16 rows
    (padding rows masked). It walks the
    keys in tiles of TILE_N positions, gathering each position's physical block from the block
    table (int64 addresses), with an fp32 online softmax in log2 units. Prefill chunks and
    decodes share it: key k is visible to a row at position p iff k <= p < seq_len.
  * `_reduce_segments_kernel`: the split-KV path's second pass. With NUM_SEGMENTS > 1 each
    program covers one slice of the keys and writes fp32 partials (unnormalised output, max,
    sum); this kernel rescales and sums them per (token, query head).
  * `paged_attention`: the wrapper. It checks layouts, picks a launch configuration (decode
    batches and prefill batches get different tiles) and turns split-KV on when a decode grid
    is too small to fill the device; `backends.kernels.warmup` lists every choice it can make
    for one engine's shapes (`kernel_variants`) and compiles them at start.
The grid is an upper bound computed from shapes only (num_tokens // BLOCK_Q + num_seqs query
blocks, as in vLLM's unified kernel), so the host never reads query lengths from the device;
a program finds its sequence by binary search over query_start_loc and exits if it has no rows.
Off CUDA the kernels only run under TRITON_INTERPRET=1 (tests); there bf16 dots are computed in
fp32 (the interpreter's bf16 `tl.dot` is wrong).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# %%
# Kernels
# -------


@triton.jit
def _find_sequence(
    query_start_loc_ptr,  # [num_seqs + 1] int32, contiguous
    num_seqs,  # number of sequences
    q_block,  # this program's query-block index in the upper-bound grid
    BLOCK_Q: tl.constexpr,  # query tokens per block
):
    """Sequence s owns query blocks [start(s), start(s + 1)) with
    start(s) = query_start_loc[s] // BLOCK_Q + s: at least cdiv(q_len, BLOCK_Q) blocks, so the
    grid num_tokens // BLOCK_Q + num_seqs always suffices. Returns the last s with
    start(s) <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Triton compiles one variant per distinct specialisation of a launch's arguments: besides the
# constexprs it specialises every plain int on `== 1` and `% 16 == 0`. `num_seqs` and
# `stride_bt` (the block table's width, which grows with the longest context) change from one
# engine step to the next, so specialising on them compiled new variants (0.5-3 s each on an
# H200) inside timed steps; they are left unspecialised (an int32 argument either way). The
# other strides are fixed by the model and the cache layout and keep their divisibility hints.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM], strides (stride_ot, stride_oh, 1)
    part_acc_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS, HEAD_DIM] fp32, contiguous
    part_ml_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS, 2] fp32, contiguous: (max, sum)
    query_ptr,  # [num_tokens, num_q_heads, HEAD_DIM], strides (stride_qt, stride_qh, 1)
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM],
    #                 strides (stride_cb, stride_cs, stride_ch, 1)
    value_cache_ptr,  # same shape and strides as key_cache_ptr
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32, strides (stride_bt, 1)
    seq_lens_ptr,  # [num_seqs] int32, contiguous
    query_start_loc_ptr,  # [num_seqs + 1] int32, contiguous
    num_seqs,  # number of sequences
    num_q_heads,  # query heads (all KV heads x GROUP)
    scale_log2,  # softmax scale * log2(e): scores are kept in log2 units (exp2)
    stride_ot, stride_oh,  # out strides (elements)
    stride_qt, stride_qh,  # query strides (elements)
    stride_cb, stride_cs, stride_ch,  # cache strides over blocks, slots, heads (elements)
    stride_bt,  # block-table row stride (elements)
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,  # head dimension, a power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
    BLOCK_M: tl.constexpr,  # rows per program (power of two >= 16, >= GROUP)
    BLOCK_Q: tl.constexpr,  # query tokens per program = BLOCK_M // GROUP
    TILE_N: tl.constexpr,  # key positions per inner iteration (power of two >= 16)
    NUM_SEGMENTS: tl.constexpr,  # KV slices (grid axis 2); 1 = write the output directly
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 on GPU), else "tf32"
    UPCAST: tl.constexpr,  # compute the dots in fp32 (bf16 under the interpreter)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    block_in_seq = q_block - (q_start // BLOCK_Q + seq)
    if block_in_seq * BLOCK_Q >= q_len:  # spare block of the upper-bound grid
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Rows: token `tok` of this sequence's query (0-based) x query head `head`.
    rows = tl.arange(0, BLOCK_M)
    tok = block_in_seq * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context_len + tok  # absolute position: keys [0, q_pos] are visible
    token_row = (q_start + tok).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        query_ptr + token_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this block needs: [0, kv_end); this segment's slice of tiles of them.
    kv_end = tl.minimum(seq_len, context_len + (block_in_seq + 1) * BLOCK_Q)
    tiles_per_segment = tl.cdiv(tl.cdiv(seq_len, TILE_N), NUM_SEGMENTS)
    tile_lo = segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, tl.cdiv(kv_end, TILE_N))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # unnormalised output
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_offset = kv_head.to(tl.int64) * stride_ch
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + tl.arange(0, TILE_N)
        pos_valid = pos < kv_end
        # int64 right after the load: block * stride overflows int32 in pools > 2^31 elements.
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        slot_offset = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head_offset
        # Masked loads with other=0: unwritten slots may hold NaN, and 0 * NaN = NaN in P @ V.
        k = tl.load(key_cache_ptr + slot_offset[None, :] + dims[:, None],
                    mask=pos_valid[None, :], other=0.0)  # [HEAD_DIM, TILE_N]
        v = tl.load(value_cache_ptr + slot_offset[:, None] + dims[None, :],
                    mask=pos_valid[:, None], other=0.0)  # [TILE_N, HEAD_DIM]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; exponentiate against 0 instead so
        # that exp2(-inf - -inf) = NaN never appears (p and alpha are then 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token_row[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None],
        )
    else:
        part_row = (token_row * num_q_heads + head) * NUM_SEGMENTS + segment  # int64
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _reduce_segments_kernel(
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM], strides (stride_ot, stride_oh, 1)
    part_acc_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS, HEAD_DIM] fp32, contiguous
    part_ml_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS, 2] fp32, contiguous: (max, sum)
    num_q_heads,  # query heads
    stride_ot, stride_oh,  # out strides (elements)
    NUM_SEGMENTS: tl.constexpr,  # KV slices, a power of two
    HEAD_DIM: tl.constexpr,  # head dimension, a power of two
):
    """One program per (token, query head): out = sum_s w_s acc_s / sum_s w_s l_s with
    w_s = exp2(m_s - max_s m_s). Empty segments carry m = -inf, l = 0 and weigh 0."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    segments = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_DIM)
    part_row = (token * num_q_heads + head) * NUM_SEGMENTS + segments
    m = tl.load(part_ml_ptr + part_row * 2)
    l_seg = tl.load(part_ml_ptr + part_row * 2 + 1)
    acc = tl.load(part_acc_ptr + part_row[:, None] * HEAD_DIM + dims[None, :])
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    total = tl.sum(w * l_seg, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty))


# %%
# Launch configuration
# --------------------


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch knobs of `_attention_kernel` (block_m rows x tile_n keys)."""

    block_m: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2


# Not yet tuned on a GPU: starting points from vLLM's unified kernel and FlagGems' port.
DECODE_CONFIG = KernelConfig(block_m=16, tile_n=64, num_warps=4, num_stages=3)
PREFILL_CONFIG = KernelConfig(block_m=64, tile_n=64, num_warps=4, num_stages=2)
MAX_SEGMENTS = 16
MIN_TOKENS_PER_SEGMENT = 256
_DEFAULT_SM_COUNT = 132  # H200; used to plan splits when no CUDA device is present


def _is_decode_batch(num_tokens: int, num_seqs: int) -> bool:
    """One query token per sequence (known from shapes alone, no device read)."""
    return num_tokens == num_seqs


def choose_config(num_tokens: int, num_seqs: int, group: int) -> KernelConfig:
    """Decode batches get a 16-row block (the group's heads padded); prefill batches 64 rows.
    block_m is raised to the group size when a group is larger."""
    base = DECODE_CONFIG if _is_decode_batch(num_tokens, num_seqs) else PREFILL_CONFIG
    block_m = max(base.block_m, triton.next_power_of_2(group))
    return KernelConfig(block_m, base.tile_n, base.num_warps, base.num_stages)


def device_sm_count(device: torch.device) -> int:
    """The device's SMs, which the split-KV choice plans for (the H200's off CUDA)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return _DEFAULT_SM_COUNT


def choose_num_segments(
    num_tokens: int, num_seqs: int, num_kv_heads: int, max_kv_len: int, sm_count: int
) -> int:
    """Split-KV segments (a power of two, 1 = off) for a launch.

    Only decode batches split. When num_seqs x num_kv_heads programs cannot fill two waves of
    the device, split the keys so they do, keeping >= MIN_TOKENS_PER_SEGMENT keys per
    segment of the longest possible context (`max_kv_len`, from the block table's width).
    """
    if not _is_decode_batch(num_tokens, num_seqs):
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= sm_count:
        return 1
    wanted = int(triton.next_power_of_2(math.ceil(2 * sm_count / programs)))  # triton is untyped
    by_length = max(1, max_kv_len // MIN_TOKENS_PER_SEGMENT)
    cap = 1 << (by_length.bit_length() - 1)  # largest power of two <= by_length
    return max(1, min(wanted, cap, MAX_SEGMENTS))


# %%
# Wrapper
# -------


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    num_tokens, num_q_heads, head_dim = query.shape
    assert key_cache.dim() == 4, key_cache.shape
    _, _, num_kv_heads, cache_head_dim = key_cache.shape
    assert cache_head_dim == head_dim, (key_cache.shape, query.shape)
    assert value_cache.shape == key_cache.shape and value_cache.stride() == key_cache.stride()
    assert key_cache.dtype == value_cache.dtype == query.dtype, (query.dtype, key_cache.dtype)
    assert query.dtype in (torch.float32, torch.float16, torch.bfloat16), query.dtype
    assert key_cache.stride(3) == 1 and query.stride(2) == 1, "head_dim must be contiguous"
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim}"
    num_seqs = seq_lens.shape[0]
    assert block_tables.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1, "block table rows must be contiguous"
    assert seq_lens.is_contiguous() and query_start_loc.is_contiguous()
    assert query_start_loc.shape == (num_seqs + 1,), (query_start_loc.shape, num_seqs)
    devices = {t.device for t in (query, key_cache, value_cache, block_tables, seq_lens,
                                  query_start_loc)}
    assert len(devices) == 1, devices


def _segment_buffers(query: torch.Tensor, num_segments: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-KV partials, fp32: accumulators [num_tokens, num_q_heads, num_segments,
    head_dim] and (running max, sum) [num_tokens, num_q_heads, num_segments, 2]; with one
    segment the kernel does not touch them (any fp32 tensor will do)."""
    if num_segments == 1:
        unused = torch.empty(1, dtype=torch.float32, device=query.device)
        return unused, unused
    num_tokens, num_q_heads, head_dim = query.shape
    shape = (num_tokens, num_q_heads, num_segments)
    return (torch.empty((*shape, head_dim), dtype=torch.float32, device=query.device),
            torch.empty((*shape, 2), dtype=torch.float32, device=query.device))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    num_segments: int | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Returns the attention output, [num_tokens, num_q_heads, head_dim], query's dtype.

    Same inputs as `paged_attention_torch.paged_attention_ref` (see the module docstring).
    Keyword-only knobs for tests and benchmarks: `num_segments` forces the split-KV path (a
    power of two; None = chosen from shapes and the device's SM count), `config` overrides
    the tile sizes.
    """
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # warmup.choose_variant's two choices, made apart: no object built per launch (each
    # layer of each step comes through here on a host-bound engine)
    cfg = config or choose_config(num_tokens, num_seqs, group)
    assert cfg.block_m >= max(16, group) and cfg.tile_n >= 16, cfg
    if num_segments is None:
        num_segments = choose_num_segments(
            num_tokens, num_seqs, num_kv_heads, block_tables.shape[1] * block_size,
            device_sm_count(query.device))
    assert num_segments >= 1 and num_segments & (num_segments - 1) == 0, num_segments
    block_q = cfg.block_m // group
    part_acc, part_ml = _segment_buffers(query, num_segments)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    _attention_kernel[grid](
        out, part_acc, part_ml, query, key_cache, value_cache,
        block_tables, seq_lens, query_start_loc,
        num_seqs, num_q_heads, scale * math.log2(math.e),
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_Q=block_q, TILE_N=cfg.tile_n, NUM_SEGMENTS=num_segments,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        UPCAST=query.device.type != "cuda" and query.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_segments > 1:
        _reduce_segments_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_ml, num_q_heads, out.stride(0), out.stride(1),
            NUM_SEGMENTS=num_segments, HEAD_DIM=head_dim,
        )
    return out
