"""Step cost models: how long one engine step takes, from the step's `BatchFeatures`.

Two models share the `CostModel` protocol:

* `RooflineCostModel` predicts from first principles (model shapes, GPU datasheet, efficiency
  factors measured elsewhere), per operator: max(FLOPs / achievable FLOP/s, bytes /
  achievable B/s), summed, plus tensor-parallel communication and a fixed per-step overhead.
* `ProfileCostModel` is a fitted non-negative linear combination of the step features,
  loaded from a JSON profile (`sim.profile`).

Also here: the KV-pool size vLLM would allocate (`kv_cache_sizing`) with vLLM's two start-up
lines, and the API-server cost per request (`ApiServerCost`).

Formulas and numbers: `/work/shared/reference/models_and_gpus.md` (§3 measured efficiencies,
§4 roofline formulas). Times are in seconds, sizes in bytes, rates in FLOP/s or B/s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol, runtime_checkable

from runtime.batch import BatchFeatures
from sim.hardware import GIB, GpuSpec
from sim.model_config import ModelSpec


@runtime_checkable
class CostModel(Protocol):
    """What the simulator asks of a cost model."""

    def step_time(self, features: BatchFeatures) -> float:
        """Seconds one engine step with these features takes (0 for an empty step)."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-ready parameters, recorded in the run's run.json."""
        ...


DecodeRunTimes = Callable[[int, int, int], list[float]]
"""(num_seqs, decode_kv_tokens, count) -> the `step_time` of `count` plain decode steps of
`num_seqs` sequences, step k reading `decode_kv_tokens + k * num_seqs` KV tokens."""


def decode_run_timer(model: CostModel) -> DecodeRunTimes | None:
    """The model's `decode_run_times` (the same floats as `step_time`, in bulk) when the
    class that defines its `step_time` defines one; None otherwise (time each step)."""
    cls = type(model)
    owner = next((k for k in cls.__mro__ if "step_time" in vars(k)), None)
    if (owner is not None and "decode_run_times" in vars(owner)
            and "step_time" not in getattr(model, "__dict__", {})):
        return model.decode_run_times  # type: ignore[attr-defined,no-any-return]
    return None


