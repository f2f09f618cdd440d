"""`RequestParser.parse` against vLLM 0.32's request rules, at the parser (no server).

vLLM refuses `stream_options` without `stream=true` only when the value is truthy
(`validate_stream_options`: `data.get("stream_options") and not data.get("stream")`): an
empty object or a null is served, a non-object then fails its schema (`body.stream_options`).
"""

from __future__ import annotations

from typing import Any

import pytest

from backends.engine.text import ByteTokenizer
from backends.serve.api_error import ApiError
from backends.serve.messages import EngineInfo
from backends.serve.openai_protocol import RequestParser
from backends.serve.parallel_sampling import child_sampling
from runtime import CacheConfig, SchedulerConfig

VOCAB = 512


def parser(max_model_len: int = 64) -> RequestParser:
    info = EngineInfo(SchedulerConfig(max_model_len=max_model_len),
                      CacheConfig(num_blocks=100), VOCAB, (2,), 1)
    return RequestParser(ByteTokenizer(VOCAB), info)


@pytest.mark.parametrize("options", [{}, None])
def test_empty_stream_options_without_stream_are_served(options: Any) -> None:
    for stream in ({"stream": False}, {}):
        parsed = parser().parse({"stream_options": options, **stream}, [5, 6], chat=False)
        assert (parsed.stream, parsed.include_usage, parsed.continuous_usage) == \
            (False, False, False)


@pytest.mark.parametrize(("options", "param", "kind"), [
    ({"include_usage": True}, "stream_options", "BadRequestError"),
    ({"include_usage": False}, "stream_options", "BadRequestError"),  # a non-empty object
    (3, "stream_options", "BadRequestError"),  # vLLM's fixture, hostile 20
    (0, "body.stream_options", "Bad Request"),  # falsy: the schema refuses the type
    (False, "body.stream_options", "Bad Request"),
])
def test_stream_options_without_stream_refused_as_vllm(options: Any, param: str,
                                                       kind: str) -> None:
    with pytest.raises(ApiError) as err:
        parser().parse({"stream_options": options}, [5, 6], chat=False)
    assert (err.value.status, err.value.param, err.value.body()["error"]["type"]) == \
        (400, param, kind)


@pytest.mark.parametrize(("options", "usage"), [
    ({"include_usage": True, "continuous_usage_stats": True}, (True, True)),
    ({"include_usage": True}, (True, False)),
    ({"continuous_usage_stats": True}, (False, False)),  # vLLM: only with include_usage
    ({"include_usage": False, "continuous_usage_stats": True}, (False, False)),
])
def test_continuous_usage_needs_include_usage(options: Any, usage: tuple[bool, bool]) -> None:
    """vLLM 0.32's should_include_usage: `include_continuous_usage = include_usage and
    continuous_usage_stats` (rt sent usage in every chunk without include_usage before)."""
    parsed = parser().parse({"stream": True, "stream_options": options}, [5, 6], chat=False)
    assert (parsed.include_usage, parsed.continuous_usage) == usage


def test_min_tokens_is_checked_against_the_max_tokens_that_runs() -> None:
    """A max_tokens past the prompt's room runs until max_model_len (64 here: 60 prompt
    tokens leave 4); vLLM builds its SamplingParams with that max_tokens, whose check then
    refuses a min_tokens above it (`min_tokens must be less than or equal to max_tokens`).
    rt used to check against the requested 10 and clamp min_tokens to 4 silently."""
    prompt = list(range(1, 61))
    parsed = parser().parse({"max_tokens": 10, "min_tokens": 4}, prompt, chat=False)
    assert (parsed.params.max_tokens, parsed.params.min_tokens) == (4, 4)
    with pytest.raises(ApiError) as err:
        parser().parse({"max_tokens": 10, "min_tokens": 5}, prompt, chat=False)
    assert (err.value.status, err.value.param) == (400, "min_tokens")
    assert "max_tokens=4" in err.value.message


def test_best_of_one_asks_for_nothing_and_is_served() -> None:
    """Older `vllm bench serve` clients send `"best_of": 1` with every completions request
    (vLLM 0.32 ignores the field); any other value asks for candidates rt does not make."""
    parsed = parser().parse({"best_of": 1, "max_tokens": 3}, [5, 6], chat=False)
    assert parsed.params.max_tokens == 3
    for value in (2, True, 1.0, "1"):
        with pytest.raises(ApiError) as err:
            parser().parse({"best_of": value}, [5, 6], chat=False)
        assert (err.value.status, err.value.param) == (400, "best_of")


