"""The paged-attention Triton kernel against its torch reference.

Without CUDA these run under TRITON_INTERPRET=1 (tests/conftest.py sets it before this module
imports the kernels), in fp32/fp16 (bf16 only with the kernel's fp32 upcast): the interpreter's
bf16 `tl.dot` is wrong. Shapes are tiny because every program iteration costs milliseconds in
the interpreter. GPU-only variants (bf16, bigger shapes, a > 2^31-element pool) carry
`@pytest.mark.gpu`.

Every pool is filled with NaN before the sequences' K/V are written, and block-table entries
past a sequence's blocks point at NaN blocks, so any read outside [0, seq_len) shows in the
output.
"""

from __future__ import annotations

import pytest
import torch

from backends.kernels.paged_attention import (
    KernelConfig,
    choose_num_segments,
    paged_attention,
)
from backends.kernels.paged_attention_torch import paged_attention_ref
from backends.kernels.reshape_and_cache import reshape_and_cache
from tests.backends.kernels import paged_batch
from tests.backends.kernels.paged_batch import Batch

# Triton's interpreter converts 1-element arrays to Python ints (loop bounds, branches).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (rtol, atol): fp32 differs only by summation order; fp16 rounds P before P @ V and the
# output; bf16 rounds the output to 8 mantissa bits.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 3e-3),
             torch.bfloat16: (1.6e-2, 1.6e-2)}

# (context_len, q_len) per sequence: decodes have q_len 1; prefill chunks have q_len > 1 on a
# cached context (0 = first chunk). No length is a multiple of the block size unless noted.
DECODES = [(20, 1), (36, 1), (4, 1), (0, 1)]
MIXED = [(20, 1), (0, 30), (16, 9), (45, 1), (33, 17)]


def make_batch(seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int,
               head_dim: int, **kwargs: object) -> Batch:
    """`tests.backends.kernels.paged_batch.make_batch` on this module's device."""
    return paged_batch.make_batch(seqs, num_q_heads, num_kv_heads, head_dim,
                                  device=DEVICE, **kwargs)  # type: ignore[arg-type]


def check(batch: Batch, scale: float = 0.2, **kwargs: object) -> torch.Tensor:
    """Runs the kernel and the reference; asserts closeness at the dtype's tolerance."""
    out = paged_attention(*batch.args(), scale, **kwargs)  # type: ignore[arg-type]
    ref = paged_attention_ref(*batch.args(), scale)
    rtol, atol = TOLERANCE[batch.query.dtype]
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    return out


