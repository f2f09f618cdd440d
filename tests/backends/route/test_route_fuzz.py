"""A fuzzer of `rt route`'s POST routes (hypothesis), in front of one `rt serve --simulate`.

The bodies are rt serve's fuzzer's (`tests/backends/serve/test_fuzz.py`): drawn from the
backend's own `/openapi.json` schema of the route (valid in shape), the same with fields
replaced by any JSON and unknown fields added, or any JSON value at all; and here also any
bytes (mostly not JSON, often not UTF-8), plus fixed cases that once failed somewhere (a
body nested 100,000 deep, a lone surrogate, a token id past int64, NaN, ...). The router runs
`llm-d` (its prefix scorer hashes the prompt's token ids as int64, its queue and KV scorers
read the backend's gauges), so the routing path reads every body it passes on.

Every answer must be below 500; a non-2xx one carries vLLM's error shape; a 200 stream ends
with `[DONE]`. After the cases the router still answers /health and a request. Loopback,
`--max-model-len 64` (every admitted request is short), every wait bounded, both processes
stopped. Cases: RT_FUZZ_CASES (default 200), derandomized, so CI runs the same cases.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.backends.route.procs import Rt
from tests.backends.serve.test_fuzz import CASES, JSON, from_schema, mutated

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

MODEL = "llama-3.1-8b"
ROUTES = ("/v1/completions", "/v1/chat/completions")
# bodies (bytes) that failed somewhere once: the router's 500s and rt serve's
FIXED = [
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # the router: RecursionError
    b'{"model": "llama-3.1-8b", "prompt": "\\ud800 lone", "max_tokens": 2}',  # both: 500
    b'{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"model": "llama-3.1-8b", "prompt": [' + str(1 << 64).encode() + b", 5" * 40
    + b"]}",  # llm-d: blocks of ids hashed as int64
    b'{"model": "llama-3.1-8b", "prompt": [[-1, 3, 4]], "user": "\\ud800"}',
    b'{"prompt": NaN}', b'{"prompt": "x", "max_tokens": 1e999}', b'{"user": ' + b"9" * 5000
    + b"}", b"", b"[]", b"null", b"\xff\xfe{", b'{"prompt": "\xc3\x28"}',
]


@pytest.fixture(scope="module")
def routed() -> Iterator[tuple[Rt, Rt]]:
    backend = Rt(["serve", "--simulate", "--gpu", "h200", "--max-model-len", "64",
                  "--num-gpu-blocks-override", "64"])
    router: Rt | None = None
    try:
        router = Rt(["route", "--backend", backend.url, "--router", "llm-d"], timeout_s=30)
        yield backend, router
    finally:
        if router is not None:
            router.stop()
        backend.stop()


def _schemas(backend: Rt) -> dict[str, dict[str, Any]]:
    spec = httpx.get(f"{backend.url}/openapi.json", timeout=10).json()
    return {path: spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            ["schema"] for path in ROUTES}


def _check(response: httpx.Response, streamed: bool) -> None:
    status = response.status_code
    assert status < 500, response.text[:500]
    if status >= 300:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        return
    assert status == 200
    if streamed:
        events = [line[len("data: "):] for line in response.text.splitlines()
                  if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            assert "choices" in json.loads(event)
    else:
        assert "choices" in response.json()


def _post(router: Rt, path: str, body: Any, seen: dict[int, int]) -> None:
    """POST `body` (bytes as they are, anything else as JSON) and check the answer."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{router.url}{path}", content=content, timeout=30,
                          headers={"content-type": "application/json"})
    seen[response.status_code] = seen.get(response.status_code, 0) + 1
    _check(response, isinstance(body, dict) and body.get("stream") is True)


def test_fuzzed_bodies_through_the_router_never_get_a_5xx(routed: tuple[Rt, Rt]) -> None:
    backend, router = routed
    schemas = _schemas(backend)
    bodies = st.sampled_from(ROUTES).flatmap(lambda path: st.tuples(st.just(path), st.one_of(
        from_schema(schemas[path]), mutated(schemas[path]), JSON, st.binary(max_size=64))))
    seen: dict[int, int] = {}

    @hypothesis.settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(bodies)
    def case(drawn: tuple[str, Any]) -> None:
        _post(router, *drawn, seen)

    try:
        for body in FIXED:
            for path in ROUTES:
                _post(router, path, body, seen)
        case()
    except BaseException:
        print(router.output()[-3000:], backend.output()[-3000:])  # their side of it
        raise
    print(f"route fuzz: {sum(seen.values())} cases, statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= CASES + 2 * len(FIXED)
    assert router.proc.poll() is None
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    answer = httpx.post(f"{router.url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "still here", "max_tokens": 2, "ignore_eos": True})
    assert answer.json()["usage"]["completion_tokens"] == 2