def test_penalties_and_logit_bias_reach_the_sampler() -> None:
    """vLLM's SamplingParams.from_optional: the penalties as given (null: the default),
    logit_bias's keys converted with int(), its values clamped into [-100, 100]."""
    body = {"presence_penalty": 0.5, "frequency_penalty": -2, "repetition_penalty": 1.25,
            "logit_bias": {"7": 250, "01": -1e400, "300": 2.5}}
    sampling = parser().parse(body, [5, 6], chat=False).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty,
            sampling.repetition_penalty) == (0.5, -2.0, 1.25)
    assert sampling.logit_bias == ((7, 100.0), (1, -100.0), (300, 2.5))
    nulls = {"presence_penalty": None, "repetition_penalty": None, "logit_bias": None}
    sampling = parser().parse(nulls, [5, 6], chat=True).sampling
    assert (sampling.presence_penalty, sampling.repetition_penalty, sampling.logit_bias) == \
        (0.0, 1.0, ())


@pytest.mark.parametrize(("body", "param", "kind"), [
    ({"presence_penalty": 2.5}, "presence_penalty", "BadRequestError"),
    ({"frequency_penalty": -3}, "frequency_penalty", "BadRequestError"),
    ({"frequency_penalty": "1"}, "body.frequency_penalty", "Bad Request"),
    ({"repetition_penalty": 0}, "repetition_penalty", "BadRequestError"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "BadRequestError"),
    ({"repetition_penalty": True}, "body.repetition_penalty", "Bad Request"),
    ({"logit_bias": [1, 2]}, "body.logit_bias", "Bad Request"),
    ({"logit_bias": {"5": "x"}}, "body.logit_bias", "Bad Request"),
    ({"logit_bias": {"a": 1}}, "logit_bias", "BadRequestError"),  # not an integer
    ({"logit_bias": {"512": 1}}, "logit_bias", "BadRequestError"),  # past the vocabulary
    ({"logit_bias": {"-1": 1}}, "logit_bias", "BadRequestError"),
])
def test_bad_penalties_and_logit_bias_refused_as_vllm(body: dict[str, Any], param: str,
                                                      kind: str) -> None:
    with pytest.raises(ApiError) as err:
        parser().parse(body, [5, 6], chat=False)
    assert (err.value.status, err.value.param, err.value.body()["error"]["type"]) == \
        (400, param, kind)


def test_stop_strings_are_parsed_as_vllm() -> None:
    parsed = parser().parse({"stop": "\n", "include_stop_str_in_output": True}, [5], False)
    assert (parsed.stop, parsed.include_stop_str) == (("\n",), True)
    parsed = parser().parse({"stop": ["a", "bc"]}, [5], chat=True)
    assert (parsed.stop, parsed.include_stop_str) == (("a", "bc"), False)
    assert parser().parse({"stop": []}, [5], chat=False).stop == ()
    for body, param, kind in [
            ({"stop": ""}, "stop", "BadRequestError"),  # vLLM: "stop cannot contain an
            ({"stop": ["a", ""]}, "stop", "BadRequestError"),  # empty string."
            ({"stop": ["a"] * 5}, "body.stop", "Bad Request"),  # its schema: at most 4
            ({"stop": [1]}, "body.stop", "Bad Request"),
            ({"stop": "\ud800"}, "stop", "BadRequestError"),  # a lone surrogate
            ({"stop": "a", "include_stop_str_in_output": 1}, "body.include_stop_str_in_output",
             "Bad Request")]:
        with pytest.raises(ApiError) as err:
            parser().parse(body, [5, 6], chat=False)
        assert (err.value.status, err.value.param, err.value.body()["error"]["type"]) == \
            (400, param, kind), body


def test_echo_0_and_chat_logprobs_0_ask_for_nothing() -> None:
    """vLLM's schema reads the booleans 0 and 1 as false and true (pydantic's lax mode):
    0 asks for nothing and is served; 1 asks for what rt does not implement."""
    assert parser().parse({"echo": 0}, [5, 6], chat=False).stream is False
    assert parser().parse({"logprobs": 0}, [5, 6], chat=True).stream is False
    for body, chat in (({"echo": 1}, False), ({"logprobs": 1}, True)):
        with pytest.raises(ApiError) as err:
            parser().parse(body, [5, 6], chat=chat)
        assert (err.value.param, err.value.body()["error"]["type"]) == \
            (next(iter(body)), "BadRequestError")


@pytest.mark.parametrize(("seed", "kept"), [(-1, None), (-2, -2), (0, 0), (None, None)])
def test_seed_minus_one_asks_for_no_seed(seed: int | None, kept: int | None) -> None:
    """vLLM's SamplingParams turns seed -1 into no seed (with n > 1: children unseeded,
    not -1, 0, 1, ...)."""
    assert parser().parse({"seed": seed}, [5, 6], chat=False).sampling.seed == kept
    sampling = parser().parse({"seed": seed, "n": 2}, [5, 6], chat=False).sampling
    expected = [None, None] if kept is None else [kept, kept + 1]
    assert [child_sampling(sampling, i).seed for i in range(2)] == expected
