"""How a benchmark plan runs and is timed: the plan's sizes (`BenchPlan`), the timers
(CUDA events with the L2 flushed before each repeat, or perf_counter for the CPU smoke run),
and the ceilings measured in the same run (device-to-device copy bandwidth, bf16 matmul).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backends.bench.paged_batch import LLAMA_8B, AttentionShape, Report, Seqs
from backends.kernels.paged_attention import KernelConfig

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
