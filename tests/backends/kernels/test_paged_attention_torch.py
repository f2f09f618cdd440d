"""The batched torch paged attention (the CPU engine's path) against `paged_attention_ref`,
and end to end: the engine's greedy tokens with it equal transformers' `generate`.

Pools are filled with a poison value (NaN, or large finite values that a leak would not turn
into NaN) before the sequences' K/V are written; block ids are handed out shuffled; the
block-table entries past a sequence's blocks are ids that do not exist in the pool. Any read
outside [0, seq_len), or a mask applied to the wrong rows, shows in the output.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from backends.engine.attention import TORCH_OPS, select_ops
from backends.engine.kv_cache import KVCache, KVCacheSpec
from backends.engine.model import load_model
from backends.engine.model_runner import ModelRunner
from backends.engine.offline import generate_offline
from backends.engine.tiny_model import build_tiny_llama
from backends.kernels.paged_attention_torch import paged_attention_ref, paged_attention_torch
from runtime import CacheConfig, Scheduler, SchedulerConfig
from tests.backends.kernels import paged_batch
from tests.backends.kernels.paged_batch import Batch

# (rtol, atol): fp32 differs only by summation order (the scale is applied to q, not to the
# scores); fp16/bf16 outputs are both rounded from fp32 results, so one rounding step apart.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
             torch.bfloat16: (1.6e-2, 1.6e-2)}
MISSING_BLOCK = 10_000  # block-table padding: an id past every pool here

# (context_len, q_len) per sequence: decodes have q_len 1, prefill chunks q_len > 1 (context
# 0 = first chunk), q_len 0 = scheduled nothing. Lengths are not multiples of the block size.
DECODES = [(20, 1), (36, 1), (4, 1), (0, 1), (70, 1)]
MIXED = [(20, 1), (0, 30), (16, 9), (45, 1), (12, 0), (33, 17), (2, 1), (5, 0)]


def make_batch(seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int,
               **kwargs: object) -> Batch:
    """`tests.backends.kernels.paged_batch.make_batch` with table padding = MISSING_BLOCK."""
    return paged_batch.make_batch(seqs, num_q_heads, num_kv_heads,
                                  padding_block=MISSING_BLOCK, **kwargs)  # type: ignore[arg-type]


def check(batch: Batch, scale: float = 0.25) -> torch.Tensor:
    """Runs the batched path and the reference; asserts closeness at the dtype's tolerance."""
    out = paged_attention_torch(*batch.args(), scale)
    ref = paged_attention_ref(*batch.args(), scale)
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert torch.isfinite(out).all()
    rtol, atol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (6, 1)])
def test_decode_batch(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int) -> None:
    check(make_batch(DECODES, num_q_heads, num_kv_heads, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (4, 2), (8, 2)])
def test_mixed_prefill_decode_and_empty(dtype: torch.dtype, num_q_heads: int,
                                        num_kv_heads: int) -> None:
    check(make_batch(MIXED, num_q_heads, num_kv_heads, head_dim=32, dtype=dtype, seed=1))


@pytest.mark.parametrize("poison", [math.nan, 1e4, -1e4])
def test_cache_outside_the_context_never_leaks(poison: float) -> None:
    """Large finite poison stays finite if it leaks through a wrong mask, so only the
    comparison with the reference catches it; NaN poison catches 0 * NaN in P @ V."""
    check(make_batch(MIXED, 4, 2, poison=poison, seed=2))


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_block_sizes_and_lengths_on_block_boundaries(block_size: int) -> None:
    seqs = [(block_size - 1, 1), (block_size, 1), (0, block_size),
            (block_size + 1, 2 * block_size), (3 * block_size - 1, 1)]
    check(make_batch(seqs, 4, 2, block_size=block_size, poison=1e4, seed=block_size))


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed: int) -> None:
    """Random mixes: 1-12 sequences, q_len 0 (a fifth), 1 (half) or a chunk up to 20."""
    gen = torch.Generator().manual_seed(100 + seed)

    def draw(high: int) -> int:
        return int(torch.randint(high, (1,), generator=gen))

    seqs = []
    for _ in range(1 + draw(12)):
        kind = draw(10)
        q_len = 0 if kind < 2 else 1 if kind < 7 else 2 + draw(19)
        seqs.append((draw(90) + (q_len == 0), q_len))
    num_kv_heads = 1 + draw(2)
    batch = make_batch(seqs, num_kv_heads * (1 + draw(3)), num_kv_heads,
                       block_size=(4, 8, 16)[draw(3)], poison=(math.nan, 1e4)[draw(2)],
                       seed=seed)
    check(batch)


def test_only_empty_sequences_and_no_sequences() -> None:
    out = check(make_batch([(7, 0), (3, 0)], 4, 2))
    assert out.shape == (0, 4, 16)
    empty = make_batch([(7, 1)], 4, 2)
    none = Batch(empty.query[:0], empty.key_cache, empty.value_cache,
                 empty.block_tables[:0], empty.seq_lens[:0], empty.query_start_loc[:1])
    assert paged_attention_torch(*none.args(), 0.25).shape == (0, 4, 16)


def test_strided_query() -> None:
    """Query as a slice of a fused QKV tensor (token stride > heads x head_dim)."""
    batch = make_batch(MIXED, 4, 2, seed=3)
    fused = torch.randn(batch.query.shape[0], 8, 16)
    fused[:, :4] = batch.query
    assert not fused[:, :4].is_contiguous()
    check(Batch(fused[:, :4], *batch.args()[1:]))


def test_a_wrong_mask_would_show() -> None:
    """The comparison can fail: one poisoned slot inside a decode's length changes the
    output (finite poison) or makes it NaN."""
    batch = make_batch(DECODES, 4, 2, poison=1e4, seed=4)
    batch.seq_lens[0] += 1  # now includes an unwritten slot
    good = paged_attention_ref(*make_batch(DECODES, 4, 2, poison=1e4, seed=4).args(), 0.25)
    assert not torch.allclose(paged_attention_torch(*batch.args(), 0.25)[0], good[0])
    nan_batch = make_batch(DECODES, 4, 2, seed=4)
    nan_batch.seq_lens[0] += 1
    assert torch.isnan(paged_attention_torch(*nan_batch.args(), 0.25)[0]).all()


def test_cpu_selects_the_batched_path() -> None:
    assert select_ops(torch.device("cpu")) is TORCH_OPS
    assert TORCH_OPS.kind == "torch"


# %%
# End to end: engine tokens = transformers' generate


def test_engine_with_the_batched_path_equals_generate(tmp_path: Path) -> None:
    """Chunked prefills next to decodes (budget 7, block size 4) through the real runner."""
    model = load_model(build_tiny_llama(tmp_path / "tiny"), "float32", torch.device("cpu"),
                       TORCH_OPS)
    gen = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": torch.randint(10, 512, (n,), generator=gen).tolist()
               for i, n in enumerate([5, 17, 9, 30, 1, 12])}
    expected = {}
    for req_id, prompt in prompts.items():
        ids = model.hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                      eos_token_id=None, pad_token_id=0)
        expected[req_id] = ids[0, len(prompt):].tolist()
    shape = model.shape
    spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, 4, model.dtype)
    runner = ModelRunner(model, KVCache(spec, 64, model.device))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=7, max_num_seqs=4,
                                          max_model_len=256),
                          CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False))
    result = generate_offline(scheduler, runner, prompts, 8, check_invariants=True)
    assert result.outputs == expected
