"""The OpenAI API's request side for `rt serve`: validating completion and chat bodies into
engine requests, and OpenAI-style errors (`{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from backends.engine.sampling_options import MAX_LOGIT_BIAS, SamplingOptions
from backends.engine.text import TextCodec
from backends.serve.messages import EngineInfo
from backends.serve.responses import json_bytes
from runtime import SamplingParams

# The generation routes: path -> whether it is the chat API. rt serve's stream path and
# rt route's relay both dispatch on it.
GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}


class ApiError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or {400: "BadRequestError", 401: "AuthenticationError",
                             404: "NotFoundError", 413: "RequestTooLargeError",
                             503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def encoded(self) -> bytes:
        """The body's bytes as `response()` sends them (for a server without Starlette's
        responses: `rt route`)."""
        return json_bytes(self.body())


def body_error(message: str, param: str | None = "body") -> ApiError:
    """A body that does not fit the request's schema (malformed JSON, a field of the wrong
    type, a required one missing): vLLM's shape for it (FastAPI's validation errors), type
    "Bad Request" and `param` the location, `body.<field>`."""
    return ApiError(400, message, param, kind="Bad Request")


# A request still running when the server stops waiting for it (`--shutdown-timeout` ran out,
# or a second Ctrl-C): aborted, and answered with this (a stream: as its last event, then
# `[DONE]`); rt serve's and rt route's words.
SHUT_DOWN = ApiError(503, "the server shut down before the request finished")


class EngineDeadError(ApiError):
    def __init__(self) -> None:
        super().__init__(500, "the engine process died", kind="EngineDeadError")


_SAMPLING_EPS = 1e-5  # vLLM's: a lower temperature samples greedily (no 1/T overflow)
_INT64 = (-(1 << 63), (1 << 63) - 1)  # vLLM's seed range
MAX_TEMPERATURE = 2.0  # vLLM's (and OpenAI's) upper bound
MAX_N = 16384  # vLLM's default VLLM_MAX_N_SEQUENCES: `n` is in [1, MAX_N]
PENALTIES = ("presence_penalty", "frequency_penalty")  # in [-2, 2], vLLM's range
# Features rt serve refuses (400 once set), each with the JSON types whose other values
# vLLM 0.32's schema refuses as it does (its "Bad Request"; none: vLLM's own 400, or it
# ignores the field), and an int that asks for nothing (`best_of` 1, one candidate per
# choice, which older `vllm bench serve` clients send with every completions request); the
# chat API's `logprobs` is a boolean.
_UNSUPPORTED: tuple[tuple[str, tuple[type, ...], int | None], ...] = (
    ("logprobs", (), None), ("top_logprobs", (), None),
    ("echo", (bool,), None), ("best_of", (), 1), ("tools", (list,), None),
    ("response_format", (), None))


def _unsupported(body: dict[str, Any], chat: bool) -> None:
    """ApiError for the first feature rt serve does not implement that `body` sets (a
    schema error first where its value has a type vLLM refuses)."""
    for name, kinds, no_op in _UNSUPPORTED:
        value = body.get(name)
        if no_op is not None and type(value) is int and value == no_op:
            continue
        if name == "logprobs" and chat:
            kinds = (bool,)
        if kinds == (bool,) and type(value) is int and value in (0, 1):
            value = bool(value)  # vLLM's schema reads 0 and 1 as booleans (0: nothing asked)
        elif value is not None and kinds:
            _get(body, name, kinds, None)
        if value:
            raise ApiError(400, f"{name} is not supported by rt serve", name)


@dataclass(slots=True)
class Parsed:
    """A validated generation request."""

    prompt_ids: list[int]
    params: SamplingParams
    sampling: SamplingOptions
    stream: bool
    include_usage: bool
    continuous_usage: bool
    stop: tuple[str, ...] = ()  # stop strings (checked on the text: `stop_strings`)
    include_stop_str: bool = False  # include_stop_str_in_output
    n: int = 1  # choices to sample, each its own engine request when > 1 (`parallel_sampling`)
    priority: int = 0  # the waiting queue's key under --policy priority (lower first)
    cache_salt: str | None = None  # salts the prefix-cache hashes (first block's extra key)


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    """`body[name]` if one of `kinds` (None or absent: `default`); an integral float for an
    int (4.0, 1e9), as vLLM's schema takes it. A string or a boolean for a number is refused
    (vLLM coerces "4" and true; rt does not guess)."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise body_error(f"{name} must be {kinds[0].__name__}, got a boolean", f"body.{name}")
    if isinstance(value, float) and int in kinds and float not in kinds \
            and value.is_integer():
        return int(value)
    if not isinstance(value, kinds):
        raise body_error(f"{name} must be {kinds[0].__name__}, got {_short(value)}",
                         f"body.{name}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{name} must be finite, got {value}", name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    """A finite float (an int too, when a float can hold it)."""
    value = _get(body, name, (float, int), default)
    try:
        number = float(value)
    except OverflowError:
        raise body_error(f"{name} is out of range", f"body.{name}") from None
    if not math.isfinite(number):
        raise ApiError(400, f"{name} must be finite, got {number}", name)
    return number


_INT = {int}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def token_list(value: Any, name: str, vocab_size: int) -> list[int]:
    # Once per admitted request: the ids' types as a set, then their range by min/max; the
    # first bad id is searched for only when there is one (a 256-token prompt: 14-28 us,
    # against 43-48 us for a generator over the ids). JSON's only int subclass is bool,
    # refused here as before.
    if not isinstance(value, list) or not set(map(type, value)) <= _INT:
        if not isinstance(value, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise body_error(f"{name} must be a list of token ids", f"body.{name}")
    if value and (min(value) < 0 or max(value) >= vocab_size):
        if min(value) < 0:  # vLLM's schema: ids are non-negative
            raise body_error(f"{name}: token id {_short(min(value))} is negative",
                             f"body.{name}")
        bad = [t for t in value if not 0 <= t < vocab_size]
        raise ApiError(400, f"{name}: token id {_short(bad[0])} is outside the vocabulary "
                       f"[0, {vocab_size})", name)
    return value


def _text(value: str, name: str) -> str:
    """`value` if it is Unicode text; ApiError 400 for a lone surrogate (JSON's "\ud800"
    escape makes one; no tokenizer takes it: ByteTokenizer raises UnicodeEncodeError, a
    Hugging Face one TypeError). An ASCII string is known as such in O(1)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{name} is not valid Unicode text (a lone surrogate)",
                           name) from None
    return value


class RequestParser:
    """Validates OpenAI request bodies into `Parsed` (ApiError 400 otherwise)."""

    def __init__(self, codec: TextCodec, info: EngineInfo) -> None:
        self.codec = codec
        self.info = info
        self.max_model_len = info.scheduler.max_model_len

    def completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if prompt is None:
            raise ApiError(400, "prompt is required", "prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > 1:
                raise ApiError(400, "batches of several prompts are not supported by rt "
                               "serve", "prompt")
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.codec.encode(_text(prompt, "prompt"))
        if isinstance(prompt, list):
            return token_list(prompt, "prompt", self.info.vocab_size)
        raise body_error("prompt must be a string, a list of token ids, or a list of one of "
                         "them", "body.prompt")

    def chat_prompt(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise body_error("messages must be a list of messages", "body.messages")
        if not messages:
            raise ApiError(400, "messages must not be empty", "messages")
        clean = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise body_error("each message needs a string role", "body.messages")
            content = message.get("content") or ""
            if isinstance(content, list):  # content parts: keep the text ones
                texts: list[object] = [part.get("text") for part in content
                                       if isinstance(part, dict) and part.get("type") == "text"]
                if not all(isinstance(text, str) for text in texts):
                    raise ApiError(400, "a text part needs a string text", "messages")
                content = "".join(str(text) for text in texts)
            if not isinstance(content, str):
                raise body_error("message content must be a string or text parts",
                                 "body.messages")
            clean.append({"role": message["role"], "content": content})
        try:
            return self.codec.chat_prompt(clean)
        except Exception as err:  # noqa: BLE001 - a model's chat template refusing the input
            raise ApiError(400, f"the chat template failed: {err}", "messages") from None

    def parse(self, body: dict[str, Any], prompt_ids: list[int], chat: bool,
              priority_header: str | None = None) -> Parsed:
        """`body` (its prompt already tokenized) as an engine request; `priority_header`:
        the request's X-Vllm-Priority header, if any (`_priority`)."""
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, your request has {len(prompt_ids)} input tokens, "
                           "which leaves no room for output.", "prompt" if not chat
                           else "messages")
        requested = self._max_tokens(body, chat, len(prompt_ids))
        # vLLM 0.32: a max_tokens past the room the prompt leaves runs until max_model_len
        max_tokens = min(requested, self.max_model_len - len(prompt_ids))
        _unsupported(body, chat)
        n = self._n(body, chat)
        min_tokens = _get(body, "min_tokens", (int,), 0)
        if not 0 <= min_tokens <= max_tokens:  # vLLM checks it against the clamped one
            raise ApiError(400, f"min_tokens must be in [0, max_tokens={max_tokens}], got "
                           f"{_short(min_tokens)}", "min_tokens")
        ignore_eos = _get(body, "ignore_eos", (bool,), False)
        stop = _stop_strings(body)
        include_stop_str = _get(body, "include_stop_str_in_output", (bool,), False)
        stop_ids = tuple(token_list(body.get("stop_token_ids") or [], "stop_token_ids",
                                     self.info.vocab_size))
        eos_ids = self.info.eos_token_ids
        eos = eos_ids[0] if eos_ids else None
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                                ignore_eos=ignore_eos, eos_token_id=eos,
                                stop_token_ids=stop_ids + tuple(eos_ids[1:]) * (not ignore_eos))
        sampler_stops = tuple(stop_ids) + (() if ignore_eos else tuple(eos_ids))
        sampling = self._sampling(body, min_tokens, sampler_stops, self.info.vocab_size)
        if n > 1 and sampling.greedy:  # vLLM's SamplingParams._verify_greedy_sampling
            raise ApiError(400, f"n must be 1 when using greedy sampling, got {n}.", "n")
        stream = _get(body, "stream", (bool,), False)
        _get(body, "user", (str,), None)  # unused; vLLM's schema: a string or null
        # vLLM's rule, first, and only for a truthy value: `{}` without stream is served
        if body.get("stream_options") and not stream:
            raise ApiError(400, "stream_options can only be given with stream=true",
                           "stream_options")
        options = _get(body, "stream_options", (dict,), {})
        usage = [options.get(key) or False for key in ("include_usage",
                                                        "continuous_usage_stats")]
        if not all(isinstance(flag, bool) for flag in usage):
            raise body_error("stream_options' include_usage and continuous_usage_stats must "
                             "be booleans", "body.stream_options")
        # vLLM's should_include_usage: continuous_usage_stats counts only with include_usage
        return Parsed(prompt_ids, params, sampling, stream, usage[0], usage[0] and usage[1],
                      stop, include_stop_str, n, _priority(body, priority_header),
                      _cache_salt(body))

    @staticmethod
    def _n(body: dict[str, Any], chat: bool) -> int:
        """`n`, in vLLM's range (1 to its default VLLM_MAX_N_SEQUENCES), with its words;
        null is 1 in the chat API, a type error in the completions API (vLLM's schemas)."""
        if not chat and "n" in body and body["n"] is None:
            raise body_error("n must be int, got null", "body.n")
        n: int = _get(body, "n", (int,), 1)
        if n < 1:
            raise ApiError(400, f"n must be at least 1, got {n}.", "n")
        if n > MAX_N:
            raise ApiError(400, f"n must be at most {MAX_N}, got {n}. To increase this "
                           "limit, set the VLLM_MAX_N_SEQUENCES environment variable.", "n")
        return n

    def _max_tokens(self, body: dict[str, Any], chat: bool, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") \
            is not None else "max_tokens"
        value = _get(body, name, (int,), None)
        if value is None:
            return room if chat else min(16, room)
        if value < 1:
            raise ApiError(400, f"{name} must be at least 1, got {_short(value)}", name)
        if value > self.max_model_len:  # below it, vLLM stops at max_model_len (`parse`)
            raise ApiError(400, f"{name}={_short(value)} cannot be greater than "
                           f"max_model_len={self.max_model_len}", name)
        return int(value)

    @staticmethod
    def _sampling(body: dict[str, Any], min_tokens: int, stops: tuple[int, ...],
                  vocab_size: int) -> SamplingOptions:
        temperature = _number(body, "temperature", 1.0)
        top_p = _number(body, "top_p", 1.0)
        top_k = _get(body, "top_k", (int,), 0)
        seed = _get(body, "seed", (int,), None)
        if seed is not None and not _INT64[0] <= seed <= _INT64[1]:
            raise body_error(f"seed must be a 64-bit integer, got {_short(seed)}", "body.seed")
        if seed == -1:  # vLLM's SamplingParams: no seed (n > 1: unseeded children)
            seed = None
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise ApiError(400, f"temperature must be in [0, {MAX_TEMPERATURE}], got "
                           f"{temperature}", "temperature")
        presence, frequency = (_penalty(body, name) for name in PENALTIES)
        repetition = _number(body, "repetition_penalty", 1.0)
        if repetition <= 0:  # vLLM's check (finite: `_number`)
            raise ApiError(400, f"repetition_penalty must be greater than zero, got "
                           f"{repetition}", "repetition_penalty")
        if not 0 < top_p <= 1:
            raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
        temperature = 0.0 if temperature < _SAMPLING_EPS else temperature  # vLLM: greedy
        if top_k < 0 and top_k != -1:
            raise ApiError(400, f"top_k must be -1, 0 or positive, got {_short(top_k)}", "top_k")
        return SamplingOptions(temperature, top_p, max(top_k, 0), seed, min_tokens, stops,
                               presence, frequency, repetition, _logit_bias(body, vocab_size))


PRIORITY_HEADER = "x-vllm-priority"  # vLLM 0.32's PRIORITY_HEADER (headers match any case)


def _priority(body: dict[str, Any], header: str | None) -> int:
    """The request's priority (lower is served first under --policy priority), as vLLM 0.32
    takes it: `priority` an int64 (its schema: null, a string or a fraction refused), then
    replaced by an X-Vllm-Priority header that int() reads (vLLM's `_get_priority`; one it
    cannot read is ignored). Under the fcfs policy it is accepted and changes nothing, as in
    vLLM 0.32 (its field's description says a non-zero one "will raise an error"; only the
    V0 engine, removed, did)."""
    if "priority" in body and body["priority"] is None:
        raise body_error("priority must be int, got null", "body.priority")
    priority: int = _get(body, "priority", (int,), 0)
    if not _INT64[0] <= priority <= _INT64[1]:
        raise body_error(f"priority must be a 64-bit integer, got {_short(priority)}",
                         "body.priority")
    try:
        replaced = priority if header is None else int(header)
    except ValueError:
        return priority
    if not _INT64[0] <= replaced <= _INT64[1]:  # vLLM would fail encoding it for its engine
        raise ApiError(400, f"the {PRIORITY_HEADER} header must be a 64-bit integer, got "
                       f"{_short(replaced)}", PRIORITY_HEADER)
    return replaced


MAX_CACHE_SALT_CHARS = 128  # vLLM 0.32's _MAX_CACHE_SALT_LENGTH
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")  # vLLM 0.32's: kept out of cache backends' keys


def _cache_salt(body: dict[str, Any]) -> str | None:
    """`cache_salt`: a non-empty string of at most 128 characters without '@', '/', '\\' or
    NUL (vLLM 0.32's validate_cache_salt, its words; a check before its schema's, so a wrong
    type is its 400 too, not the schema's), or None. It salts the request's prefix-cache
    hashes: requests share cached blocks only when their salts are equal (or both absent)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.",
                       "cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        raise ApiError(400, f"Parameter 'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} "
                       "characters and must not contain '@', '/', '\\\\', or NUL.",
                       "cache_salt")
    return _text(salt, "cache_salt")


MAX_STOP_STRINGS = 4  # vLLM's default VLLM_MAX_STOP_STRINGS (its schema's max_length)


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    """`stop`: a string or a list of at most 4 (vLLM's schema), none of them empty
    (SamplingParams' check)."""
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise body_error("stop must be a string or a list of strings", "body.stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise body_error(f"stop must hold at most {MAX_STOP_STRINGS} strings, got "
                         f"{len(stops)}", "body.stop")
    if not all(stops):
        raise ApiError(400, "stop cannot contain an empty string.", "stop")
    return tuple(_text(stop, "stop") for stop in stops)


def _penalty(body: dict[str, Any], name: str) -> float:
    """presence_penalty or frequency_penalty: a number in [-2, 2] (vLLM's range)."""
    value = _number(body, name, 0.0)
    if not -2 <= value <= 2:
        raise ApiError(400, f"{name} must be in [-2, 2], got {value}", name)
    return value


def _logit_bias(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias as vLLM 0.32 takes it (SamplingParams.from_optional and
    _validate_logit_bias): an object of numbers (its schema), each key converted with int()
    (a later duplicate wins), each value clamped into [-100, 100], then every id checked
    against the vocabulary. Returns (token id, bias) pairs in the body's order."""
    value = _get(body, "logit_bias", (dict,), None)
    if not value:
        return ()
    biases: dict[int, float] = {}
    bad_keys = []
    for key, bias in value.items():
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise body_error(f"logit_bias values must be numbers, got {_short(bias)}",
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
                       f"token IDs: {_short(bad_keys)}", "logit_bias")
    outside = [token for token in biases if not 0 <= token < vocab_size]
    if outside:
        raise ApiError(400, f"token_id(s) {_short(outside)} in logit_bias contain "
                       f"out-of-vocab token ids. Vocabulary size: {vocab_size}", "logit_bias")
    return tuple(biases.items())
