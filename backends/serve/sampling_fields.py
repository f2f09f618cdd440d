"""The sampling fields of an OpenAI request body (temperature, top_p, top_k, seed, the
presence, frequency and repetition penalties, logit_bias), checked as vLLM 0.32 checks them
(its schema, then `SamplingParams._verify_args`) and made into the sampler's
`SamplingOptions`. The request's other limits (max_tokens, min_tokens, n, stop) are the
parser's (`openai_protocol.RequestParser`).
"""

from __future__ import annotations

from typing import Any

from backends.engine.sampling_options import MAX_LOGIT_BIAS, SamplingOptions
from backends.serve.api_error import ApiError, body_error
from backends.serve.body_fields import INT64, number_field, short, typed_field

_SAMPLING_EPS = 1e-5  # vLLM's: a lower temperature samples greedily (no 1/T overflow)
MAX_TEMPERATURE = 2.0  # vLLM's (and OpenAI's) upper bound
PENALTIES = ("presence_penalty", "frequency_penalty")  # in [-2, 2], vLLM's range


def sampling_options(body: dict[str, Any], min_tokens: int, stops: tuple[int, ...],
                     vocab_size: int) -> SamplingOptions:
    """`body`'s sampling fields as `SamplingOptions` (ApiError 400 otherwise); `min_tokens`
    (already checked) and `stops` (the token ids that end the request: stop_token_ids and,
    unless ignore_eos, the EOS ids) pass through to the sampler."""
    temperature = number_field(body, "temperature", 1.0)
    top_p = number_field(body, "top_p", 1.0)
    top_k = typed_field(body, "top_k", (int,), 0)
    seed = typed_field(body, "seed", (int,), None)
    if seed is not None and not INT64[0] <= seed <= INT64[1]:
        raise body_error(f"seed must be a 64-bit integer, got {short(seed)}", "body.seed")
    if seed == -1:  # vLLM's SamplingParams: no seed (n > 1: unseeded children)
        seed = None
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise ApiError(400, f"temperature must be in [0, {MAX_TEMPERATURE}], got "
                       f"{temperature}", "temperature")
    presence, frequency = (_penalty(body, name) for name in PENALTIES)
    repetition = number_field(body, "repetition_penalty", 1.0)
    if repetition <= 0:  # vLLM's check (finite: `number_field`)
        raise ApiError(400, f"repetition_penalty must be greater than zero, got "
                       f"{repetition}", "repetition_penalty")
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    temperature = 0.0 if temperature < _SAMPLING_EPS else temperature  # vLLM: greedy
    if top_k < 0 and top_k != -1:
        raise ApiError(400, f"top_k must be -1, 0 or positive, got {short(top_k)}", "top_k")
    return SamplingOptions(temperature, top_p, max(top_k, 0), seed, min_tokens, stops,
                           presence, frequency, repetition, _logit_bias(body, vocab_size))


def _penalty(body: dict[str, Any], name: str) -> float:
    """presence_penalty or frequency_penalty: a number in [-2, 2] (vLLM's range)."""
    value = number_field(body, name, 0.0)
    if not -2 <= value <= 2:
        raise ApiError(400, f"{name} must be in [-2, 2], got {value}", name)
    return value


def _logit_bias(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias as vLLM 0.32 takes it (SamplingParams.from_optional and
    _validate_logit_bias): an object of numbers (its schema), each key converted with int()
    (a later duplicate wins), each value clamped into [-100, 100], then every id checked
    against the vocabulary. Returns (token id, bias) pairs in the body's order."""
    value = typed_field(body, "logit_bias", (dict,), None)
    if not value:
        return ()
    biases: dict[int, float] = {}
    bad_keys = []
    for key, bias in value.items():
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise body_error(f"logit_bias values must be numbers, got {short(bias)}",
                             "body.logit_bias")
        try:
            token = int(key)
        except ValueError:
            bad_keys.append(key)
            continue
        # compared before float(): an int past a float's range clamps, not overflows
        biases[token] = float(min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias)))
    if bad_keys:
        raise ApiError(400, "logit_bias contains key(s) that cannot be converted to integer "
                       f"token IDs: {short(bad_keys)}", "logit_bias")
    outside = [token for token in biases if not 0 <= token < vocab_size]
    if outside:
        raise ApiError(400, f"token_id(s) {short(outside)} in logit_bias contain "
                       f"out-of-vocab token ids. Vocabulary size: {vocab_size}", "logit_bias")
    return tuple(biases.items())
