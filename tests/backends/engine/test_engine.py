"""The real engine against transformers: rt's greedy tokens equal `model.generate`'s token
for token on the tiny random Llama, with plain batches, chunked prefill, prefix caching and
preemption; and the runner's flattened inputs on a hand-made scheduler output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.engine.attention import REFERENCE_OPS
from backends.engine.kv_cache import KVCache, KVCacheSpec
from backends.engine.model import PagedModel, load_model
from backends.engine.model_runner import ModelRunner, _RequestState
from backends.engine.offline import OfflineResult, generate_offline
from backends.engine.tiny_model import build_tiny_llama
from runtime import (
    CacheConfig,
    CachedRequestData,
    NewRequestData,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from runtime.outputs import ReqIdList

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path) -> PagedModel:
    return load_model(tiny_dir, "float32", torch.device("cpu"), REFERENCE_OPS)


def _prompts(lengths: list[int], seed: int, prefix: list[int] | None = None
             ) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"r{i}": (prefix or []) + torch.randint(10, 512, (n,), generator=gen).tolist()
            for i, n in enumerate(lengths)}


PLAIN = _prompts([5, 17, 9, 30, 1, 12], seed=1)
SHARED_PREFIX = _prompts([3, 9, 6, 14], seed=2, prefix=_prompts([21], seed=3)["r0"])


def _reference(model: PagedModel, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """transformers' greedy generation, one prompt at a time."""
    outputs = {}
    for req_id, prompt in prompts.items():
        ids = model.hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                      max_new_tokens=MAX_TOKENS, eos_token_id=None,
                                      pad_token_id=0)
        outputs[req_id] = ids[0, len(prompt):].tolist()
    return outputs


@pytest.fixture(scope="module")
def reference(tiny_model: PagedModel) -> dict[str, dict[str, list[int]]]:
    return {"plain": _reference(tiny_model, PLAIN),
            "prefix": _reference(tiny_model, SHARED_PREFIX)}


