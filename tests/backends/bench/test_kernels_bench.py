"""`rt bench gpu` off the GPU (one line, exit 2) and the benchmark's pure helpers; its bf16
correctness pass on a GPU (`gpu` marker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from backends.bench.gpu import check_paged_attention, check_reshape_and_cache, run_bench
from backends.bench.paged_batch import (
    LLAMA_8B,
    AttentionShape,
    attention_flops,
    decode_bytes,
    make_paged_batch,
)
from backends.bench.timing import Bench, BenchPlan, cpu_time_ms
from backends.kernels.paged_attention import KernelConfig
from cli import app

# Triton's interpreter converts 1-element arrays to Python ints (loop bounds, branches).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_bench_gpu_without_cuda_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "gpu_bench.json"
    result = CliRunner().invoke(app, ["bench", "gpu", "-o", str(out)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "rt: error: rt bench gpu needs a CUDA device; none is visible"]
    assert not out.exists()


def test_decode_bytes_of_the_goal_shape() -> None:
    """64 x 4096 tokens x 8 KV heads x 128 dims x 2 bytes x (K and V) = 1.07 GB, plus Q, O
    and the block-table entries; split partials add fp32 traffic."""
    shape = AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                           dtype=torch.float32)
    batch = make_paged_batch(((6, 1), (2, 1)), shape, device="cpu")
    kv = 2 * (7 + 3) * 2 * 16 * 4
    q_and_o = 2 * 2 * 4 * 16 * 4
    table = 4 * (2 + 1)
    assert decode_bytes(batch, 1) == kv + q_and_o + table
    assert decode_bytes(batch, 4) == kv + q_and_o + table + 2 * 2 * 4 * 4 * 18 * 4
    full = 64 * 4096 * 8 * 128 * 2 * 2
    assert full == 1 << 30


def test_prefill_flops_follow_the_causal_convention() -> None:
    # 2 S^2 Hq D for a fresh sequence; 4 Hq D (q c + q^2/2) with a cached prefix.
    assert attention_flops(((0, 2048),), LLAMA_8B) == 2 * 2048**2 * 32 * 128
    assert attention_flops(((100, 10),), LLAMA_8B) == 4 * 32 * 128 * (1000 + 50)


def test_bench_batches_have_shuffled_tables_and_nan_tails() -> None:
    shape = AttentionShape(num_q_heads=2, num_kv_heads=1, head_dim=16, block_size=4,
                           dtype=torch.float32)
    batch = make_paged_batch(((5, 1), (0, 3), (8, 1)), shape, nan_tails=True, device="cpu")
    table = batch.block_tables
    owned = table[0, :2].tolist() + table[1, :1].tolist() + table[2, :3].tolist()
    assert sorted(owned) == list(range(6))  # every block handed out once
    last = int(table[0, 1])  # sequence 0 holds 6 tokens: slots 2 and 3 of its block 1 unused
    assert torch.isnan(batch.key_cache[last, 2:]).all()
    assert not torch.isnan(batch.key_cache[last, :2]).any()
    assert not torch.isnan(batch.key_cache[int(table[2, 1])]).any()  # a full block


TINY_PLAN = BenchPlan(
    shape=AttentionShape(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                         dtype=torch.float32),
    copy_gib=1 / 1024, matmul_n=32, decode=(3, 40), split_decode=(2, 70),
    prefill=((0, 20),) * 2, extend=((30, 6),) * 2,
    correctness=(("mixed", ((20, 1), (0, 12), (9, 5))),), correctness_tokens=20,
    decode_sweep=(KernelConfig(16, 16, 4, 2),), prefill_sweep=(KernelConfig(16, 32, 4, 2),),
    warmup=0, repeats=1, l2_flush_bytes=1024)


def test_tiny_plan_runs_on_the_cpu_with_a_plugged_engine_bench(tmp_path: Path) -> None:
    """Every section of the benchmark, under the interpreter with a wall-clock timer; the
    JSON file holds the final report; the engine hook's report is stored as given."""
    out = tmp_path / "bench.json"
    bench = Bench(TINY_PLAN, torch.device("cpu"), cpu_time_ms, sm_count=132)
    report = run_bench(bench, out, engine_throughput=lambda: {"speedup": 5.0})
    assert report["all_correct"] is True
    assert report["engine_throughput"] == {"speedup": 5.0}
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["decode"]["default"]["gbps"] > 0 and "error" not in report["decode"]["best"]
    assert report["prefill"]["default"]["tflops"] > 0
    assert len(report["correctness"]["paged_attention"]) == 3


@pytest.mark.gpu
def test_gpu_bench_correctness_pass() -> None:
    bench = Bench(BenchPlan(), torch.device("cuda"), cpu_time_ms, sm_count=132)
    assert check_reshape_and_cache(bench)["passed"]
    assert all(row["passed"] for row in check_paged_attention(bench))
