"""Estimated FLOPs and memory traffic of one engine step, per GPU, as vLLM 0.32 counts them
for `vllm:estimated_flops_per_gpu_total` and `vllm:estimated_{read,write}_bytes_per_gpu_total`
(`--enable-mfu-metrics`; vLLM's `v1/metrics/perf.py`, `ModelMetrics.get_step_perf_stats_per_gpu`).

The estimate is analytic: model shape x scheduled tokens, no measurement. A step's batch is
summed over its scheduled requests (`BatchContext.of`): a request admitted this step counts
as prefill, a running one as prefill when it schedules more than one token (a chunk), else as
decode; its context is the tokens already computed plus those scheduled. Then, per GPU
(heads and the MLP width split by tensor parallelism, layers by pipeline parallelism):

- attention: the q/k/v and output projections (2·T·h·(q + 2kv)·d·L and 2·T·h·q·d·L FLOPs),
  QK^T and AV (2·q·Σ(tokens·context)·d·L each); reads: the projections' inputs and weights,
  the attention inputs (prefill: q and the context's k/v as activations; decode: q as an
  activation, the context's k/v from the KV cache), writes: q/k/v, the KV cache, the output;
- the SiLU-gated MLP: 2·h·3·I·T·L FLOPs; reads and writes of its three GEMMs and the SiLU;
- the LM head over the tokens that need logits (one per prefill request, every decode
  token): 2·N·h·V FLOPs, reading its weight once a step.

Every term is truncated to an integer on its own and the attention layer count is a float
(L / pp), as vLLM does, so the sums equal vLLM's to the byte. rt serves dense, full-attention,
unquantized Llama-family models (`sim.model_config` and the real engine refuse mixture of
experts and sliding windows), so vLLM's MoE, MLA, sliding-window and quantized branches never
apply and are not here. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.outputs import SchedulerOutput


@dataclass(frozen=True, slots=True)
class PerfShape:
    """The model facts the estimate needs (vLLM's parsers read the same from its config).

    Attributes:
        hidden_size: h.
        num_layers: L, all full attention.
        num_heads, num_kv_heads: query and KV heads of the whole model (not per GPU).
        head_dim: d.
        intermediate_size: I, the MLP width.
        vocab_size: V.
        weight_bytes: bytes per weight (the model dtype's).
        activation_bytes: bytes per activation element (the model dtype's).
        cache_bytes: bytes per KV-cache element (the KV cache dtype's).
        tensor_parallel_size, pipeline_parallel_size: GPUs the model is split over.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    weight_bytes: int
    activation_bytes: int
    cache_bytes: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PerfShape.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class StepPerf:
    """One step's estimate on one GPU: FLOPs, bytes read and bytes written."""

    flops: int
    read_bytes: int
    write_bytes: int

    def __add__(self, other: StepPerf) -> StepPerf:
        return StepPerf(self.flops + other.flops, self.read_bytes + other.read_bytes,
                        self.write_bytes + other.write_bytes)


@dataclass(slots=True)
class BatchContext:
    """A step's scheduled requests, summed by phase (vLLM's `ExecutionContext` without its
    per-request list, which only sliding windows need). Tokens and contexts in tokens."""

    num_prefill_requests: int = 0
    prefill_tokens: int = 0
    prefill_context: int = 0
    decode_tokens: int = 0
    decode_context: int = 0
    token_context_product: int = 0  # Σ tokens·context over every request

    def add(self, num_tokens: int, context_len: int, is_prefill: bool) -> None:
        if is_prefill:
            self.num_prefill_requests += 1
            self.prefill_tokens += num_tokens
            self.prefill_context += context_len
        else:
            self.decode_tokens += num_tokens
            self.decode_context += context_len
        self.token_context_product += num_tokens * context_len

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def num_logits_tokens(self) -> int:
        """Tokens that go through the LM head: each prefill's last, every decode token."""
        return self.num_prefill_requests + self.decode_tokens

    @classmethod
    def of(cls, output: SchedulerOutput) -> BatchContext:
        """The batch of one schedule: admitted requests are prefill, running ones prefill
        when they schedule more than one token; context = computed before + scheduled."""
        ctx = cls()
        scheduled = output.num_scheduled_tokens
        for new in output.scheduled_new_reqs:
            n = scheduled.get(new.req_id, 0)
            if n:
                ctx.add(n, new.num_computed_tokens + n, True)
        cached = output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            n = scheduled.get(req_id, 0)
            if n:
                ctx.add(n, computed + n, n > 1)
        return ctx


def step_perf(shape: PerfShape, output: SchedulerOutput) -> StepPerf:
    """vLLM's per-GPU estimate of the step `output` schedules."""
    return batch_perf(shape, BatchContext.of(output))


def batch_perf(shape: PerfShape, ctx: BatchContext) -> StepPerf:
    parts = (_attention(shape, ctx), _mlp(shape, ctx), _lm_head(shape, ctx))
    return StepPerf(*(sum(part[i] for part in parts) for i in range(3)))


def _attention(s: PerfShape, ctx: BatchContext) -> tuple[int, int, int]:
    """(FLOPs, read, write) of the attention blocks; the operand order is vLLM's (floats)."""
    h, d, act, w, cache = s.hidden_size, s.head_dim, s.activation_bytes, s.weight_bytes, \
        s.cache_bytes
    q = max(1, s.num_heads // s.tensor_parallel_size)
    kv = max(1, s.num_kv_heads // s.tensor_parallel_size)
    layers = float(s.num_layers) / s.pipeline_parallel_size  # vLLM: float, per stage
    t, tc = ctx.num_tokens, ctx.token_context_product
    score = int(2 * q * tc * d * layers)  # QK^T, and as much again for AV
    flops = int(2 * t * h * (q + 2 * kv) * d * layers) + int(2 * t * h * q * d * layers) \
        + 2 * score
    inputs = 0.0
    if ctx.prefill_tokens > 0:
        inputs += (ctx.prefill_tokens * q + 2 * ctx.prefill_context * kv) * d * act * layers
    if ctx.decode_tokens > 0:
        inputs += (ctx.decode_tokens * q * d * act * layers
                   + 2 * ctx.decode_context * kv * d * cache * layers)
    read = int(t * h * act * layers) + int(h * (q + 2 * kv) * d * w * layers) + int(inputs) \
        + int(t * q * d * act * layers) + int(q * d * h * w * layers)
    write = int(t * (q + 2 * kv) * d * act * layers) + int(2 * t * kv * d * cache * layers) \
        + int(t * h * act * layers)
    return flops, read, write


def _mlp(s: PerfShape, ctx: BatchContext) -> tuple[int, int, int]:
    """(FLOPs, read, write) of the gated MLPs: up and gate, SiLU, down. Layers per stage and
    the width per GPU are whole numbers here (vLLM's floor division)."""
    layers = s.num_layers // s.pipeline_parallel_size
    if not layers:
        return 0, 0, 0
    h, act, w, t = s.hidden_size, s.activation_bytes, s.weight_bytes, ctx.num_tokens
    width = s.intermediate_size // s.tensor_parallel_size
    flops = 2 * h * 3 * width * t * layers
    read = int(t * h * act * layers) + int(2 * h * width * w * layers) \
        + int(2 * t * width * act * layers) + int(t * width * act * layers) \
        + int(h * width * w * layers)
    write = int(2 * t * width * act * layers) + int(t * width * act * layers) \
        + int(t * h * act * layers)
    return flops, read, write


def _lm_head(s: PerfShape, ctx: BatchContext) -> tuple[int, int, int]:
    """(FLOPs, read, write) of the LM head; its vocabulary is split by tensor parallelism."""
    n, h = ctx.num_logits_tokens, s.hidden_size
    vocab = s.vocab_size // s.tensor_parallel_size
    return 2 * n * h * vocab, n * h * s.activation_bytes + h * vocab * s.weight_bytes, \
        n * vocab * s.activation_bytes
