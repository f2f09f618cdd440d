"""`rt bench gpu`: one script for a lent GPU (an H200 in this project), JSON out.

Sections, in order (the JSON file is rewritten after each, so a run cut short keeps what it
measured):
  1. ceilings measured in the same run: device-to-device copy bandwidth (read + written bytes
     per second) and bf16 matmul TFLOP/s;
  2. correctness of both Triton kernels in bf16 against the torch references (mixed batches,
     split-KV forced on and off, NaN in unwritten slots);
  3. decode attention at batch 64, context 4096, 32 query / 8 KV heads, head dim 128, bf16,
     block size 16: achieved bandwidth = bytes that must be moved / kernel time, as a fraction
     of the copy bandwidth (goal >= 0.8), with a small sweep of tile configurations;
  4. long-context small-batch decode, split-KV as the wrapper chooses it against no split;
  5. prefill (8 x 2048 new tokens, causal) and extend (8 x 512 tokens on a 3584-token prefix)
     TFLOP/s against the matmul;
  6. `engine_throughput`: None unless a function is plugged in (the engine-vs-transformers
     comparison belongs to the model runner).
Times are CUDA-event medians over repeats after a warm-up, with L2 flushed before each repeat.
The sizes live in a `BenchPlan`, so the same code runs a tiny plan on the CPU (interpreter,
perf_counter timer) in the tests.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from backends.kernels.paged_attention import (
    KernelConfig,
    choose_config,
    choose_num_segments,
    paged_attention,
)
from backends.kernels.paged_attention_torch import PagedAttentionInputs, paged_attention_ref
from backends.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

DECODE_GOAL = 0.8  # fraction of the measured copy bandwidth
BF16_RTOL = BF16_ATOL = 1.6e-2
CPU_SM_COUNT = 132  # plan split-KV as for an H200 when there is no CUDA device
Report = dict[str, Any]
EngineBench = Callable[[], Report]
Seqs = tuple[tuple[int, int], ...]  # (context_len, q_len) per sequence


class GpuUnavailable(RuntimeError):
    """No CUDA device: the benchmark cannot run here."""


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

DECODE_SWEEP = tuple(KernelConfig(16, tile, warps, stages)
                     for tile in (32, 64, 128) for warps in (4, 8) for stages in (2, 3))
PREFILL_SWEEP = (KernelConfig(64, 64, 4, 2), KernelConfig(64, 32, 4, 3),
                 KernelConfig(128, 64, 8, 2), KernelConfig(128, 32, 8, 3),
                 KernelConfig(64, 128, 8, 2), KernelConfig(128, 128, 8, 2))


@dataclass(frozen=True)
class BenchPlan:
    """What to run and how big. The defaults are the H200 run (well under 10 minutes)."""

    shape: AttentionShape = LLAMA_8B
    copy_gib: float = 1.0
    matmul_n: int = 8192
    decode: tuple[int, int] = (64, 4096)  # (batch, context)
    split_decode: tuple[int, int] = (4, 32768)
    prefill: Seqs = ((0, 2048),) * 8
    extend: Seqs = ((3584, 512),) * 8
    correctness: tuple[tuple[str, Seqs], ...] = (
        ("decode", ((2000, 1), (517, 1), (4095, 1), (31, 1), (0, 1))),
        ("mixed", ((2000, 1), (0, 300), (1200, 129), (63, 1), (15, 700))),
    )
    correctness_tokens: int = 1000  # reshape_and_cache check
    decode_sweep: tuple[KernelConfig, ...] = DECODE_SWEEP
    prefill_sweep: tuple[KernelConfig, ...] = PREFILL_SWEEP
    warmup: int = 5
    repeats: int = 30
    l2_flush_bytes: int = 256 << 20


# %%
# Timing

# (fn, warmup, repeats, L2 flush buffer or None) -> per-call times in ms
Timer = Callable[[Callable[[], object], int, int, torch.Tensor | None], list[float]]


def cuda_time_ms(fn: Callable[[], object], warmup: int, repeats: int,
                 flush: torch.Tensor | None) -> list[float]:
    """Kernel times in ms from CUDA events around each call; `flush` (if given) is zeroed
    before each repeat so the L2 cache holds nothing of the inputs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for start, end in events:
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def cpu_time_ms(fn: Callable[[], object], warmup: int, repeats: int,
                flush: torch.Tensor | None) -> list[float]:
    """Wall-clock ms per call (the CPU smoke run; no meaning as a kernel time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - began))
    return times


def _summary(times_ms: list[float]) -> Report:
    ordered = sorted(times_ms)
    return {"median_us": 1e3 * statistics.median(ordered),
            "p20_us": 1e3 * ordered[len(ordered) // 5],
            "p80_us": 1e3 * ordered[(4 * len(ordered)) // 5]}


@dataclass(frozen=True)
class Bench:
    """Where and how a plan runs."""

    plan: BenchPlan
    device: torch.device
    timer: Timer
    sm_count: int

    def time(self, fn: Callable[[], object], flush: torch.Tensor | None = None) -> Report:
        """Median / p20 / p80 of fn's time, in microseconds."""
        return _summary(self.timer(fn, self.plan.warmup, self.plan.repeats, flush))


