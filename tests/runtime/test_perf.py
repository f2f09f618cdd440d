"""runtime.perf: vLLM 0.32's per-GPU FLOPs and bytes of one step, pinned on a step computed by
hand (vLLM's formulas, v1/metrics/perf.py; the same numbers its classes give)."""

from __future__ import annotations

import pytest

from runtime import CachedRequestData, NewRequestData, SchedulerOutput
from runtime.outputs import ReqIdList
from runtime.perf import BatchContext, PerfShape, StepPerf, step_perf

# The tiny Llama (backends.engine.tiny_model) in fp32: h 128, 2 layers, 4 heads and 2 KV heads
# of 32, MLP 256, vocabulary 512, 4 bytes per weight, activation and KV element.
TINY = PerfShape(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                 intermediate_size=256, vocab_size=512, weight_bytes=4, activation_bytes=4,
                 cache_bytes=4)


def _output(scheduled: dict[str, int], new: dict[str, int],
            running: dict[str, int]) -> SchedulerOutput:
    """`new`/`running`: request id -> tokens computed before the step."""
    return SchedulerOutput(
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_new_reqs=[NewRequestData(r, [], [], c) for r, c in new.items()],
        scheduled_resumed_req_ids=ReqIdList(),
        scheduled_cached_reqs=CachedRequestData(list(running), [[] for _ in running],
                                                list(running.values())),
        preempted_req_ids=ReqIdList(), finished_req_ids=ReqIdList(), num_waiting=0,
        wait_reason=None)


def test_a_prefill_chunk_beside_a_decode_by_hand() -> None:
    """A new request schedules 16 tokens after a 4-token prefix hit (context 20) beside a
    decode at context 10. T = 17 tokens, Σ tokens·context = 16·20 + 10 = 330, logits for
    1 prefill + 1 decode = 2 tokens, L = 2.
    FLOPs: qkv 2·17·128·(4+4)·32·2 = 2,228,224; o 2·17·128·4·32·2 = 1,114,112;
      QK^T and AV 2 x 2·4·330·32·2 = 337,920; MLP 2·128·3·256·17·2 = 6,684,672;
      LM head 2·2·128·512 = 262,144. Sum 10,627,072.
    Read: qkv in 17·128·4·2 = 17,408, weights 128·8·32·4·2 = 262,144; attention in: prefill
      (16·4 + 2·20·2)·32·4·2 = 36,864, decode 1·4·32·4·2 + 2·10·2·32·4·2 = 11,264; o in
      17,408, weights 131,072 (476,160). MLP: 17,408 + 524,288 (up, gate) + 69,632 (SiLU) +
      34,816 (down in) + 262,144 (down) = 908,288. LM head 2·128·4 + 128·512·4 = 263,168.
      Sum 1,647,616.
    Written: q/k/v 17·8·32·4·2 = 34,816, KV cache 2·17·2·32·4·2 = 17,408, o 17,408; MLP
      69,632 + 34,816 + 17,408; logits 2·512·4 = 4,096. Sum 195,584."""
    out = _output({"a": 16, "b": 1}, new={"a": 4}, running={"b": 9})
    assert step_perf(TINY, out) == StepPerf(10_627_072, 1_647_616, 195_584)


def test_the_batch_is_split_as_vllm_splits_it() -> None:
    """Admitted: prefill whatever it schedules; running: prefill when it schedules a chunk
    (more than one token), decode for one; a request scheduling nothing is left out."""
    out = _output({"new1": 1, "run8": 8, "run1": 1, "idle": 0},
                  new={"new1": 0, "idle": 0}, running={"run8": 100, "run1": 50})
    ctx = BatchContext.of(out)
    assert (ctx.num_prefill_requests, ctx.prefill_tokens, ctx.prefill_context) == (2, 9, 109)
    assert (ctx.decode_tokens, ctx.decode_context) == (1, 51)
    assert ctx.token_context_product == 1 + 8 * 108 + 51
    assert ctx.num_logits_tokens == 3


def test_tensor_and_pipeline_parallel_divide_as_vllm() -> None:
    """Per GPU: heads, MLP width and vocabulary / tp (at least one KV head), attention layers
    L / pp as a float, MLP layers L // pp: 2 layers over 4 stages bill no MLP at all."""
    split = PerfShape(**{**{f: getattr(TINY, f) for f in TINY.__slots__},
                         "tensor_parallel_size": 4, "pipeline_parallel_size": 4})
    # q 1, kv max(1, 0) = 1, L 0.5, MLP layers 0, vocabulary 128.
    # FLOPs: 2·1·128·3·32·0.5 + 2·1·128·1·32·0.5 + 2·(2·1·10·32·0.5) + 2·1·128·128.
    assert step_perf(split, _output({"b": 1}, new={}, running={"b": 9})).flops == \
        12_288 + 4_096 + 640 + 32_768


@pytest.mark.parametrize("field", ["hidden_size", "cache_bytes", "tensor_parallel_size"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_a_bad_shape_names_its_field(field: str, value: object) -> None:
    kwargs = {f: getattr(TINY, f) for f in TINY.__slots__}
    with pytest.raises(ValueError, match=f"PerfShape.{field} must be a positive integer"):
        PerfShape(**{**kwargs, field: value})
