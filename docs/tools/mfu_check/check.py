"""runtime.perf against vLLM's own estimate: the same (FLOPs, read bytes, written bytes) per
GPU as vLLM 0.32's `v1/metrics/perf.py` component classes (attention, FFN, unembedding) on
random batches of prefills, chunks and decodes, for dense models with and without tensor and
pipeline parallelism. A development tool (rt's tests never import vLLM):

    OMP_NUM_THREADS=1 /work/vllm-venv/bin/python docs/tools/mfu_check/check.py

Prints "equal on N batches" or stops at the first difference.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from vllm.v1.metrics.perf import (  # noqa: E402
    AttentionMetrics,
    ExecutionContext,
    FfnMetrics,
    UnembedMetrics,
)

from runtime.perf import BatchContext, PerfShape, batch_perf  # noqa: E402

SHAPES = [  # h, L, heads, KV heads, d, I, V, weight/activation/KV bytes, tp, pp
    PerfShape(4096, 32, 32, 8, 128, 14336, 128256, 2, 2, 2),  # llama-3.1-8b
    PerfShape(8192, 80, 64, 8, 128, 28672, 128256, 2, 2, 2, 4, 1),  # llama-3.1-70b, tp 4
    PerfShape(128, 2, 4, 2, 32, 256, 512, 4, 4, 4),  # the tiny Llama in fp32
    PerfShape(5120, 40, 40, 8, 128, 13824, 152064, 2, 2, 1, 8, 3),  # fp8 KV, tp 8, pp 3
    PerfShape(3584, 28, 28, 4, 128, 18944, 152064, 2, 2, 2, 8, 2),  # KV heads < tp
]


def vllm_components(s: PerfShape) -> tuple[object, ...]:
    base = {"num_hidden_layers": s.num_layers, "hidden_size": s.hidden_size,
            "num_attention_heads": s.num_heads, "activation_byte_size": s.activation_bytes,
            "tp_size": s.tensor_parallel_size, "pp_size": s.pipeline_parallel_size,
            "weight_byte_size": s.weight_bytes}
    attention = AttentionMetrics.model_validate({
        **base, "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
        "cache_byte_size": s.cache_bytes, "sliding_window": None, "num_swa_layers": 0})
    ffn = FfnMetrics.model_validate({
        **base, "ffn_tp_size": s.tensor_parallel_size, "ffn_ep_size": 1,
        "intermediate_size": s.intermediate_size, "num_experts": 0, "num_experts_per_tok": 1,
        "moe_intermediate_size": 0, "num_shared_experts": 0, "num_moe_layers": 0})
    unembed = UnembedMetrics.model_validate({
        "hidden_size": s.hidden_size, "vocab_size": s.vocab_size,
        "weight_byte_size": s.weight_bytes, "activation_byte_size": s.activation_bytes,
        "tp_size": s.tensor_parallel_size})
    return attention, ffn, unembed


def main(batches_per_shape: int = 400, seed: int = 1) -> None:
    rng = random.Random(seed)
    checked = 0
    for shape in SHAPES:
        components = vllm_components(shape)
        for _ in range(batches_per_shape):
            theirs, ours = ExecutionContext(), BatchContext()
            for _ in range(rng.choice([0, 1, 2, 5, 30, 256])):
                tokens = rng.choice([1, 1, 1, rng.randint(2, 8192)])
                context = tokens + rng.randint(0, 131072)
                prefill = tokens > 1 or rng.random() < 0.1
                theirs.add(tokens, context, prefill)
                ours.add(tokens, context, prefill)
            want = tuple(sum(sum(getattr(c, f"get_{kind}_breakdown")(theirs, True).values())
                             for c in components)
                         for kind in ("num_flops", "read_bytes", "write_bytes"))
            got = batch_perf(shape, ours)
            if (got.flops, got.read_bytes, got.write_bytes) != want:
                raise SystemExit(f"differ: {shape} {theirs} rt {got} vLLM {want}")
            checked += 1
    print(f"equal on {checked} batches")


if __name__ == "__main__":
    main()
