"""`RooflineCostModel`: step time from first principles (model shapes, GPU datasheet,
efficiency factors measured elsewhere), per operator: max(FLOPs / achievable FLOP/s, bytes /
achievable B/s), summed, plus tensor-parallel communication and a fixed per-step overhead.

Formulas and numbers: `/work/shared/reference/models_and_gpus.md` (§3 measured efficiencies,
§4 roofline formulas). Times are in seconds, sizes in bytes, rates in FLOP/s or B/s.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from mypy_extensions import mypyc_attr

from runtime.batch import BatchFeatures
from sim.cost.roofline_efficiency import DEFAULT_EFFICIENCY as DEFAULT_EFFICIENCY
from sim.cost.roofline_efficiency import RooflineEfficiency as RooflineEfficiency
from sim.hardware import GpuSpec
from sim.model_config import ModelSpec


@mypyc_attr(allow_interpreted_subclasses=True)  # a user's own step_time
class RooflineCostModel:
    """Per-operator roofline of one step on one GPU of a tensor-parallel group (ref §4).

    With T scheduled tokens, R scheduled requests, tensor-parallel degree t, achievable
    FLOP/s F = η_F · peak and achievable B/s B = η_B · bandwidth, the step takes the sum of:

    * linear layers: max(2 · P_lin · T / t / F, block weight bytes / t / B). Every weight does
      one multiply-add per token (Kaplan et al. 2020, Table 1) and is read once per step.
    * LM head: max(2 · h · V · R / t / F, h · V · b / t / B). vLLM V1 computes logits only
      at the last scheduled token of each request, non-final prefill chunks included.
    * prefill attention: max(4 · L · (n_q/t) · d · Σ[q·c + q(q+1)/2] / F,
      KV bytes per token per GPU · Σ(c + q) / B). QKᵀ and PV cost 2·d FLOPs per
      (query head, key) pair each, causal mask (FlashAttention-2 §4).
    * decode attention: the same with q = 1, over the decode requests.
    * KV write: KV bytes per token per GPU · T / B (`reshape_and_cache`).
    * all-reduce (t > 1): 2 per layer (after o_proj and down_proj, Megatron-style), each
      α + 2 · (t-1)/t · T · h · b / link bandwidth (ring; NCCL busbw = algbw · 2(n-1)/n).
    * overhead: step_overhead_s + per_seq_overhead_s · R.

    KV bytes per token per GPU use max(n_kv / t, 1) heads: vLLM replicates KV heads when
    t > n_kv. Weight bytes per GPU are the model's streamed weights / t. Not modelled:
    activation traffic (matters only at large T, where compute dominates), logits bytes,
    the embedding gather.
    """

    __slots__ = (
        "model",
        "gpu",
        "tensor_parallel_size",
        "efficiency",
        "_lin_s_per_token",
        "_lin_weights_s",
        "_head_s_per_row",
        "_head_weights_s",
        "_attn_s_per_pair",
        "_kv_s_per_token",
        "_comm_fixed_s",
        "_comm_s_per_token",
    )

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        tensor_parallel_size: int = 1,
        efficiency: RooflineEfficiency = DEFAULT_EFFICIENCY,
    ) -> None:
        t = tensor_parallel_size
        kv_bytes_per_token = model.kv_bytes_per_token_per_gpu(t)  # validates t
        self.model = model
        self.gpu = gpu
        self.tensor_parallel_size = t
        self.efficiency = efficiency
        flops = efficiency.flops_efficiency * gpu.bf16_dense_flops  # achievable FLOP/s
        bandwidth = efficiency.memory_efficiency * gpu.mem_bandwidth_Bps  # achievable B/s
        h, b = model.hidden_size, model.dtype_bytes
        block_weight_bytes = model.weight_bytes_read_per_step - model.lm_head_bytes
        # Seconds per unit of each feature, per GPU.
        self._lin_s_per_token = 2 * model.linear_params / t / flops
        self._lin_weights_s = block_weight_bytes / t / bandwidth
        self._head_s_per_row = 2 * h * model.vocab_size / t / flops
        self._head_weights_s = model.lm_head_bytes / t / bandwidth
        q_heads_per_gpu = model.num_q_heads // t
        self._attn_s_per_pair = 4 * model.num_layers * q_heads_per_gpu * model.head_dim / flops
        self._kv_s_per_token = kv_bytes_per_token / bandwidth
        if t > 1:
            allreduces = 2 * model.num_layers
            ring_bytes_per_token = 2 * (t - 1) / t * h * b
            self._comm_fixed_s = allreduces * efficiency.allreduce_latency_s
            self._comm_s_per_token = allreduces * ring_bytes_per_token / gpu.interconnect_Bps
        else:
            self._comm_fixed_s = 0.0
            self._comm_s_per_token = 0.0

    def step_time(self, features: BatchFeatures) -> float:
        """Seconds for one step; 0 for a step with no tokens."""
        tokens = features.num_prefill_tokens + features.num_decode_tokens
        if tokens <= 0:
            return 0.0
        rows = features.num_seqs
        kv = self._kv_s_per_token
        pair = self._attn_s_per_pair
        decode_kv = features.decode_kv_tokens
        linear = max(self._lin_s_per_token * tokens, self._lin_weights_s)
        head = max(self._head_s_per_row * rows, self._head_weights_s)
        prefill_attn = max(pair * features.prefill_attention_pairs, kv * features.prefill_kv_tokens)
        decode_attn = max(pair * decode_kv, kv * decode_kv)
        kv_write = kv * tokens
        comm = self._comm_fixed_s + self._comm_s_per_token * tokens
        eff = self.efficiency
        overhead = eff.step_overhead_s + eff.per_seq_overhead_s * rows
        return linear + head + prefill_attn + decode_attn + kv_write + comm + overhead

    def decode_run_times(self, num_seqs: int, decode_kv_tokens: int,
                         count: int) -> list[float]:
        """`step_time` of `count` decode-only steps of `num_seqs` sequences, step k with
        `decode_kv_tokens + k * num_seqs` decode KV tokens: bit for bit the same floats (the
        same operations in the same order; only the terms that do not change are hoisted)."""
        tokens = rows = num_seqs
        if tokens <= 0:
            return [0.0] * count
        kv = self._kv_s_per_token
        pair = self._attn_s_per_pair
        linear = max(self._lin_s_per_token * tokens, self._lin_weights_s)
        head = max(self._head_s_per_row * rows, self._head_weights_s)
        prefill_attn = max(pair * 0, kv * 0)
        kv_write = kv * tokens
        comm = self._comm_fixed_s + self._comm_s_per_token * tokens
        eff = self.efficiency
        overhead = eff.step_overhead_s + eff.per_seq_overhead_s * rows
        fixed = linear + head + prefill_attn
        # max(pair * d, kv * d) == max(pair, kv) * d for d >= 0: rounding is monotonic
        per_kv = max(pair, kv)
        return [fixed + per_kv * (decode_kv_tokens + k * num_seqs) + kv_write + comm + overhead
                for k in range(count)]

    def breakdown(self, features: BatchFeatures) -> dict[str, float]:
        """Seconds per term of `step_time` (same order, same sum); all 0 for no tokens."""
        tokens = features.num_tokens
        names = ("linear", "lm_head", "prefill_attention", "decode_attention", "kv_write")
        if tokens <= 0:
            return dict.fromkeys((*names, "allreduce", "overhead"), 0.0)
        rows, kv, pair = features.num_seqs, self._kv_s_per_token, self._attn_s_per_pair
        eff = self.efficiency
        return {
            "linear": max(self._lin_s_per_token * tokens, self._lin_weights_s),
            "lm_head": max(self._head_s_per_row * rows, self._head_weights_s),
            "prefill_attention": max(
                pair * features.prefill_attention_pairs, kv * features.prefill_kv_tokens
            ),
            "decode_attention": max(
                pair * features.decode_kv_tokens, kv * features.decode_kv_tokens
            ),
            "kv_write": kv * tokens,
            "allreduce": self._comm_fixed_s + self._comm_s_per_token * tokens,
            "overhead": eff.step_overhead_s + eff.per_seq_overhead_s * rows,
        }

    def describe(self) -> dict[str, Any]:
        """JSON-ready parameters: model, GPU, tensor-parallel degree, efficiency factors."""
        return {
            "kind": "roofline",
            "model": self.model.describe(),
            "gpu": asdict(self.gpu),
            "tensor_parallel_size": self.tensor_parallel_size,
            "efficiency": asdict(self.efficiency),
        }

    def __repr__(self) -> str:
        return (
            f"RooflineCostModel(model={self.model.name!r}, gpu={self.gpu.name!r}, "
            f"tensor_parallel_size={self.tensor_parallel_size}, efficiency={self.efficiency!r})"
        )