# %%
# Ceilings


def copy_bandwidth(bench: Bench) -> Report:
    """Device-to-device `copy_` of plan.copy_gib GiB: (read + written bytes) / time, GB/s."""
    n = int(bench.plan.copy_gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=bench.device).normal_()
    dst = torch.empty_like(src)
    summary = bench.time(lambda: dst.copy_(src))
    moved = 2 * n * 2
    return {"bytes": moved, **summary, "gbps": moved / summary["median_us"] / 1e3}


def matmul_tflops(bench: Bench) -> Report:
    """bf16 `torch.mm` of two n x n matrices: 2 n^3 / time, in TFLOP/s."""
    n = bench.plan.matmul_n
    a = torch.randn(n, n, device=bench.device).to(torch.bfloat16)
    b = torch.randn(n, n, device=bench.device).to(torch.bfloat16)
    summary = bench.time(lambda: torch.mm(a, b))
    return {"n": n, **summary, "tflops": 2 * n**3 / summary["median_us"] / 1e6}


# %%
# Inputs


@dataclass
class PagedBatch(PagedAttentionInputs):
    """paged_attention inputs and the (context_len, q_len) of each sequence."""

    seqs: Seqs

    @property
    def scale(self) -> float:
        return float(self.query.shape[-1]) ** -0.5

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
# Correctness


def _compare(out: torch.Tensor, ref: torch.Tensor) -> Report:
    nan = bool(torch.isnan(out).any())
    close = bool(torch.allclose(out.float(), ref.float(), rtol=BF16_RTOL, atol=BF16_ATOL))
    return {"max_abs_err": float((out.float() - ref.float()).abs().max()), "nan": nan,
            "passed": close and not nan}


def _check_batch(batch: PagedBatch, **kwargs: Any) -> Report:
    return _compare(paged_attention(*batch.args(), batch.scale, **kwargs),
                    paged_attention_ref(*batch.args(), batch.scale))


