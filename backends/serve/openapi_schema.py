"""The request bodies `rt serve` accepts, as JSON Schema in its OpenAPI document
(`/openapi.json`).

The handlers validate bodies themselves (`openai_protocol.RequestParser`, OpenAI-style 400s);
these schemas only document them, for clients and for the schema-driven fuzzer
(`tests/backends/serve/test_fuzz.py`), which sends bodies drawn from them, and from
mutations of them, and expects no 5xx. Unknown fields are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from backends.serve.openai_protocol import MAX_CACHE_SALT_CHARS, MAX_N, MAX_STOP_STRINGS
from backends.serve.sampling_fields import MAX_TEMPERATURE, PENALTIES

_INT64 = {"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 63) - 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role"],
    "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]},
                   "content": {"anyOf": [
                       {"type": "string"},
                       {"type": "array", "items": {
                           "type": "object", "required": ["type", "text"],
                           "properties": {"type": {"const": "text"},
                                          "text": {"type": "string"}}}}]}}}}
_SAMPLING: dict[str, Any] = {
    "model": {"type": "string"},
    "user": {"type": "string"},
    "min_tokens": {"type": "integer", "minimum": 0},
    "ignore_eos": {"type": "boolean"},
    "stop_token_ids": _TOKEN_IDS,
    "temperature": {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE},
    **{name: {"type": "number", "minimum": -2, "maximum": 2} for name in PENALTIES},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100,
                                            "maximum": 100},
                   "description": "token id -> bias added to its logit (vLLM clamps values "
                                  "into [-100, 100]; ids must be in the vocabulary)"},
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "maxItems": MAX_STOP_STRINGS,
                        "items": {"type": "string", "minLength": 1}}],
             "description": "generation stops when the output text holds one; the text is "
                            "cut before it (vLLM's detokenizer check)"},
    "include_stop_str_in_output": {"type": "boolean"},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "seed": _INT64,
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N,
          "description": "choices to sample (each its own engine request, seed + index when "
                         "seeded); n > 1 needs a temperature above 0 (vLLM's rules)"},
    "priority": {**_INT64, "description": "lower is served first under --policy priority "
                 "(then the earlier arrival); accepted and unused under fcfs, as vLLM 0.32; an "
                 "X-Vllm-Priority header that is an integer replaces it"},
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
                   "pattern": "^[^@/\\\\\\x00]*$",
                   "description": "salts the prompt's prefix-cache hashes: requests share "
                                  "cached KV only when their salts are equal"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {
        "include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}}},
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "completion": {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"anyOf": [{"type": "string"}, _TOKEN_IDS]},
        "max_tokens": {"type": "integer", "minimum": 1}, **_SAMPLING}},
    "chat": {"type": "object", "required": ["messages"], "properties": {
        "messages": _MESSAGES, "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1}, **_SAMPLING}},
    "tokenize": {"type": "object", "properties": {
        "prompt": {"anyOf": [{"type": "string"}, _TOKEN_IDS]}, "messages": _MESSAGES}},
    "detokenize": {"type": "object", "required": ["tokens"], "properties": {
        "tokens": _TOKEN_IDS}},
}


def request_schema(name: str) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON request body."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": SCHEMAS[name]}}}}