# %%
# Decode, mixed prefill + decode, GQA, head dims, block sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_decode_batch(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int) -> None:
    check(make_batch(DECODES, num_q_heads, num_kv_heads, 64, dtype=dtype), num_segments=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_mixed_prefill_and_decode(dtype: torch.dtype, num_q_heads: int,
                                  num_kv_heads: int) -> None:
    check(make_batch(MIXED, num_q_heads, num_kv_heads, 32, dtype=dtype, seed=1))


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_head_dims(head_dim: int) -> None:
    check(make_batch([(10, 1), (7, 12), (30, 1)], 4, 2, head_dim, seed=head_dim))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes_and_lengths_on_block_boundaries(block_size: int) -> None:
    seqs = [(block_size - 1, 1), (block_size, 1), (0, block_size), (block_size + 1, 2 * block_size)]
    check(make_batch(seqs, 4, 1, 32, block_size=block_size, seed=block_size))


def test_prefill_chunks_span_several_query_blocks() -> None:
    """Chunks longer than one query block (64 rows / group) exercise the block-to-sequence
    search and the causal frontier of later blocks."""
    seqs = [(5, 40), (0, 70), (3, 1)]
    check(make_batch(seqs, 4, 1, 32, seed=3))  # 16 tokens per query block
    check(make_batch(seqs, 4, 1, 32, seed=3), config=KernelConfig(block_m=16, tile_n=16))


def test_sequence_without_query_tokens_is_skipped() -> None:
    """A sequence with q_len 0 in the middle of the batch produces no rows."""
    batch = make_batch([(9, 2), (12, 0), (20, 1)], 4, 2, 32, seed=4)
    check(batch)


def test_strided_query() -> None:
    """Query as a slice of a fused QKV tensor (token stride > heads x head_dim)."""
    batch = make_batch(MIXED[:3], 4, 2, 32, seed=5)
    fused = torch.randn(batch.query.shape[0], 8, 32, device=DEVICE)
    fused[:, :4] = batch.query
    batch.query = fused[:, :4]
    assert not batch.query.is_contiguous()
    check(batch)


def test_bf16_with_fp32_upcast() -> None:
    """bf16 inputs; off the GPU the kernel computes its dots in fp32."""
    check(make_batch(MIXED[:3], 4, 2, 32, dtype=torch.bfloat16, seed=6))


def test_nan_outside_the_context_would_show() -> None:
    """The test harness can fail: reading one unwritten slot makes the reference NaN."""
    batch = make_batch([(5, 1)], 2, 1, 32, seed=7)
    batch.seq_lens += 1  # now includes an unwritten (NaN) slot
    assert torch.isnan(paged_attention_ref(*batch.args(), 0.2)).all()
    assert torch.isnan(paged_attention(*batch.args(), 0.2)).all()


def test_reshape_and_cache_then_attention() -> None:
    """The step's new tokens written by the Triton reshape_and_cache, then attended to."""
    batch = make_batch(MIXED, 4, 2, 32, seed=8)
    gen = torch.Generator().manual_seed(9)
    starts = batch.query_start_loc.tolist()
    slots = []
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[s + 1] - starts[s]
        positions = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
        slots.append(batch.block_tables[s, positions // 16].long() * 16 + positions % 16)
    slot_mapping = torch.cat(slots)
    new_k = torch.randn(len(slot_mapping), 2, 32, generator=gen).to(DEVICE)
    new_v = torch.randn(len(slot_mapping), 2, 32, generator=gen).to(DEVICE)
    reshape_and_cache(new_k, new_v, batch.key_cache, batch.value_cache, slot_mapping)
    flat_k = batch.key_cache.view(-1, 2, 32)
    assert torch.equal(flat_k[slot_mapping], new_k)
    check(batch)


# %%
# Split-KV


@pytest.mark.parametrize("num_segments", [2, 4, 8])
def test_split_kv_decode(num_segments: int) -> None:
    seqs = [(95, 1), (40, 1), (3, 1)]  # segment 7 of 8 is empty for the shorter sequences
    batch = make_batch(seqs, 8, 2, 64, dtype=torch.float16, seed=10)
    split = check(batch, num_segments=num_segments)
    whole = paged_attention(*batch.args(), 0.2, num_segments=1)
    torch.testing.assert_close(split.float(), whole.float(), rtol=3e-3, atol=3e-3)


def test_split_kv_mixed_batch_fp32() -> None:
    """Split-KV is also exact on prefill chunks (rows whose keys all lie in later segments
    see only empty segments there)."""
    check(make_batch(MIXED, 4, 1, 32, seed=11), num_segments=4)


def test_split_kv_head_dim_128_gqa_1() -> None:
    check(make_batch([(100, 1), (17, 1)], 2, 2, 128, seed=12), num_segments=4)


def test_split_kv_is_chosen_for_small_long_decode_grids() -> None:
    # 4 sequences x 8 KV heads = 32 programs on 132 SMs, 4k context: split.
    assert choose_num_segments(4, 4, 8, 4096, 132) == 16
    assert choose_num_segments(8, 8, 4, 4096, 132) == 16
    # 64 x 8 = 512 programs fill the device: no split.
    assert choose_num_segments(64, 64, 8, 4096, 132) == 1
    # Short contexts keep >= 256 keys per segment.
    assert choose_num_segments(4, 4, 8, 512, 132) == 2
    assert choose_num_segments(4, 4, 8, 200, 132) == 1
    # Prefill batches never split.
    assert choose_num_segments(40, 4, 8, 4096, 132) == 1


def test_split_kv_auto_path_runs() -> None:
    """Two sequences x 1 KV head with a wide block table: the wrapper picks a split."""
    batch = make_batch([(60, 1), (30, 1)], 4, 1, 32, block_size=8, seed=13, spare_blocks=70)
    batch.block_tables = torch.cat(
        [batch.block_tables, batch.block_tables[:, -1:].expand(-1, 60)], dim=1).contiguous()
    assert choose_num_segments(2, 2, 1, batch.block_tables.shape[1] * 8, 132) > 1
    check(batch)


# %%
# GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("num_segments", [None, 1, 8])
def test_gpu_bf16_llama_shapes(num_segments: int | None) -> None:
    seqs = [(2000, 1), (517, 1), (0, 300), (1200, 129), (4095, 1), (31, 1)]
    check(make_batch(seqs, 32, 8, 128, dtype=torch.bfloat16, seed=20), num_segments=num_segments)


@pytest.mark.gpu
def test_gpu_bf16_decode_auto_split() -> None:
    check(make_batch([(3000, 1), (1500, 1)], 32, 8, 128, dtype=torch.bfloat16, seed=21))


@pytest.mark.gpu
def test_gpu_fp32_no_tf32() -> None:
    check(make_batch(MIXED, 8, 2, 64, seed=22), num_segments=None)


@pytest.mark.gpu
def test_gpu_pool_larger_than_2_pow_31_elements() -> None:
    """Block ids near the top of a pool of > 2^31 elements per cache (4.3 GB each in bf16):
    int32 offsets would wrap."""
    num_kv_heads, head_dim, block_size = 8, 128, 16
    num_blocks = (1 << 31) // (block_size * num_kv_heads * head_dim) + 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
    value_cache = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(23)
    seq_len = 40 * block_size - 3
    table = (num_blocks - 1 - torch.randperm(40, device=DEVICE, generator=gen)).to(torch.int32)
    positions = torch.arange(seq_len, device=DEVICE)
    slots = table[positions // block_size].long() * block_size + positions % block_size
    kv = torch.randn(2, seq_len, num_kv_heads, head_dim, device=DEVICE, generator=gen)
    reshape_and_cache(kv[0].bfloat16(), kv[1].bfloat16(), key_cache, value_cache, slots)
    flat = key_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[slots], kv[0].bfloat16())
    query = torch.randn(1, 32, head_dim, device=DEVICE, generator=gen).bfloat16()
    batch = Batch(query, key_cache, value_cache, table[None],
                  torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
                  torch.tensor([0, 1], dtype=torch.int32, device=DEVICE))
    check(batch, num_segments=1)
    check(batch, num_segments=4)
