"""The engine-vs-transformers throughput comparison of `rt bench gpu`, on the CPU with the
tiny random Llama in fp32: both throughputs, the ratio, and token-for-token agreement."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.bench.engine_throughput import (
    GOAL_RATIO,
    EnginePlan,
    blocks_needed,
    compare_outputs,
    engine_throughput_section,
    engine_vs_generate,
    explain_mismatches,
    left_pad,
    make_prompts,
)
from backends.engine.tiny_model import build_random_llama, build_tiny_llama

TINY_PLAN = EnginePlan(num_requests=3, prompt_len=12, output_len=5, hf_batch_size=2,
                       num_compared=3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_prompts_are_seeded_and_spread() -> None:
    plan = EnginePlan(num_requests=20, prompt_len=40, output_len=3, seed=7)
    prompts = make_prompts(plan, vocab_size=100)
    assert prompts == make_prompts(plan, vocab_size=100)
    lengths = [len(p) for p in prompts.values()]
    assert min(lengths) >= 30 and max(lengths) <= 50 and len(set(lengths)) > 1
    assert all(10 <= t < 100 for p in prompts.values() for t in p)
    assert blocks_needed({"a": [1] * 13}, 3, 4) == 1 + 4


def test_left_pad_and_compare() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, device=__import__("torch").device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    report = compare_outputs({"a": [1, 2], "b": [1, 2]}, {"a": [1, 2], "b": [1, 3]}, ["a", "b"])
    assert not report["all_equal"]
    assert [r["first_mismatch"] for r in report["requests"]] == [None, 1]


def test_engine_vs_generate_on_cpu(tiny_dir: Path) -> None:
    report = engine_vs_generate(tiny_dir, "cpu", "float32", TINY_PLAN)
    rt, hf = report["rt"], report["transformers"]
    assert rt["output_tokens"] == hf["output_tokens"] == 3 * 5
    assert rt["output_tokens_per_s"] > 0 and hf["output_tokens_per_s"] > 0
    assert report["ratio"] == pytest.approx(rt["output_tokens_per_s"]
                                            / hf["output_tokens_per_s"])
    assert report["goal_ratio"] == GOAL_RATIO
    assert rt["num_preemptions"] == 0
    assert hf["batch_size"] == 2 and hf["num_batches"] == 2
    assert report["agreement"]["all_equal"], report["agreement"]
    assert report["config"]["engine"]["cache_config"]["enable_prefix_caching"] is False


def test_section_reports_errors_instead_of_raising(tmp_path: Path) -> None:
    report = engine_throughput_section(str(tmp_path / "missing"), TINY_PLAN, "cpu")()
    assert "error" in report and "--engine-model" in report["error"]


def test_build_random_llama_small_shape(tmp_path: Path) -> None:
    shape = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 8, "max_position_embeddings": 64, "tie_word_embeddings": True,
             "pad_token_id": 0}
    path = build_random_llama(tmp_path / "m", shape, dtype="float32", init_device="cpu")
    assert (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    assert build_random_llama(path, {}) == path  # reused, not rebuilt
    report = engine_vs_generate(path, "cpu", "float32",
                                EnginePlan(num_requests=2, prompt_len=6, output_len=3))
    assert report["rt"]["output_tokens"] == 6


def test_a_mismatch_is_explained_by_the_reference_logits(tiny_dir: Path) -> None:
    """Where rt's greedy token differs, the report gives the reference model's logits for
    both tokens after the agreed prefix: hand-made outputs that agree on one token, then
    differ (transformers' pick is the reference's argmax, rt's the runner-up)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = [11, 12, 13, 14, 15]
    with torch.inference_mode():
        first = int(model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())
        logits = model(input_ids=torch.tensor([prompt + [first]])).logits[0, -1]
    top, second = torch.topk(logits, 2).indices.tolist()
    ours, theirs = {"a": [first, second], "b": [first]}, {"a": [first, top], "b": [first]}
    report = explain_mismatches(compare_outputs(ours, theirs, ["a", "b"]), model,
                                {"a": prompt, "b": prompt}, ours, theirs)
    a, b = report["requests"]
    assert a["first_mismatch"] == 1 and "at_mismatch" not in b
    at = a["at_mismatch"]
    assert at["theirs_logit"] == pytest.approx(float(logits[top]), abs=1e-5)
    assert at["ours_logit"] == pytest.approx(float(logits[second]), abs=1e-5)
    assert at["gap"] == pytest.approx(at["top2_gap"], abs=1e-6) and at["gap"] > 0
    assert at["dtype"] == "float32"
    assert at["resolution"] == pytest.approx(torch.finfo(torch.float32).eps
                                             * abs(float(logits[top])))
