"""The requests `diff.py` sends to vLLM's server and to rt's: (name, method, path, body,
headers). `@MODEL@` in a body is the served model's name, filled in at send time. A body of
None sends none. The served model is the tiny Llama (vocabulary 512, byte-level tokenizer,
max_model_len 2048).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

JSON = {"content-type": "application/json"}


class Case(NamedTuple):
    name: str
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]


def _post(name: str, path: str, body: bytes | dict[str, Any],
          headers: dict[str, str] | None = None) -> Case:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Case(name, "POST", path, raw, JSON if headers is None else headers)


def _cmpl(name: str, **fields: Any) -> Case:
    """A completion request: `prompt` "hi", `max_tokens` 4 and `ignore_eos` unless given (None
    drops a field): a request served runs to `max_tokens` on both servers (rt serve --simulate
    never samples EOS), so `usage` compares exactly."""
    body = {"model": "@MODEL@", "prompt": "hi", "max_tokens": 4, "ignore_eos": True, **fields}
    return _post(name, "/v1/completions", {k: v for k, v in body.items() if v is not None})


def _chat(name: str, **fields: Any) -> Case:
    body = {"model": "@MODEL@", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "ignore_eos": True, **fields}
    return _post(name, "/v1/chat/completions",
                 {k: v for k, v in body.items() if v is not None})


# test_hostile.py's malformed bodies, byte for byte (its MALFORMED list, in its order: case
# "hostile N" is its Nth).
HOSTILE: list[tuple[str, bytes]] = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b""),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}'),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e9}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 99999999999999999999}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": true}'),
    ("/v1/completions", b'{"prompt": "hi", "n": 0}'),
    ("/v1/completions", b'{"prompt": "hi", "n": 1000000}'),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 50}'),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": "x"}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e400}'),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}'),
    ("/v1/completions", b'{"prompt": "hi", "top_k": -5}'),
    ("/v1/completions", b'{"prompt": "hi", "seed": 1180591620717411303424}'),
    ("/v1/completions", b'{"prompt": "hi", "stream_options": 3}'),
    ("/v1/completions", b'{"prompt": [1, 2, 512]}'),
    ("/v1/completions", b'{"prompt": "a lone \\ud800"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("/v1/completions", b'{"prompt": [-1]}'),
    ("/v1/completions", b'{"prompt": [[1], [2]]}'),
    ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [9999]}'),
    ("/v1/completions", b'{"prompt": "hi", "model": {"a": 1}}'),
    ("/v1/completions", b'{"prompt": "hi", "user": 5}'),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "user": []}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"role": 1}]}'),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
    ("/tokenize", b'{"prompt": {}}'),
    ("/tokenize", b'{"prompt": "\\ud800"}'),
    ("/detokenize", b'{"tokens": [1, "a"]}'),
    ("/detokenize", b'{"tokens": [100000]}'),
]

# One wrong type per field (a string where a number goes, a number where a string goes, ...).
WRONG_TYPES: list[Case] = [
    _cmpl("cmpl model int", model=5),
    _cmpl("cmpl prompt int", prompt=5),
    _cmpl("cmpl prompt dict", prompt={"a": 1}),
    _cmpl("cmpl max_tokens str", max_tokens="4"),
    _cmpl("cmpl max_tokens float", max_tokens=4.5),
    _cmpl("cmpl temperature str", temperature="hot"),
    _cmpl("cmpl top_p str", top_p="x"),
    _cmpl("cmpl top_k float", top_k=1.5),
    _cmpl("cmpl n str", n="2"),
    _cmpl("cmpl stream str", stream="yes"),
    _cmpl("cmpl stream_options.include_usage str", stream=True,
          stream_options={"include_usage": "x"}),
    _cmpl("cmpl seed str", seed="x"),
    _cmpl("cmpl echo str", echo="x"),
    _cmpl("cmpl ignore_eos str", ignore_eos="x"),
    _cmpl("cmpl min_tokens str", min_tokens="x"),
    _cmpl("cmpl stop_token_ids str", stop_token_ids="x"),
    _cmpl("cmpl presence_penalty str", presence_penalty="x"),
    _cmpl("cmpl best_of str", best_of="x"),
    _chat("chat messages str", messages="hi"),
    _chat("chat messages dict", messages={"role": "user", "content": "hi"}),
    _chat("chat message no role", messages=[{"content": "hi"}]),
    _chat("chat max_completion_tokens str", max_tokens=None, max_completion_tokens="x"),
    _chat("chat logprobs str", logprobs="x"),
    _chat("chat top_logprobs str", logprobs=True, top_logprobs="x"),
    _chat("chat tools str", tools="x"),
    _chat("chat temperature list", temperature=[1]),
]

MISSING: list[Case] = [
    _cmpl("cmpl no model", model=None),
    _cmpl("cmpl no prompt", prompt=None),
    _chat("chat no model", model=None),
    _chat("chat no messages", messages=None),
    _cmpl("cmpl unknown model", model="no-such-model"),
    _chat("chat unknown model", model="no-such-model"),
    _post("tokenize no prompt", "/tokenize", {"model": "@MODEL@"}),
    _post("detokenize no tokens", "/detokenize", {"model": "@MODEL@"}),
]

RANGES: list[Case] = [
    _cmpl("cmpl max_tokens 0", max_tokens=0),
    _cmpl("cmpl max_tokens -5", max_tokens=-5),
    _cmpl("cmpl max_tokens up to max_model_len", prompt="a" * 2000, max_tokens=48),
    _cmpl("cmpl max_tokens 1 past max_model_len", prompt="a" * 2000, max_tokens=49),
    _cmpl("cmpl max_tokens of max_model_len", prompt="a" * 2000, max_tokens=2048),
    _cmpl("cmpl max_tokens 1 past max_model_len alone", max_tokens=2049),
    _cmpl("cmpl max_tokens 1e6", max_tokens=1_000_000),
    _cmpl("cmpl max_tokens 2**63", max_tokens=1 << 63),
    _chat("chat max_tokens 0", max_tokens=0),
    _chat("chat max_completion_tokens 0", max_tokens=None, max_completion_tokens=0),
    _chat("chat max_tokens 1e6", max_tokens=1_000_000),
    _cmpl("cmpl n 0", n=0),
    _cmpl("cmpl n 2", n=2),
    _cmpl("cmpl n 1e6", n=1_000_000),
    _chat("chat n 2", n=2),
    _cmpl("cmpl logprobs -1", logprobs=-1),
    _cmpl("cmpl logprobs 5", logprobs=5),
    _cmpl("cmpl logprobs 21", logprobs=21),
    _chat("chat logprobs true", logprobs=True),
    _chat("chat top_logprobs 5", logprobs=True, top_logprobs=5),
    _chat("chat top_logprobs 21", logprobs=True, top_logprobs=21),
    _chat("chat top_logprobs -1", logprobs=True, top_logprobs=-1),
    _chat("chat top_logprobs without logprobs", top_logprobs=5),
    _cmpl("cmpl temperature -1", temperature=-1),
    _cmpl("cmpl temperature 1000", temperature=1000),
    _cmpl("cmpl top_p 1.5", top_p=1.5),
    _cmpl("cmpl top_p -0.1", top_p=-0.1),
    _cmpl("cmpl top_k 0", top_k=0),
    _cmpl("cmpl top_k -1", top_k=-1),
    _cmpl("cmpl top_k -2", top_k=-2),
    _cmpl("cmpl top_k 1e6", top_k=1_000_000),
    _cmpl("cmpl min_tokens -1", min_tokens=-1),
    _cmpl("cmpl min_tokens past max_tokens", min_tokens=10),
    _cmpl("cmpl seed -1", seed=-1),
    _cmpl("cmpl stop int", stop=5),
    _cmpl("cmpl stop list of int", stop=[1]),
    _cmpl("cmpl stop dict", stop={"a": 1}),
    _cmpl("cmpl stop str", stop="x"),
    _cmpl("cmpl stop empty list", stop=[]),
    _chat("chat stop int", stop=5),
    _cmpl("cmpl prompt ids out of vocab", prompt=[3, 1_000_000]),
    _cmpl("cmpl prompt id 512", prompt=[512]),
    _cmpl("cmpl prompt ids in vocab", prompt=[3, 4, 5]),
    _cmpl("cmpl stop_token_ids out of vocab", stop_token_ids=[1_000_000]),
    _cmpl("cmpl empty prompt", prompt=""),
    _cmpl("cmpl empty id list", prompt=[]),
    _chat("chat empty content", messages=[{"role": "user", "content": ""}]),
    _cmpl("cmpl prompt past max_model_len", prompt="a" * 3000),
    _cmpl("cmpl prompt of max_model_len", prompt="a" * 2048, max_tokens=1),
    _cmpl("cmpl prompt + max_tokens past max_model_len", prompt="a" * 2000, max_tokens=100),
    _chat("chat prompt past max_model_len",
          messages=[{"role": "user", "content": "a" * 3000}]),
    _cmpl("cmpl batch of two prompts", prompt=["hi", "yo"]),
    _cmpl("cmpl batch of one prompt", prompt=["hi"], temperature=0),
]

TRANSPORT: list[Case] = [
    _cmpl("cmpl unknown fields", temperature=0, frobnicate={"a": [1]}, zzz=3),
    _post("cmpl non-UTF-8 body", "/v1/completions", b'{"prompt": "\xc3\x28", "max_tokens": 4}'),
    _post("cmpl latin-1 body", "/v1/completions", '{"prompt": "caf\xe9"}'.encode("latin-1")),
    _post("cmpl text/plain", "/v1/completions", b'{"prompt": "hi", "max_tokens": 4}',
          {"content-type": "text/plain"}),
    _post("cmpl no content-type", "/v1/completions", b'{"prompt": "hi", "max_tokens": 4}', {}),
    _post("cmpl form body", "/v1/completions", b"prompt=hi&max_tokens=4",
          {"content-type": "application/x-www-form-urlencoded"}),
    _post("chat text/plain", "/v1/chat/completions",
          b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}',
          {"content-type": "text/plain"}),
    _post("cmpl no body", "/v1/completions", b"", {}),
    _post("cmpl JSON null", "/v1/completions", b"null"),
    _post("cmpl JSON string", "/v1/completions", b'"hi"'),
    Case("GET /v1/completions", "GET", "/v1/completions", None, {}),
    Case("GET /v1/chat/completions", "GET", "/v1/chat/completions", None, {}),
    Case("GET /tokenize", "GET", "/tokenize", None, {}),
    Case("POST /v1/models", "POST", "/v1/models", b"{}", JSON),
    Case("POST /health", "POST", "/health", b"{}", JSON),
    Case("PUT /v1/completions", "PUT", "/v1/completions", b"{}", JSON),
    Case("GET /nope", "GET", "/nope", None, {}),
    Case("POST /v1/nope", "POST", "/v1/nope", b"{}", JSON),
    Case("GET /v1/models/x", "GET", "/v1/models/x", None, {}),
]

VALID: list[Case] = [
    _cmpl("cmpl greedy", temperature=0),
    _cmpl("cmpl greedy stream", temperature=0, stream=True),
    _cmpl("cmpl greedy stream usage", temperature=0, stream=True,
          stream_options={"include_usage": True}),
    _cmpl("cmpl greedy stream continuous usage", temperature=0, stream=True,
          stream_options={"include_usage": True, "continuous_usage_stats": True}),
    _cmpl("cmpl greedy token ids", prompt=[3, 4, 5, 6], temperature=0),
    _cmpl("cmpl default max_tokens", max_tokens=None, temperature=0),
    _cmpl("cmpl seeded sample", temperature=0.8, top_p=0.9, top_k=20, seed=7,
          ignore_eos=True),
    _cmpl("cmpl min_tokens + stop_token_ids", temperature=0, min_tokens=2,
          stop_token_ids=[3]),
    _cmpl("cmpl stream_options without stream", stream_options={"include_usage": True}),
    _cmpl("cmpl presence_penalty 0.5", presence_penalty=0.5),
    _cmpl("cmpl frequency_penalty 3", frequency_penalty=3),
    _cmpl("cmpl max_tokens 4.0", max_tokens=4.0),
    _cmpl("cmpl temperature 2.5", temperature=2.5),
    _cmpl("cmpl temperature 2", temperature=2),
    _post("cmpl charset content-type", "/v1/completions",
          b'{"prompt": "hi", "max_tokens": 4, "ignore_eos": true}',
          {"content-type": "application/json; charset=utf-8"}),
    _chat("chat greedy", temperature=0),
    _chat("chat greedy stream", temperature=0, stream=True),
    _chat("chat greedy stream usage", temperature=0, stream=True,
          stream_options={"include_usage": True}),
    _chat("chat max_completion_tokens", max_tokens=None, max_completion_tokens=4,
          temperature=0),
    _chat("chat text parts", messages=[{"role": "system", "content": "be brief"},
                                       {"role": "user",
                                        "content": [{"type": "text", "text": "hi"}]}],
          temperature=0),
    # n > 1 (parallel sampling): sampled (temperature 1), so the texts differ by chance only
    _cmpl("cmpl n 3 stream continuous usage", n=3, stream=True,
          stream_options={"include_usage": True, "continuous_usage_stats": True}),
    _chat("chat n 2 stream usage", n=2, stream=True, stream_options={"include_usage": True}),
    _chat("chat n 2 seed 5", n=2, seed=5),
    _cmpl("cmpl n 2 greedy", n=2, temperature=0),
    _cmpl("cmpl n 16385", n=16385),
    _cmpl("cmpl n 2 best_of 2", n=2, best_of=2),
    Case("GET /v1/models", "GET", "/v1/models", None, {}),
    Case("GET /health", "GET", "/health", None, {}),
    Case("GET /version", "GET", "/version", None, {}),
    Case("GET /metrics", "GET", "/metrics", None, {}),
    _post("tokenize prompt", "/tokenize", {"model": "@MODEL@", "prompt": "hello there"}),
    _post("tokenize messages", "/tokenize",
          {"model": "@MODEL@", "messages": [{"role": "user", "content": "hi"}]}),
    _post("detokenize", "/detokenize", {"model": "@MODEL@", "tokens": [107, 108, 35]}),
]


def all_cases() -> list[Case]:
    hostile = [_post(f"hostile {i}", path, body) for i, (path, body) in enumerate(HOSTILE)]
    cases = hostile + WRONG_TYPES + MISSING + RANGES + TRANSPORT + VALID
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "case names must be unique"
    return cases
