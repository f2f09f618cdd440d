"""The OpenAI API's request side for `rt serve`: completion and chat bodies validated into
engine requests (`RequestParser` -> `Parsed`). A field's type is read as vLLM's schema reads it
(`body_fields`), the sampler's fields are checked in `sampling_fields`, and every refusal is
an OpenAI-style error (`api_error`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.engine.sampling_options import SamplingOptions
from backends.engine.text import TextCodec
from backends.serve.api_error import ApiError, body_error
from backends.serve.body_fields import INT64, short, token_list, typed_field, unicode_text
from backends.serve.messages import EngineInfo
from backends.serve.sampling_fields import sampling_options
from runtime import SamplingParams

# The generation routes: path -> whether it is the chat API. rt serve's stream path and
# rt route's relay both dispatch on it.
GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}


MAX_N = 16384  # vLLM's default VLLM_MAX_N_SEQUENCES: `n` is in [1, MAX_N]
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
            typed_field(body, name, kinds, None)
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
            return self.codec.encode(unicode_text(prompt, "prompt"))
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
        min_tokens = typed_field(body, "min_tokens", (int,), 0)
        if not 0 <= min_tokens <= max_tokens:  # vLLM checks it against the clamped one
            raise ApiError(400, f"min_tokens must be in [0, max_tokens={max_tokens}], got "
                           f"{short(min_tokens)}", "min_tokens")
        ignore_eos = typed_field(body, "ignore_eos", (bool,), False)
        stop = _stop_strings(body)
        include_stop_str = typed_field(body, "include_stop_str_in_output", (bool,), False)
        stop_ids = tuple(token_list(body.get("stop_token_ids") or [], "stop_token_ids",
                                     self.info.vocab_size))
        eos_ids = self.info.eos_token_ids
        eos = eos_ids[0] if eos_ids else None
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                                ignore_eos=ignore_eos, eos_token_id=eos,
                                stop_token_ids=stop_ids + tuple(eos_ids[1:]) * (not ignore_eos))
        sampler_stops = tuple(stop_ids) + (() if ignore_eos else tuple(eos_ids))
        sampling = sampling_options(body, min_tokens, sampler_stops, self.info.vocab_size)
        if n > 1 and sampling.greedy:  # vLLM's SamplingParams._verify_greedy_sampling
            raise ApiError(400, f"n must be 1 when using greedy sampling, got {n}.", "n")
        stream = typed_field(body, "stream", (bool,), False)
        typed_field(body, "user", (str,), None)  # unused; vLLM's schema: a string or null
        # vLLM's rule, first, and only for a truthy value: `{}` without stream is served
        if body.get("stream_options") and not stream:
            raise ApiError(400, "stream_options can only be given with stream=true",
                           "stream_options")
        options = typed_field(body, "stream_options", (dict,), {})
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
        n: int = typed_field(body, "n", (int,), 1)
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
        value = typed_field(body, name, (int,), None)
        if value is None:
            return room if chat else min(16, room)
        if value < 1:
            raise ApiError(400, f"{name} must be at least 1, got {short(value)}", name)
        if value > self.max_model_len:  # below it, vLLM stops at max_model_len (`parse`)
            raise ApiError(400, f"{name}={short(value)} cannot be greater than "
                           f"max_model_len={self.max_model_len}", name)
        return int(value)


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
    priority: int = typed_field(body, "priority", (int,), 0)
    if not INT64[0] <= priority <= INT64[1]:
        raise body_error(f"priority must be a 64-bit integer, got {short(priority)}",
                         "body.priority")
    try:
        replaced = priority if header is None else int(header)
    except ValueError:
        return priority
    if not INT64[0] <= replaced <= INT64[1]:  # vLLM would fail encoding it for its engine
        raise ApiError(400, f"the {PRIORITY_HEADER} header must be a 64-bit integer, got "
                       f"{short(replaced)}", PRIORITY_HEADER)
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
    return unicode_text(salt, "cache_salt")


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
    return tuple(unicode_text(stop, "stop") for stop in stops)
