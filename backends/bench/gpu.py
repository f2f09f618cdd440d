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
perf_counter timer) in the tests. The plan, timers and ceilings are `backends.bench.timing`;
the random paged batches and their byte and FLOP counts are `backends.bench.paged_batch`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from backends.bench.engine_throughput import EnginePlan, engine_throughput_section
from backends.bench.flags import GpuBenchFlags
from backends.bench.paged_batch import (
    PagedBatch,
    Report,
    Seqs,
    attention_flops,
    decode_bytes,
    make_paged_batch,
)
from backends.bench.timing import Bench, BenchPlan, copy_bandwidth, cuda_time_ms, matmul_tflops
from backends.kernels.paged_attention import (
    KernelConfig,
    choose_config,
    choose_num_segments,
    paged_attention,
)
from backends.kernels.paged_attention_torch import paged_attention_ref
from backends.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

DECODE_GOAL = 0.8  # fraction of the measured copy bandwidth
BF16_RTOL = BF16_ATOL = 1.6e-2
CPU_SM_COUNT = 132  # plan split-KV as for an H200 when there is no CUDA device
EngineBench = Callable[[], Report]


class GpuUnavailable(RuntimeError):
    """No CUDA device: the benchmark cannot run here."""


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


def gpu_bench(flags: GpuBenchFlags, out: Path | None, log: Callable[[str], None]) -> Report:
    """`rt bench gpu`: `run_gpu_bench` with the engine-throughput section --engine asks for.
    Raises GpuUnavailable without CUDA."""
    plan = EnginePlan(num_requests=flags.engine_requests, prompt_len=flags.engine_prompt_len,
                      output_len=flags.engine_output_len, hf_batch_size=flags.hf_batch_size)
    section = engine_throughput_section(flags.engine_model, plan) if flags.engine else None
    return run_gpu_bench(out, engine_throughput=section, log=log)
