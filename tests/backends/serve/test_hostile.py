"""Hostile and malformed input to `rt serve`: the API key, the body limit, and bodies no
client should send. Each gets a 4xx in vLLM's shape, never a 5xx or a hang, and the server
keeps serving. The tiny model runs the engine (real sampling: a temperature of 1e-300 or a
seed of 2**70 would reach torch)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest

from tests.backends.serve.test_serve import Served

KEY = "rt-" + secrets.token_hex(8)
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 16384


@pytest.fixture(scope="module")
def guarded() -> Iterator[Served]:
    server = Served(["--max-model-len", "64", "--num-gpu-blocks-override", "64",
                     "--max-request-bytes", str(LIMIT)], env={"VLLM_API_KEY": KEY})
    yield server
    server.stop()


def _post(server: Served, path: str, content: bytes, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=content, timeout=10,
                      headers={**AUTH, "content-type": "application/json", **headers})


def test_api_key_is_required_on_v1_only(guarded: Served) -> None:
    url = f"{guarded.url}/v1/completions"
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}]:
        response = httpx.post(url, json=body, headers=headers, timeout=10)
        assert response.status_code == 401, headers
        assert response.json() == {"error": "Unauthorized"}  # vLLM's body
    assert httpx.get(f"{guarded.url}/v1/models", timeout=10).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": f"bearer {KEY}"},
                      timeout=10).status_code == 200
    for path in ("/health", "/metrics"):  # as vLLM: only /v1 is guarded
        assert httpx.get(f"{guarded.url}{path}", timeout=10).status_code == 200


def test_oversize_bodies_get_413_declared_or_chunked(guarded: Served) -> None:
    big = b'{"prompt": "' + b"a" * LIMIT + b'"}'
    declared = _post(guarded, "/v1/completions", big)
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the handler counts
        for start in range(0, len(big), 4096):
            yield big[start:start + 4096]

    chunked = httpx.post(f"{guarded.url}/v1/completions", content=chunks(), headers=AUTH,
                         timeout=10)
    assert chunked.status_code == 413
    assert _post(guarded, "/tokenize", big).status_code == 413


# (route, body, the error's param): the field, as vLLM's own checks name it, or `body` /
# `body.<field>` where vLLM's schema refuses the body (its error type "Bad Request"); what
# vLLM 0.32 answers to each: test_api_diff.py.
MALFORMED: list[tuple[str, bytes, str | None]] = [
    ("/v1/completions", b"{not json", "body"),
    ("/v1/completions", b"", "body"),
    ("/v1/completions", b"[1, 2]", "body"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', "body"),  # not UTF-8
    ("/v1/completions", b"[" * 5000 + b"]" * 5000, "body"),  # deeper than the parser's stack
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "body"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "body"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e9}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 99999999999999999999}',
     "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": true}', "body.max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "n": 0}', "n"),
    ("/v1/completions", b'{"prompt": "hi", "n": 1000000}', "n"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 50}', "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": "x"}', "logprobs"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1e400}', "temperature"),  # inf
    ("/v1/completions", b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}",
     "body.temperature"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "top_k": -5}', "top_k"),
    ("/v1/completions", b'{"prompt": "hi", "seed": 1180591620717411303424}', "body.seed"),
    ("/v1/completions", b'{"prompt": "hi", "stream_options": 3}', "stream_options"),
    ("/v1/completions", b'{"prompt": [1, 2, 512]}', "prompt"),  # the vocabulary is 512
    ("/v1/completions", b'{"prompt": "a lone \\ud800"}', "prompt"),  # JSON, not Unicode
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages"),
    ("/v1/completions", b'{"prompt": [-1]}', "body.prompt"),
    ("/v1/completions", b'{"prompt": [[1], [2]]}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [9999]}', "stop_token_ids"),
    ("/v1/completions", b'{"prompt": "hi", "model": {"a": 1}}', "body.model"),
    ("/v1/completions", b'{"prompt": "hi", "user": 5}', "body.user"),  # vLLM: a string or null
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "user": []}',
     "body.user"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": 1}]}', "body.messages"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}',
     "body.messages"),
    ("/tokenize", b'{"prompt": {}}', "body.prompt"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/detokenize", b'{"tokens": [1, "a"]}', "body.tokens"),
    ("/detokenize", b'{"tokens": [100000]}', "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), MALFORMED)
def test_malformed_bodies_get_400_in_vllms_shape(guarded: Served, path: str, body: bytes,
                                                 param: str | None) -> None:
    response = _post(guarded, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 400 and error["param"] == param
    assert len(error["message"]) < 300  # nothing echoed at length


def test_unknown_fields_are_ignored_and_the_server_still_serves(guarded: Served) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True, "frobnicate": {"a": [1]},
            "temperature": 1e-300, "seed": -(1 << 63)}  # greedy, as vLLM below 1e-5
    response = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=AUTH,
                          timeout=10)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{guarded.url}/health", timeout=5).status_code == 200