def check_reshape_and_cache(bench: Bench) -> Report:
    """Writes of plan.correctness_tokens tokens into a 4096-block pool; bit-exact against the
    reference, and no other slot touched."""
    shape, tokens = bench.plan.shape, bench.plan.correctness_tokens
    gen = torch.Generator(device=bench.device).manual_seed(1)
    pool = (4096, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.zeros(pool, dtype=shape.dtype, device=bench.device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(pool[0] * pool[1], device=bench.device, generator=gen)[:tokens]
    kv = torch.randn((2, tokens, shape.num_kv_heads, shape.head_dim), device=bench.device,
                     generator=gen).to(shape.dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache(kv[0], kv[1], k_cache, v_cache, slots)
    reshape_and_cache_ref(kv[0], kv[1], k_ref, v_ref, slots)
    same = torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    return {"tokens": tokens, "passed": bool(same)}


def check_paged_attention(bench: Bench) -> list[Report]:
    """Against the fp32-accumulating reference, split-KV auto / off / forced to 8."""
    results = []
    for seed, (name, seqs) in enumerate(bench.plan.correctness):
        batch = make_paged_batch(seqs, bench.plan.shape, seed=seed, nan_tails=True,
                                 device=bench.device)
        for segments in (None, 1, 8):
            results.append({"case": name, "num_segments": segments or "auto",
                            **_check_batch(batch, num_segments=segments)})
    return results


# %%
# Performance


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


def _decode_segments(bench: Bench, batch: PagedBatch) -> int:
    """The split the wrapper picks for this decode batch."""
    num_seqs = len(batch.seqs)
    max_kv = batch.block_tables.shape[1] * batch.key_cache.shape[1]
    return choose_num_segments(num_seqs, num_seqs, batch.key_cache.shape[2], max_kv,
                               bench.sm_count)


def _decode_row(bench: Bench, batch: PagedBatch, flush: torch.Tensor, copy_gbps: float,
                config: KernelConfig | None, num_segments: int) -> Report:
    """Time and bandwidth of one decode launch configuration."""
    group = batch.query.shape[1] // batch.key_cache.shape[2]
    used = config or choose_config(len(batch.seqs), len(batch.seqs), group)
    try:
        timing = bench.time(lambda: paged_attention(
            *batch.args(), batch.scale, num_segments=num_segments, config=config), flush)
    except Exception as err:  # a configuration that does not compile (shared memory, ...)
        return {"config": asdict(used), "error": (str(err).splitlines() or [repr(err)])[0]}
    gbps = decode_bytes(batch, num_segments) / timing["median_us"] / 1e3
    return {"config": asdict(used), "num_segments": num_segments, **timing, "gbps": gbps,
            "fraction_of_copy": gbps / copy_gbps}


def _best(rows: list[Report], key: str) -> Report:
    timed = [row for row in rows if key in row]
    return max(timed, key=lambda row: row[key]) if timed else rows[0]


def bench_decode(bench: Bench, flush: torch.Tensor, copy_gbps: float) -> Report:
    """Decode attention (one new token per sequence, `context` keys each): bandwidth of the
    wrapper's default configuration and of a small sweep, against the copy."""
    batch_size, context = bench.plan.decode
    batch = make_paged_batch(((context - 1, 1),) * batch_size, bench.plan.shape, seed=7,
                             device=bench.device)
    segments = _decode_segments(bench, batch)
    correctness = _check_batch(batch)
    default = _decode_row(bench, batch, flush, copy_gbps, None, segments)
    sweep = [_decode_row(bench, batch, flush, copy_gbps, config, segments)
             for config in bench.plan.decode_sweep]
    return {"batch": batch_size, "context": context, **bench.plan.shape.to_json(),
            "bytes": decode_bytes(batch, segments), "correctness": correctness,
            "default": default, "best": _best([default, *sweep], "gbps"), "sweep": sweep,
            "goal_fraction_of_copy": DECODE_GOAL,
            "meets_goal": default.get("fraction_of_copy", 0.0) >= DECODE_GOAL}


def bench_split_decode(bench: Bench, flush: torch.Tensor, copy_gbps: float) -> Report:
    """Long-context decode on a grid too small for the device: split-KV as the wrapper
    chooses it, against no split."""
    batch_size, context = bench.plan.split_decode
    batch = make_paged_batch(((context - 1, 1),) * batch_size, bench.plan.shape, seed=8,
                             device=bench.device)
    auto = _decode_segments(bench, batch)
    return {"batch": batch_size, "context": context, **bench.plan.shape.to_json(),
            "correctness": _check_batch(batch),
            "auto": _decode_row(bench, batch, flush, copy_gbps, None, auto),
            "no_split": _decode_row(bench, batch, flush, copy_gbps, None, 1)}


def bench_prefill(bench: Bench, flush: torch.Tensor, mm_tflops: float, seqs: Seqs) -> Report:
    """TFLOP/s of a prefill/extend batch (the new tokens' K/V already in the cache)."""
    shape = bench.plan.shape
    batch = make_paged_batch(seqs, shape, seed=9, device=bench.device)
    flops = attention_flops(seqs, shape)

    def row(config: KernelConfig | None) -> Report:
        used = config or choose_config(batch.query.shape[0], len(seqs), shape.group)
        try:
            timing = bench.time(lambda: paged_attention(
                *batch.args(), batch.scale, config=config), flush)
        except Exception as err:  # a configuration that does not compile
            return {"config": asdict(used), "error": (str(err).splitlines() or [repr(err)])[0]}
        tflops = flops / timing["median_us"] / 1e6
        return {"config": asdict(used), **timing, "tflops": tflops,
                "fraction_of_matmul": tflops / mm_tflops}

    default = row(None)
    sweep = [row(config) for config in bench.plan.prefill_sweep]
    return {"seqs": f"{len(seqs)} x (context {seqs[0][0]}, new {seqs[0][1]})",
            **shape.to_json(), "flops": flops, "correctness": _check_batch(batch),
            "default": default, "best": _best([default, *sweep], "tflops"), "sweep": sweep}


# %%
# The whole run


def run_bench(bench: Bench, out: Path | None = None,
              engine_throughput: EngineBench | None = None,
              log: Callable[[str], None] | None = None) -> Report:
    """Runs every section of `bench.plan` and returns the report; rewrites `out` (JSON) after
    each section. `engine_throughput`, when given, is called last and its report stored under
    that key (None otherwise)."""
    say = log or (lambda _line: None)
    began = time.perf_counter()
    import triton  # the version only

    report: Report = {"device": _device_name(bench.device), "sm_count": bench.sm_count,
                      "torch": torch.__version__, "triton": triton.__version__}

    def section(name: str, fn: Callable[[], Any]) -> Any:
        say(f"{name} ...")
        report[name] = fn()
        report["wall_s"] = time.perf_counter() - began
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
        return report[name]

    ceilings = section("ceilings", lambda: {"copy": copy_bandwidth(bench),
                                            "matmul_bf16": matmul_tflops(bench)})
    copy_gbps, mm_tflops = ceilings["copy"]["gbps"], ceilings["matmul_bf16"]["tflops"]
    section("correctness", lambda: {"reshape_and_cache": check_reshape_and_cache(bench),
                                    "paged_attention": check_paged_attention(bench)})
    flush = torch.empty(bench.plan.l2_flush_bytes, dtype=torch.uint8, device=bench.device)
    section("decode", lambda: bench_decode(bench, flush, copy_gbps))
    section("decode_long_context_small_batch",
            lambda: bench_split_decode(bench, flush, copy_gbps))
    section("prefill", lambda: bench_prefill(bench, flush, mm_tflops, bench.plan.prefill))
    section("extend", lambda: bench_prefill(bench, flush, mm_tflops, bench.plan.extend))
    section("engine_throughput", lambda: engine_throughput() if engine_throughput else None)
    section("all_correct", lambda: _all_correct(report))
    return report


def _all_correct(report: Report) -> bool:
    checks = [report["correctness"]["reshape_and_cache"],
              *report["correctness"]["paged_attention"],
              *(report[name]["correctness"] for name in
                ("decode", "decode_long_context_small_batch", "prefill", "extend"))]
    return all(check["passed"] for check in checks)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).name)
    return device.type


def run_gpu_bench(out: Path | None = None, engine_throughput: EngineBench | None = None,
                  log: Callable[[str], None] | None = None) -> Report:
    """The H200 plan on the current CUDA device (see `run_bench`). Raises GpuUnavailable
    without CUDA."""
    if not torch.cuda.is_available():
        raise GpuUnavailable("rt bench gpu needs a CUDA device; none is visible")
    device = torch.device("cuda", torch.cuda.current_device())
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    return run_bench(Bench(BenchPlan(), device, cuda_time_ms, sm_count), out,
                     engine_throughput, log)