def _check_number(owner: str, field: str, value: object, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{owner}.{field} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{owner}.{field} must be a {kind} finite number, got {value!r}")


# --------------------------------------------------------------------------------------------
# Roofline


@dataclass(frozen=True, slots=True)
class RooflineEfficiency:
    """Fractions of the datasheet peaks a real step achieves, and the costs no roofline sees.

    Attributes:
        flops_efficiency: η_F, achieved / peak dense FLOP/s for matmuls and attention.
            0.8: a square 8192³ bf16 matmul on the target H200 ran at 769-798 TFLOP/s, 78-81%
            of 989 (ref §3a); the ml-engineering MAMF table gives 80.3% on H100 SXM (§3b).
        memory_efficiency: η_B, achieved / peak memory bandwidth for streaming reads and
            writes (weights, KV). 0.9: device-to-device copy on the H200 reached ~4.3 of
            4.8 TB/s (§3a); vLLM's FP8-KV blog's ITL slopes per context token put decode KV
            reads at 90% of peak on H100 and 91% on B200 (§3c).
        step_overhead_s: fixed time per step beyond the roofline terms, seconds (scheduling,
            input preparation, sampling, launch gaps). 1.5 ms: the vLLM FP8-KV blog fits
            Llama-3.1-8B on H100 (vLLM 0.19.1, concurrency 1, BF16 KV) to ITL = 6.44 ms +
            4.37e-5 ms/token (§3c); its weight read at η_B is 15.01e9 B / (0.9 · 3.35e12 B/s)
            = 4.98 ms, leaving 1.46 ms. The same fit on B200 leaves 3.93 - 2.08 = 1.85 ms.
        per_seq_overhead_s: CPU time per scheduled request, seconds. 1.1 µs: vLLM V1's
            `Scheduler.update_from_output()` takes 0.287 ms at 256 requests (PR #46112, §3d).
        allreduce_latency_s: fixed latency α of one tensor-parallel all-reduce, seconds.
            25 µs: Vidur's H100 DGX profile at TP8 gives 23-37 µs at 2,048 fp16 elements and
            34-39 µs at 1-2M elements, whose ring traffic at 450 GB/s is 8-16 µs (§3e).
    """

    flops_efficiency: float = 0.8
    memory_efficiency: float = 0.9
    step_overhead_s: float = 1.5e-3
    per_seq_overhead_s: float = 1.1e-6
    allreduce_latency_s: float = 25e-6

    def __post_init__(self) -> None:
        for name in ("flops_efficiency", "memory_efficiency"):
            _check_number("RooflineEfficiency", name, getattr(self, name), positive=True)
            if getattr(self, name) > 1:
                raise ValueError(
                    f"RooflineEfficiency.{name} must be at most 1, got {getattr(self, name)!r}"
                )
        for name in ("step_overhead_s", "per_seq_overhead_s", "allreduce_latency_s"):
            _check_number("RooflineEfficiency", name, getattr(self, name), positive=False)


DEFAULT_EFFICIENCY = RooflineEfficiency()


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


# --------------------------------------------------------------------------------------------
# Fitted profile


@dataclass(frozen=True, slots=True)
class ProfileCoefficients:
    """Non-negative coefficients of the fitted step time (seconds per unit of each feature).

    step time = constant_s + per_prefill_token_s · num_prefill_tokens
              + per_decode_token_s · num_decode_tokens + per_seq_s · num_seqs
              + per_prefill_attention_pair_s · prefill_attention_pairs
              + per_decode_kv_token_s · decode_kv_tokens
    """

    constant_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_seq_s: float
    per_prefill_attention_pair_s: float
    per_decode_kv_token_s: float

    def __post_init__(self) -> None:
        for field in fields(self):
            _check_number(
                "ProfileCoefficients", field.name, getattr(self, field.name), positive=False
            )


class ProfileCostModel:
    """Step time as the fitted non-negative linear combination of `ProfileCoefficients`."""

    __slots__ = ("coefficients", "metadata")

    def __init__(
        self, coefficients: ProfileCoefficients, metadata: Mapping[str, Any] | None = None
    ) -> None:
        """`metadata`: JSON-ready facts about where the coefficients came from (device,
        model, date, file), copied into `describe()`."""
        self.coefficients = coefficients
        self.metadata: dict[str, Any] = dict(metadata or {})

    def step_time(self, features: BatchFeatures) -> float:
        """Seconds for one step; 0 for a step with no tokens."""
        prefill, decode = features.num_prefill_tokens, features.num_decode_tokens
        if prefill + decode <= 0:
            return 0.0
        c = self.coefficients
        return (
            c.constant_s
            + c.per_prefill_token_s * prefill
            + c.per_decode_token_s * decode
            + c.per_seq_s * features.num_seqs
            + c.per_prefill_attention_pair_s * features.prefill_attention_pairs
            + c.per_decode_kv_token_s * features.decode_kv_tokens
        )

    def decode_run_times(self, num_seqs: int, decode_kv_tokens: int,
                         count: int) -> list[float]:
        """`step_time` of `count` decode-only steps (see `RooflineCostModel`'s): the same
        floats, with the terms that do not change computed once."""
        if num_seqs <= 0:
            return [0.0] * count
        c = self.coefficients
        fixed = (
            c.constant_s
            + c.per_prefill_token_s * 0
            + c.per_decode_token_s * num_seqs
            + c.per_seq_s * num_seqs
            + c.per_prefill_attention_pair_s * 0
        )
        per_kv = c.per_decode_kv_token_s
        return [fixed + per_kv * (decode_kv_tokens + k * num_seqs) for k in range(count)]

    def describe(self) -> dict[str, Any]:
        """JSON-ready coefficients and the profile's metadata."""
        return {**self.metadata, "kind": "profile", "coefficients": asdict(self.coefficients)}

    def __repr__(self) -> str:
        return f"ProfileCostModel({self.coefficients!r})"


# --------------------------------------------------------------------------------------------
# API server


@dataclass(frozen=True, slots=True)
class ApiServerCost:
    """CPU time the API server spends on a request before the engine sees it, seconds.

    Attributes:
        per_request_s: HTTP handling, request validation and input processing per request.
            0.5 ms: an assumption of order of magnitude (an ASGI request with pydantic
            validation is ~0.1 ms; vLLM's chat templating and engine hand-off add more).
            Calibration replaces it.
        per_prompt_token_s: tokenization per prompt token. 1 µs: Hugging Face tokenizers
            (Rust) tokenize a GB of text in under 20 s on a server's CPU (its README), about
            12.5M tokens/s at ~4 bytes per token over all threads; one request is encoded on
            one thread, so ~1M tokens/s assuming ~12-16 threads in that figure.
    """

    per_request_s: float = 0.5e-3
    per_prompt_token_s: float = 1e-6

    def __post_init__(self) -> None:
        _check_number("ApiServerCost", "per_request_s", self.per_request_s, positive=False)
        _check_number(
            "ApiServerCost", "per_prompt_token_s", self.per_prompt_token_s, positive=False
        )

    def time(self, prompt_len: int) -> float:
        """Seconds to accept and tokenize a prompt of `prompt_len` tokens."""
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 0:
            raise ValueError(f"prompt_len must be a non-negative integer, got {prompt_len!r}")
        return self.per_request_s + self.per_prompt_token_s * prompt_len


# --------------------------------------------------------------------------------------------
# KV pool sizing


# Memory vLLM's profiling run finds taken besides weights and KV: the activation peak of a
# max_num_batched_tokens forward pass plus non-torch allocations (NCCL, CUDA context). vLLM
# profiling logs for Llama-3.1-8B bf16 on 80 GB parts print "PyTorch activation peak memory
# takes 1.19GiB" / "1.20GiB" with "non_torch_memory takes 0.11GiB" / "0.12GiB", ~1.31 GiB in
# all; rounded up to 1.5 GiB to leave room for CUDA graph buffers, which newer V1 versions
# also subtract. A constant: larger models and longer batches need a larger value.
DEFAULT_ACTIVATION_RESERVE_BYTES = 3 * GIB // 2
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92  # the stated vLLM default
DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size on CUDA


@dataclass(frozen=True, slots=True)
class KvCacheSizing:
    """The KV pool vLLM would allocate on each GPU, and how it was derived (bytes).

    Attributes:
        num_gpu_blocks: KV blocks per GPU (the engine's num_gpu_blocks).
        block_size: tokens per block.
        requested_memory_bytes: ceil(total visible memory · gpu_memory_utilization).
        weight_bytes_per_gpu: the model's weights / tensor-parallel degree.
        activation_reserve_bytes: activation peak and non-torch memory set aside.
        kv_cache_bytes: what is left for the KV cache.
        kv_bytes_per_token_per_gpu: one token's K and V over all layers on one GPU.
    """

    num_gpu_blocks: int
    block_size: int
    requested_memory_bytes: int
    weight_bytes_per_gpu: int
    activation_reserve_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token_per_gpu: int

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds: num_gpu_blocks · block_size."""
        return self.num_gpu_blocks * self.block_size

    def startup_lines(self, max_model_len: int) -> list[str]:
        """vLLM's two start-up lines for this pool."""
        return startup_lines(self.num_gpu_blocks, self.block_size, max_model_len)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def kv_cache_sizing(
    model: ModelSpec,
    gpu: GpuSpec,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    block_size: int = DEFAULT_BLOCK_SIZE,
    activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
) -> KvCacheSizing:
    """vLLM V1's KV pool per GPU: requested = ceil(total · utilisation) (vllm/v1/worker/
    utils.py); KV memory = requested - weights per GPU - reserve (gpu_worker.py); blocks =
    KV memory // (block_size · KV bytes per token per GPU) (kv_cache_utils.get_num_blocks).
    ValueError when the weights and reserve leave no room for one block."""
    t = _check_int("tensor_parallel_size", tensor_parallel_size, 1)
    _check_int("block_size", block_size, 1)
    _check_int("activation_reserve_bytes", activation_reserve_bytes, 0)
    utilization = gpu_memory_utilization
    _check_number("kv_cache_sizing", "gpu_memory_utilization", utilization, positive=True)
    if utilization > 1:
        raise ValueError(f"gpu_memory_utilization must be at most 1, got {utilization!r}")
    kv_per_token = model.kv_bytes_per_token_per_gpu(t)
    requested = math.ceil(gpu.total_memory_bytes * utilization)
    weights = -(-model.weight_bytes // t)
    available = requested - weights - activation_reserve_bytes
    block_bytes = block_size * kv_per_token
    if available < block_bytes:
        raise ValueError(
            f"{model.name} does not fit on {gpu.name} at tensor_parallel_size={t}: weights "
            f"{weights:,} B per GPU + reserve {activation_reserve_bytes:,} B leave "
            f"{available:,} B of {requested:,} B ({utilization} x {gpu.total_memory_bytes:,} B), "
            f"less than one KV block of {block_bytes:,} B"
        )
    return KvCacheSizing(
        num_gpu_blocks=available // block_bytes,
        block_size=block_size,
        requested_memory_bytes=requested,
        weight_bytes_per_gpu=weights,
        activation_reserve_bytes=activation_reserve_bytes,
        kv_cache_bytes=available,
        kv_bytes_per_token_per_gpu=kv_per_token,
    )


def startup_lines(num_gpu_blocks: int, block_size: int, max_model_len: int) -> list[str]:
    """vLLM's two start-up lines, character for character (vllm/v1/core/kv_cache_utils.py,
    `_report_kv_cache_config`): the pool in tokens (num_blocks · block_size) and the number
    of max_model_len requests it holds, num_blocks / cdiv(max_model_len, block_size); both
    counts with thousands separators, the ratio to two decimals."""
    _check_int("num_gpu_blocks", num_gpu_blocks, 0)
    _check_int("block_size", block_size, 1)
    _check_int("max_model_len", max_model_len, 1)
    num_tokens = num_gpu_blocks * block_size
    blocks_per_request = -(-max_model_len // block_size)
    max_concurrency = num_gpu_blocks / blocks_per_request
    return [
        f"GPU KV cache size: {num_tokens:,} tokens",
        f"Maximum concurrency for {max_model_len:,} tokens per request: {max_concurrency:.2f}x",
    ]
