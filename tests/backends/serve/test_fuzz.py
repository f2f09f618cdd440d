"""A schema-driven fuzzer of `rt serve`'s API (hypothesis; schemathesis is not a dependency).

The request schemas come from the server's own `/openapi.json`. Each case picks a POST route
and sends a body drawn from its schema (valid in shape), the same with some fields replaced
by arbitrary JSON and unknown fields added, or any JSON value at all. Every answer must be
below 500; a 4xx carries vLLM's error shape; a 200 is a completion (streamed or not) whose
token count stays within max_model_len per choice. The tiny model runs the engine (real
sampling), with max_model_len 64 so every admitted request is short, and `n` drawn up to 4
(the schema allows vLLM's 16,384 choices; its bounds are test_hostile's). Cases:
RT_FUZZ_CASES (default 200), derandomized, so CI runs the same cases each time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.backends.serve.test_serve import Served

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

CASES = int(os.environ.get("RT_FUZZ_CASES", "200"))
MAX_MODEL_LEN = 64
MAX_N = 4  # choices per drawn request: n engine requests each
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)


def from_schema(schema: dict[str, Any]) -> Any:
    """A strategy for the JSON Schema subset `backends/serve/openapi_schema.py` uses."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = {k: from_schema(props[k]) for k in schema.get("required", [])}
        optional = {k: from_schema(v) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(required, optional=optional)
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {})),
                        min_size=schema.get("minItems", 0), max_size=8)
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        return st.one_of(st.integers(low, high),
                         st.integers(low if low is not None else -5, min(high or 600, 600)))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(low, schema.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return st.text(max_size=40)
    return JSON


def mutated(schema: dict[str, Any]) -> Any:
    """A body of the schema with some fields replaced by any JSON and unknown ones added."""
    names = sorted(schema.get("properties", {}))

    @st.composite
    def build(draw: Any) -> Any:
        body = dict(draw(from_schema(schema)))
        for name in draw(st.lists(st.sampled_from(names), max_size=3)):
            body[name] = draw(JSON)
        body.update(draw(st.dictionaries(st.text(max_size=8), JSON, max_size=2)))
        return body

    return build()


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = Served(["--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "64"])
    yield served
    served.stop()


def _routes(server: Served) -> dict[str, dict[str, Any]]:
    spec = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    routes = {}
    for path, ops in spec["paths"].items():
        body = ops.get("post", {}).get("requestBody")
        if body is not None:
            routes[path] = body["content"]["application/json"]["schema"]
    for schema in routes.values():  # n drawn small (see the module docstring)
        if "n" in schema.get("properties", {}):
            schema["properties"]["n"] = {**schema["properties"]["n"], "maximum": MAX_N}
    return routes


def _check(response: httpx.Response, streamed: bool) -> None:
    status = response.status_code
    assert status < 500, response.text[:500]
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        return
    assert status == 200
    if not streamed:
        answer = response.json()
        if "usage" in answer:
            n = len(answer["choices"])
            assert [choice["index"] for choice in answer["choices"]] == list(range(n))
            assert n <= answer["usage"]["completion_tokens"] < n * MAX_MODEL_LEN
        return
    events = [line[len("data: "):] for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        assert "choices" in json.loads(event)


def test_fuzzed_bodies_never_get_a_5xx(server: Served) -> None:
    routes = _routes(server)
    assert set(routes) == {"/v1/completions", "/v1/chat/completions", "/tokenize",
                           "/detokenize"}
    bodies = st.sampled_from(sorted(routes)).flatmap(
        lambda path: st.tuples(st.just(path), st.one_of(
            from_schema(routes[path]), mutated(routes[path]), JSON)))
    seen: dict[int, int] = {}

    @hypothesis.settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(bodies)
    def case(drawn: tuple[str, Any]) -> None:
        path, body = drawn
        response = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        _check(response, isinstance(body, dict) and body.get("stream") is True)

    try:
        case()
    except BaseException:
        print(server.output()[-6000:])  # the server's side of the first failure
        raise
    print(f"fuzz: {sum(seen.values())} cases, statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= CASES
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