def _run(model: PagedModel, prompts: dict[str, list[int]], *, budget: int, num_blocks: int,
         block_size: int = 4, max_num_seqs: int = 8, prefix_caching: bool = False,
         waves: int = 1) -> tuple[OfflineResult, Scheduler]:
    shape = model.shape
    spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, block_size,
                       model.dtype)
    runner = ModelRunner(model, KVCache(spec, num_blocks, model.device))
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                        max_model_len=256),
        CacheConfig(block_size=block_size, num_blocks=num_blocks,
                    enable_prefix_caching=prefix_caching))
    ids = list(prompts)
    size = -(-len(ids) // waves)
    outputs: dict[str, list[int]] = {}
    steps = preemptions = 0
    for start in range(0, len(ids), size):  # later waves can hit earlier waves' blocks
        wave = {req_id: prompts[req_id] for req_id in ids[start:start + size]}
        result = generate_offline(scheduler, runner, wave, MAX_TOKENS, check_invariants=True)
        outputs.update(result.outputs)
        steps += result.num_steps
        preemptions += result.num_preemptions
    return OfflineResult(outputs, steps, preemptions), scheduler


def test_plain_batch_equals_generate(tiny_model: PagedModel, reference: dict) -> None:
    result, _ = _run(tiny_model, PLAIN, budget=512, num_blocks=128)
    assert result.outputs == reference["plain"]
    assert result.num_steps == MAX_TOKENS  # one prefill step, then decodes


def test_chunked_prefill_equals_generate(tiny_model: PagedModel, reference: dict) -> None:
    result, _ = _run(tiny_model, PLAIN, budget=7, num_blocks=128, max_num_seqs=4)
    assert result.outputs == reference["plain"]
    assert result.num_steps > 2 * MAX_TOKENS  # prompts were split over steps


def test_prefix_caching_equals_generate(tiny_model: PagedModel, reference: dict) -> None:
    result, scheduler = _run(tiny_model, SHARED_PREFIX, budget=64, num_blocks=128,
                             prefix_caching=True, waves=2)
    assert scheduler.prefix_cache_stats.hits > 0
    assert result.outputs == reference["prefix"]


def test_prefix_hits_within_one_step_equal_generate(tiny_model: PagedModel,
                                                    reference: dict) -> None:
    result, scheduler = _run(tiny_model, SHARED_PREFIX, budget=16, num_blocks=128,
                             prefix_caching=True)
    assert scheduler.prefix_cache_stats.hits > 0
    assert result.outputs == reference["prefix"]


def test_preemption_equals_generate(tiny_model: PagedModel, reference: dict) -> None:
    result, _ = _run(tiny_model, PLAIN, budget=64, num_blocks=16, prefix_caching=True)
    assert result.num_preemptions > 0
    assert result.outputs == reference["plain"]


def test_preemption_without_prefix_caching(tiny_model: PagedModel, reference: dict) -> None:
    result, _ = _run(tiny_model, PLAIN, budget=64, num_blocks=16)
    assert result.num_preemptions > 0
    assert result.outputs == reference["plain"]


def _hand_made_output() -> SchedulerOutput:
    """A: new, 3 cached + 4 scheduled of 7 tokens (blocks 5, 2); B: running decode at
    position 5 (blocks 7, 3, new 9)."""
    return SchedulerOutput(
        num_scheduled_tokens={"B": 1, "A": 4},
        total_num_scheduled_tokens=5,
        scheduled_new_reqs=[NewRequestData("A", [11, 12, 13, 14, 15, 16, 17], [5, 2], 3)],
        scheduled_resumed_req_ids=ReqIdList(),
        scheduled_cached_reqs=CachedRequestData(["B"], [[9]], [5]),
        preempted_req_ids=ReqIdList(),
        finished_req_ids=ReqIdList(),
        num_waiting=0,
        wait_reason=None,
    )


def test_runner_flattens_a_mixed_step(tiny_model: PagedModel) -> None:
    shape = tiny_model.shape
    spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, 4, torch.float32)
    runner = ModelRunner(tiny_model, KVCache(spec, 16, tiny_model.device))
    runner.states["B"] = _RequestState([20, 21, 22, 23, 24, 25], 5, [7, 3])
    output = _hand_made_output()
    runner.update_states(output)
    inputs = runner.prepare_inputs(output)
    assert inputs.input_ids.tolist() == [25, 14, 15, 16, 17]
    assert inputs.positions.tolist() == [5, 3, 4, 5, 6]
    # B pos 5 -> block 3 (index 1), offset 1; A pos 3 -> block 5 offset 3; 4..6 -> block 2
    assert inputs.meta.slot_mapping.tolist() == [13, 23, 8, 9, 10]
    assert inputs.meta.query_start_loc.tolist() == [0, 1, 5]
    assert inputs.meta.seq_lens.tolist() == [6, 7]
    assert inputs.meta.block_tables.tolist() == [[7, 3, 9], [5, 2, 0]]
    assert inputs.logits_indices.tolist() == [0, 4]
    assert inputs.sampling_req_ids == ["B", "A"]


def test_runner_drops_finished_and_preempted_state(tiny_model: PagedModel) -> None:
    shape = tiny_model.shape
    spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, 4, torch.float32)
    runner = ModelRunner(tiny_model, KVCache(spec, 16, tiny_model.device))
    runner.states.update(B=_RequestState([1, 2], 1, [1]), C=_RequestState([3], 1, [2]),
                         D=_RequestState([4], 1, [3]))
    output = _hand_made_output()
    output.finished_req_ids = ReqIdList(["C"])
    output.preempted_req_ids = ReqIdList(["D"])
    runner.update_states(output)
    assert set(runner.states) == {"A", "B"}
    assert runner.states["B"].block_ids == [1, 9]


def _tiny_family(model_type: str, path: Path) -> Path:
    """A tiny random Qwen2 (q/k/v bias) or Qwen3 (q/k RMSNorm over head_dim) checkpoint:
    4 query heads, 2 KV heads, head_dim 16, fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = classes[model_type]
    config = config_cls(vocab_size=512, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model_cls(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_families_equal_generate(model_type: str, tmp_path: Path) -> None:
    """The bias and q/k-norm branches of the forward: Qwen3's layers carry q_norm/k_norm
    weights and rt applies them, Qwen2's do not; greedy tokens equal transformers'."""
    model = load_model(_tiny_family(model_type, tmp_path / model_type), "float32",
                       torch.device("cpu"), REFERENCE_OPS)
    assert model.shape.model_type == model_type
    assert all((layer.q_norm is not None) == (model_type == "qwen3") for layer in model.layers)
    result, _ = _run(model, PLAIN, budget=512, num_blocks=128)
    assert result.outputs == _reference(model, PLAIN)
