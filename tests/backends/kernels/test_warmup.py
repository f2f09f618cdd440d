"""The kernel warm-up: it launches every variant an engine's steps can choose, each once, on
scratch tensors; the real caches stay bit-identical; and steps of any batch size or block-table
width then hit a warmed variant (Triton's JIT key, computed here without a GPU, is the same).

Without CUDA the launches run under TRITON_INTERPRET=1 (tests/conftest.py), in fp32 on tiny
shapes. The `gpu` test checks the same on the real JIT: no kernel compiles after the warm-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.kernels import paged_attention as pa
from backends.kernels import reshape_and_cache as rc
from backends.kernels.paged_attention import (
    DECODE_CONFIG,
    MAX_SEGMENTS,
    PREFILL_CONFIG,
    KernelConfig,
)
from backends.kernels.warmup import (
    KernelVariant,
    choose_variant,
    kernel_variants,
    warm_up_kernels,
)
from tests.backends.kernels import paged_batch

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 16, 4
SCALE = HEAD_DIM ** -0.5

Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]  # (grid, args, kwargs)
JitKey = tuple[tuple[tuple[Any, ...], ...], tuple[tuple[str, Any], ...]]


class _Recorder:
    """Stands in for a Triton kernel: records each launch, then runs the kernel."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.launches: list[Launch] = []

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.launches.append((grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def recorders(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Recorder]:
    """The three kernels, recorded: "attention", "reduce", "reshape"."""
    found = {"attention": _Recorder(pa._attention_kernel),
             "reduce": _Recorder(pa._reduce_segments_kernel),
             "reshape": _Recorder(rc._reshape_and_cache_kernel)}
    monkeypatch.setattr(pa, "_attention_kernel", found["attention"])
    monkeypatch.setattr(pa, "_reduce_segments_kernel", found["reduce"])
    monkeypatch.setattr(rc, "_reshape_and_cache_kernel", found["reshape"])
    return found


def _cache(num_blocks: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A real-looking pair of caches: random values, a few NaN slots."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = [torch.randn(shape, generator=gen) for _ in range(2)]
    for cache in caches:
        cache[3, 1] = math.nan
    return caches[0].to(DEVICE), caches[1].to(DEVICE)


def _specialization(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> JitKey:
    """Triton's JIT key of a launch: each argument's specialisation (constexpr values, the
    int hints `== 1` / `% 16 == 0`, pointer dtypes and 16-byte alignment) and the launch
    options, as `JITFunction.run` computes it (here on the base backend: no GPU needed)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    _, specialization, options = binder(*args, **kwargs)
    return tuple(map(tuple, specialization)), tuple(sorted(options.items()))


def _keys(recorder: _Recorder) -> list[JitKey]:
    return [_specialization(recorder.kernel, args, kwargs)
            for _, args, kwargs in recorder.launches]


def _constexprs(launch: Launch, *names: str) -> tuple[Any, ...]:
    return tuple(launch[2][name] for name in names)


# %%
# The warm-up's launches


def test_warm_up_launches_each_variant_once(recorders: dict[str, _Recorder]) -> None:
    # 8 SMs, 2 KV heads: one sequence is 2 programs, so decode wants ceil(16 / 2) = 8
    # segments; tables of <= 1100 keys cap it at 1100 // 256 = 4 -> 1, 2, 4 segments.
    key_cache, _ = _cache()
    variants = warm_up_kernels(key_cache, NUM_Q_HEADS, 1100, SCALE, sm_count=8)
    decode = KernelConfig(16, 64, 4, 3)
    assert variants == (KernelVariant(KernelConfig(64, 64, 4, 2), 1), KernelVariant(decode, 1),
                        KernelVariant(decode, 2), KernelVariant(decode, 4))
    names = ("BLOCK_M", "TILE_N", "NUM_SEGMENTS", "num_warps", "num_stages")
    assert [_constexprs(launch, *names) for launch in recorders["attention"].launches] == [
        (64, 64, 1, 4, 2), (16, 64, 1, 4, 3), (16, 64, 2, 4, 3), (16, 64, 4, 4, 3)]
    assert [_constexprs(launch, "NUM_SEGMENTS") for launch in recorders["reduce"].launches] \
        == [(2,), (4,)]
    assert len(recorders["reshape"].launches) == 1
    for recorder in recorders.values():  # once each: no two launches share a JIT key
        assert len(set(_keys(recorder))) == len(recorder.launches)


def test_warm_up_leaves_the_real_cache_alone(recorders: dict[str, _Recorder]) -> None:
    key_cache, value_cache = _cache()
    before = [t.clone() for t in (key_cache, value_cache)]
    warm_up_kernels(key_cache, NUM_Q_HEADS, 4096, SCALE)
    for tensor, copy in zip((key_cache, value_cache), before, strict=True):
        assert torch.equal(tensor.view(torch.int32), copy.view(torch.int32))  # NaN bits too
    real = {key_cache.data_ptr(), value_cache.data_ptr()}
    for recorder in recorders.values():
        for _, args, _ in recorder.launches:
            assert not real & {a.data_ptr() for a in args if isinstance(a, torch.Tensor)}


def test_warm_up_rejects_heads_that_do_not_group() -> None:
    with pytest.raises(ValueError, match="num_q_heads must be a multiple of num_kv_heads "
                                         r"\(2\), got 3"):
        warm_up_kernels(_cache()[0], 3, 4096, SCALE)


# %%
# Real steps after the warm-up hit its variants

# Engine-like steps, (context_len, q_len) per sequence: 1, 3, 16 and 17 sequences; tables of
# 1, 2, 16, 17 and more blocks (make_batch adds 2); prefill, mixed, decode, and decodes long
# enough to split (a 1100-key table lets one sequence take 4 segments).
STEPS = [
    [(0, 5)], [(0, 4)], [(5, 3), (9, 1)], [(3, 1)], [(3, 1), (20, 1), (40, 1)],
    [(3, 1)] * 16, [(3, 1)] * 17, [(54, 1), (1, 1)], [(58, 1)], [(2, 1)] * 15 + [(5, 2)],
    [(600, 1)], [(1090, 1)],
]


def test_steps_after_the_warm_up_hit_warmed_variants(recorders: dict[str, _Recorder]) -> None:
    key_cache, _ = _cache()
    variants = warm_up_kernels(key_cache, NUM_Q_HEADS, 1100, SCALE)
    assert [v.num_segments for v in variants] == [1, 1, 2, 4]
    warmed = {name: set(_keys(rec)) for name, rec in recorders.items()}
    for rec in recorders.values():
        rec.launches.clear()
    for seqs in STEPS:
        batch = paged_batch.make_batch(seqs, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                       seed=len(seqs), device=DEVICE)
        pa.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                           batch.block_tables, batch.seq_lens, batch.query_start_loc, SCALE)
        num_tokens = sum(q for _, q in seqs)
        new_kv = torch.randn(num_tokens, 3 * NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
        k, v = new_kv[:, :NUM_KV_HEADS], new_kv[:, NUM_KV_HEADS:2 * NUM_KV_HEADS]
        slots = torch.arange(num_tokens, dtype=torch.int64, device=DEVICE)
        rc.reshape_and_cache(k.contiguous(), v.contiguous(), batch.key_cache,
                             batch.value_cache, slots)
    segments = [launch[2]["NUM_SEGMENTS"] for launch in recorders["attention"].launches]
    assert segments == [1] * 10 + [2, 4]  # the long decodes split
    for name, rec in recorders.items():
        assert set(_keys(rec)) <= warmed[name], name


# %%
# The variant set covers the launcher's choice, and only it


@settings(max_examples=400, deadline=None)
@given(num_seqs=st.integers(1, 2048), extra_tokens=st.integers(0, 8192),
       num_kv_heads=st.integers(1, 64), group=st.integers(1, 16),
       max_kv_len=st.integers(1, 200_000), kv_fraction=st.floats(0.0, 1.0),
       sm_count=st.integers(1, 1024))
def test_the_launchers_choice_is_always_warmed(num_seqs: int, extra_tokens: int,
                                               num_kv_heads: int, group: int,
                                               max_kv_len: int, kv_fraction: float,
                                               sm_count: int) -> None:
    """Any batch (num_tokens >= num_seqs), any table up to the engine's longest."""
    table_len = max(1, int(max_kv_len * kv_fraction))
    chosen = choose_variant(num_seqs + extra_tokens, num_seqs, group, num_kv_heads, table_len,
                            sm_count)
    assert chosen in kernel_variants(group, num_kv_heads, max_kv_len, sm_count)


@pytest.mark.parametrize("num_kv_heads,group,max_kv_len,sm_count,segments", [
    (8, 4, 131072, 132, [1, 2, 4, 8, 16]),  # Llama-3.1-8B on an H200
    (8, 4, 2048, 132, [1, 2, 4, 8]),  # cap: 2048 // 256 = 8
    (8, 4, 511, 132, [1]),  # too short to split
    (2, 2, 4096, 8, [1, 2, 4, 8]),  # wanted: next_power_of_2(ceil(16 / 2)) = 8
    (64, 1, 131072, 132, [1, 2, 4, 8]),  # wanted: next_power_of_2(ceil(264 / 64) = 5) = 8
    (132, 1, 131072, 132, [1]),  # one sequence fills the device
])
def test_variants_are_exactly_the_reachable_choices(num_kv_heads: int, group: int,
                                                    max_kv_len: int, sm_count: int,
                                                    segments: list[int]) -> None:
    variants = kernel_variants(group, num_kv_heads, max_kv_len, sm_count)
    assert [v.num_segments for v in variants] == [1, *segments]
    reached = {choose_variant(num_seqs + extra, num_seqs, group, num_kv_heads, kv, sm_count)
               for num_seqs in range(1, 2 * sm_count + 2) for extra in (0, 1)
               for kv in {1, 256, 512, 1024, 2048, 4096, max_kv_len}
               if kv <= max_kv_len}
    assert reached == set(variants)


def test_variant_configs_follow_the_group() -> None:
    assert kernel_variants(32, 1, 100, 132) == (
        KernelVariant(KernelConfig(64, PREFILL_CONFIG.tile_n, 4, 2), 1),
        KernelVariant(KernelConfig(32, DECODE_CONFIG.tile_n, 4, 3), 1))
    assert kernel_variants(128, 1, 100, 132)[0].config.block_m == 128
    assert MAX_SEGMENTS == 16


def test_a_variant_needs_a_power_of_two_of_segments() -> None:
    with pytest.raises(ValueError, match="num_segments must be a power of two >= 1, got 3"):
        KernelVariant(DECODE_CONFIG, 3)


# %%
# On the GPU: nothing compiles after the warm-up


def _compiled(kernel: Any) -> int:
    """Variants in Triton's in-memory JIT cache of `kernel` on the current device."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.gpu
def test_gpu_no_compile_after_the_warm_up() -> None:
    shape = (64, 16, 8, 128)  # Llama-3.1-8B's KV heads and head_dim, bf16
    key_cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    warm_up_kernels(key_cache, 32, 64 * 16, 128 ** -0.5)
    kernels = (pa._attention_kernel, pa._reduce_segments_kernel, rc._reshape_and_cache_kernel)
    before = [_compiled(kernel) for kernel in kernels]
    gen = torch.Generator().manual_seed(0)
    for num_seqs, width, q_len in [(1, 1, 1), (1, 64, 1), (11, 9, 1), (15, 16, 1), (16, 17, 1),
                                   (23, 33, 1), (32, 48, 1), (1, 3, 40), (7, 5, 9)]:
        num_tokens = num_seqs * q_len
        query = torch.randn(num_tokens, 32, 128, generator=gen).to("cuda", torch.bfloat16)
        tables = torch.randint(1, 64, (num_seqs, width), generator=gen, dtype=torch.int32)
        seq_lens = torch.full((num_seqs,), width * 16, dtype=torch.int32)
        starts = torch.arange(num_seqs + 1, dtype=torch.int32) * q_len
        new_k = torch.randn(num_tokens, 8, 128, generator=gen).to("cuda", torch.bfloat16)
        slots = torch.arange(num_tokens, dtype=torch.int64, device="cuda") + 16
        rc.reshape_and_cache(new_k, new_k.clone(), key_cache, value_cache, slots)
        pa.paged_attention(query, key_cache, value_cache, tables.cuda(), seq_lens.cuda(),
                           starts.cuda(), 128 ** -0.5)
    torch.cuda.synchronize()
    assert [_compiled(kernel) for kernel in kernels] == before
