"""What one step computes, summarised as the inputs of a step cost model.

Request i of a step schedules q_i new tokens on top of c_i tokens already in its KV cache
(`num_computed_tokens` before the step, prefix-cache hits included). A request is a *decode*
when it computes exactly its one missing token after having produced outputs (q_i = 1 and
c_i = num_tokens - 1 with outputs > 0); every other scheduled request is a *prefill*
(a prompt chunk, or a recompute after preemption). The same features are computed by the
simulator, to predict a step's time, and by the real engine, to fit that prediction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from runtime.outputs import SchedulerOutput
from runtime.request import Request


@dataclass(slots=True)
class BatchFeatures:
    """Treat as immutable. Not frozen: a frozen dataclass is ~3x slower to build, and a
    simulator builds one per step (hundreds of thousands per run).

    Attributes (all token or pair counts):
        num_prefill_tokens: Σ q_i over prefill requests.
        num_decode_tokens: decode requests (one token each).
        num_seqs: scheduled requests R (each produces one row of logits).
        num_prefill_seqs: prefill requests among them.
        prefill_attention_pairs: Σ over prefills of q_i·c_i + q_i·(q_i+1)/2, the causal
            (query, key) pairs of their attention.
        prefill_kv_tokens: Σ over prefills of c_i + q_i, the KV tokens their attention reads.
        decode_kv_tokens: Σ over decodes of c_i + 1, the KV tokens decode attention reads
            (also its (query, key) pairs).
    """

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    num_prefill_seqs: int = 0
    prefill_attention_pairs: int = 0
    prefill_kv_tokens: int = 0
    decode_kv_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """T: every token computed in the step."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def attention_pairs(self) -> int:
        """Σ_i q_i·c_i + q_i·(q_i+1)/2 over all requests."""
        return self.prefill_attention_pairs + self.decode_kv_tokens

    @property
    def kv_tokens_read(self) -> int:
        """Σ_i c_i + q_i over all requests."""
        return self.prefill_kv_tokens + self.decode_kv_tokens


def batch_features(output: SchedulerOutput, requests: Mapping[str, Request]) -> BatchFeatures:
    """Features of a step. Call it between `schedule()` and `update_from_output()`, while
    each request's `num_tokens` is still what it was scheduled against."""
    return describe_batch(output, requests)[0]


def describe_batch(
    output: SchedulerOutput, requests: Mapping[str, Request]
) -> tuple[BatchFeatures, dict[str, str]]:
    """Features of a step, and each scheduled request's kind of work: "decode", "prefill",
    or "preempted" (a prefill-type step of a request that was preempted before, i.e. a
    recompute). Same calling rule as `batch_features`."""
    computed_before: dict[str, int] = {
        new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs
    }
    cached = output.scheduled_cached_reqs
    computed_before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    kinds: dict[str, str] = {}
    prefill_tokens = decode_tokens = prefill_seqs = 0
    prefill_pairs = prefill_kv = decode_kv = 0
    for req_id, q in output.num_scheduled_tokens.items():
        c = computed_before[req_id]
        request = requests[req_id]
        if q == 1 and c + 1 == request.num_tokens > request.num_prompt_tokens:
            kinds[req_id] = "decode"
            decode_tokens += 1
            decode_kv += c + 1
        else:
            kinds[req_id] = "preempted" if request.num_preemptions else "prefill"
            prefill_tokens += q
            prefill_seqs += 1
            prefill_pairs += q * c + q * (q + 1) // 2
            prefill_kv += c + q
    features = BatchFeatures(
        num_prefill_tokens=prefill_tokens,
        num_decode_tokens=decode_tokens,
        num_seqs=len(output.num_scheduled_tokens),
        num_prefill_seqs=prefill_seqs,
        prefill_attention_pairs=prefill_pairs,
        prefill_kv_tokens=prefill_kv,
        decode_kv_tokens=decode_kv,
    )
    return features, kinds
