"""The runner's sampler: greedy, temperature with top-k / top-p, seeded reproducibility, and
the min_tokens mask on EOS/stop tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.engine.attention import REFERENCE_OPS
from backends.engine.kv_cache import KVCache, KVCacheSpec
from backends.engine.model import load_model
from backends.engine.model_runner import ModelRunner, _RequestState
from backends.engine.sampling_options import SamplingOptions
from backends.engine.tiny_model import build_tiny_llama


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path: Path = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")
    model = load_model(path, "float32", torch.device("cpu"), REFERENCE_OPS)
    shape = model.shape
    spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, 4, model.dtype)
    return ModelRunner(model, KVCache(spec, 8, model.device), seed=0)


def _logits(rows: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 50, generator=torch.Generator().manual_seed(seed)) * 3


def _setup(runner: ModelRunner, options: SamplingOptions, outputs: int = 0) -> list[str]:
    ids = ["a", "b"]
    for req_id in ids:
        runner.states[req_id] = _RequestState([1, 2, 3] + [4] * outputs, 3, [1])
        runner.register(req_id, options)
    return ids


def test_greedy_is_argmax(runner: ModelRunner) -> None:
    logits = _logits()
    ids = _setup(runner, SamplingOptions())
    assert runner.sample(logits, ids) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("options", [SamplingOptions(temperature=1.0, top_k=1),
                                     SamplingOptions(temperature=1.0, top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_are_greedy(runner: ModelRunner,
                                           options: SamplingOptions) -> None:
    logits = _logits(seed=1)
    ids = _setup(runner, options)
    assert runner.sample(logits, ids) == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best(runner: ModelRunner) -> None:
    logits = _logits(rows=1, seed=2)
    best = set(torch.topk(logits[0], 3).indices.tolist())
    runner.states["a"] = _RequestState([1], 1, [1])
    runner.register("a", SamplingOptions(temperature=5.0, top_k=3, seed=1))
    draws = {runner.sample(logits, ["a"])[0] for _ in range(60)}
    assert draws <= best and len(draws) > 1


def test_seeded_requests_reproduce(runner: ModelRunner) -> None:
    logits = _logits(seed=3)
    first = []
    for _ in range(2):
        ids = _setup(runner, SamplingOptions(temperature=2.0, seed=42))
        first.append([runner.sample(logits, ids) for _ in range(5)])
    assert first[0] == first[1]
    assert len({tuple(draw) for draw in first[0]}) > 1  # it does sample


def test_min_tokens_masks_stop_tokens(runner: ModelRunner) -> None:
    logits = _logits(seed=4)
    top = logits.argmax(-1).tolist()
    second = torch.topk(logits, 2).indices[:, 1].tolist()
    options = SamplingOptions(min_tokens=2, stop_token_ids=tuple(top))
    ids = _setup(runner, options, outputs=1)
    assert runner.sample(logits, ids) == second
    ids = _setup(runner, options, outputs=2)  # min_tokens reached: no mask
    assert runner.sample(logits, ids) == top


def test_sampling_options_are_validated() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingOptions(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingOptions(temperature=-1.0)


def test_extreme_temperature_and_top_p_still_sample_a_token() -> None:
    """Found by the API fuzzer (tests/backends/serve/test_fuzz.py): a temperature past
    float32's max turned a masked logit into nan (-inf / inf), and a subnormal top_p dropped
    every token; both made torch.multinomial raise, which killed the engine process."""
    import torch

    from backends.engine.model_runner import ModelRunner
    from backends.engine.sampling_options import SamplingOptions

    row = torch.randn(64)
    row[3] = float("-inf")  # a min_tokens stop mask
    generator = torch.Generator().manual_seed(0)
    for options in (SamplingOptions(temperature=1e39), SamplingOptions(1.0, top_p=5e-324)):
        token = ModelRunner._sample_row(row, options, generator)
        assert 0 <= token < 64 and token != 3


@pytest.mark.parametrize(("penalty", "logits", "token"), [
    # 1e-244 is 0 in float32: a positive logit of the prompt times 1/0 is +inf (token 2)
    (1e-244, [0.5, -1.0, 2.0, 0.25], 2),
    # past float32's max the penalty is inf: the prompt's 0 logit times it is nan (token 1)
    (1e300, [0.5, 0.0, -2.0, 3.0], 1),
])
def test_non_finite_penalized_logits_sample_as_vllms_cpu_sampler(
        penalty: float, logits: list[float], token: int) -> None:
    """Found by the API fuzzer: a `repetition_penalty` of 1e-244 (vLLM's rule: > 0) made a
    logit +inf, softmax nan, and torch.multinomial raised, which killed the engine process.
    vLLM's CPU sampler takes argmax(logits + finite Gumbel noise): the first nan, else the
    first +inf. The prompt here is tokens 1 and 2."""
    from backends.engine.logits_ops import apply_penalties

    options = SamplingOptions(1.0, repetition_penalty=penalty)
    row = apply_penalties(torch.tensor(logits), [1, 2], [], options)
    assert not torch.isfinite(row).all()
    generator = torch.Generator().manual_seed(0)
    assert ModelRunner._sample_row(row, options, generator) == token
    everything_masked = torch.full((4,), float("-inf"))  # softmax: all nan
    assert ModelRunner._sample_row(everything_masked, options, generator) == 0


# ---- penalties and logit_bias (vLLM V1's Sampler: min_tokens, logit_bias, then repetition,
# frequency and presence penalties, then greedy / temperature) ----------------------------

ROW = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]  # binary-exact, so every expected value is exact
PROMPT, OUTPUT = [0, 1], [3, 3, 2]  # token 3 twice in the output, 2 once; 0, 1 in the prompt


@pytest.mark.parametrize(("options", "expected"), [
    # repetition: tokens of the prompt or the output; positive / 2, negative * 2
    (SamplingOptions(repetition_penalty=2.0), [1.0, -2.0, 0.25, 1.5, -2.0, 0.0]),
    # frequency: minus 0.5 per occurrence in the output (the prompt does not count)
    (SamplingOptions(frequency_penalty=0.5), [2.0, -1.0, 0.0, 2.0, -2.0, 0.0]),
    # presence: minus 0.25 once per token of the output
    (SamplingOptions(presence_penalty=0.25), [2.0, -1.0, 0.25, 2.75, -2.0, 0.0]),
    # all three, in vLLM's order: repetition, then frequency, then presence
    (SamplingOptions(presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=2.0),
     [1.0, -2.0, -0.5, 0.25, -2.0, 0.0]),
    # logit_bias adds to the listed ids only
    (SamplingOptions(logit_bias=((4, 100.0), (0, -0.5))), [1.5, -1.0, 0.5, 3.0, 98.0, 0.0]),
])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_penalties_and_bias_on_a_hand_made_row(options: SamplingOptions,
                                               expected: list[float], device: str) -> None:
    from backends.engine.logits_ops import apply_logit_bias, apply_penalties

    row = torch.tensor(ROW, device=device)
    got = apply_penalties(apply_logit_bias(row, options.logit_bias), PROMPT, OUTPUT, options)
    assert got.tolist() == expected
    assert row.tolist() == ROW  # the input is not modified


def _one_row(runner: ModelRunner, options: SamplingOptions, row: list[float]) -> int:
    runner.states["p"] = _RequestState(PROMPT + OUTPUT, len(PROMPT), [1])
    runner.register("p", options)
    return runner.sample(torch.tensor([row]), ["p"])[0]


def test_penalties_change_greedy_and_sampled_choices(runner: ModelRunner) -> None:
    """Token 3 (in the output twice) leads token 5 (in neither) by 0.5; a penalty makes
    token 5 win, for a greedy request and before top-k of a sampled one (top_k=1: the best
    left)."""
    row = [0.0, -1.0, 0.5, 3.0, -2.0, 2.5]
    assert _one_row(runner, SamplingOptions(), row) == 3
    for options in (SamplingOptions(frequency_penalty=0.3),
                    SamplingOptions(presence_penalty=0.6),
                    SamplingOptions(repetition_penalty=1.3),
                    SamplingOptions(temperature=0.5, top_k=1, seed=0, frequency_penalty=0.3)):
        assert _one_row(runner, options, row) == 5, options


def test_logit_bias_applies_before_the_repetition_penalty(runner: ModelRunner) -> None:
    """vLLM's order: token 3's 1.0 + bias 1.0 = 2.0, then / 2 (repetition) = 1.0, below token
    5's 1.2 (penalized first, it would be 1.0 / 2 + 1.0 = 1.5 and win)."""
    row = [0.0, -1.0, 0.5, 1.0, -2.0, 1.2]
    assert _one_row(runner, SamplingOptions(repetition_penalty=2.0,
                                            logit_bias=((3, 1.0),)), row) == 5
    assert _one_row(runner, SamplingOptions(logit_bias=((3, 1.0),)), row) == 3


def test_penalty_options_are_validated() -> None:
    for kwargs, name in (({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"frequency_penalty": -2.1}, "frequency_penalty"),
                         ({"repetition_penalty": 0.0}, "repetition_penalty"),
                         ({"logit_bias": ((1, 101.0),)}, "logit_bias")):
        with pytest.raises(ValueError, match=name):
            SamplingOptions(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_repetition_penalty_rounds_as_vllm_on_each_device(device: str) -> None:
    """vLLM divides a positive logit by the penalty in its CUDA kernel and multiplies by the
    reciprocal in its torch path (CPU); in fp32, 3.3 / 1.1 and 3.3 * (1 / 1.1) differ."""
    from backends.engine.logits_ops import apply_penalties

    row = torch.tensor([3.3, -3.3, 1.0], device=device)
    penalty = torch.tensor(1.1, device=device)
    divided, times_reciprocal = (row[0] / penalty).item(), (row[0] * (1.0 / penalty)).item()
    assert divided != times_reciprocal
    got = apply_penalties(row, [0, 1], [], SamplingOptions(repetition_penalty=1.1)).tolist()
    assert got[0] == (divided if device == "cuda" else times_reciprocal)
    assert got[1:] == [(row[1] * penalty).item(), 1.0]
