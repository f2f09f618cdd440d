"""rt serve answers as vLLM 0.32's `vllm serve` does, request for request.

tests/fixtures/api_diff/vllm_answers.json holds 177 requests (docs/tools/api_diff/cases.py:
test_hostile's malformed bodies, wrong types, missing fields, out-of-range values, transport
errors, valid completions and chats streamed or not, the info routes) and the shape of real
vLLM's answer to each (api_shape.py: status, media type, JSON keys, an error's type/code/param,
usage counts). Each goes to `rt serve --simulate` of the same tiny model directory; rt's answer
must have vLLM's shape, up to the differences no client can tell apart (`harmless`) and the
deliberate ones listed here (docs/tools/api_diff/README.md says why). Any other change of rt's
answers fails, and so does a deliberate difference that disappears.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.backends.serve.api_shape import MISSING, answer_shape, differences, harmless
from tests.backends.serve.test_serve import Served

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "api_diff" / "vllm_answers.json"
CASES: list[dict[str, Any]] = json.loads(FIXTURE.read_text())["cases"]


def _refused(param: str, kind: str = "BadRequestError") -> dict[str, Any]:
    """rt answers 400 where vLLM answers 200."""
    return {"status": (400, 200), "error": ({"param": param, "type": kind}, MISSING)}


_NOT_JSON = {"body.detail": (MISSING, "str"),  # vLLM: FastAPI's bare {"detail"}
             "body.error": ({"code": 400, "message": "str", "param": "body",
                             "type": "Bad Request"}, MISSING)}
# case -> {field: (rt's shape, vLLM's)}: the deliberate differences, by reason.
DELIBERATE: dict[str, dict[str, Any]] = {
    # A body that is not JSON text: vLLM answers FastAPI's {"detail": ...}; rt keeps the
    # OpenAI error shape (issue #18), as for every other malformed body.
    **{name: _NOT_JSON for name in ("hostile 3", "hostile 4", "hostile 6", "cmpl non-UTF-8 body",
                                    "cmpl latin-1 body")},
    # NaN is not JSON: rt refuses it while parsing; vLLM's parser takes it, its check refuses.
    "hostile 5": {"body.error.param": ("body", "temperature"),
                  "body.error.type": ("Bad Request", "BadRequestError")},
    # vLLM's schema coerces true and "4" to an int and "yes" to a bool; rt does not guess.
    "hostile 10": _refused("body.max_tokens", "Bad Request"),
    "cmpl max_tokens str": _refused("body.max_tokens", "Bad Request"),
    "cmpl n str": _refused("body.n", "Bad Request"),
    "cmpl stream str": _refused("body.stream", "Bad Request"),
    # Features rt serve does not implement are refused, not ignored (docs/serve.md).
    "hostile 25": _refused("prompt"),
    "cmpl batch of two prompts": _refused("prompt"),
    "cmpl best_of str": _refused("best_of"),
    "cmpl n 2 best_of 2": _refused("best_of"),  # vLLM 0.32's completions ignore best_of
    "cmpl logprobs 5": _refused("logprobs"),
    "chat logprobs true": _refused("logprobs"),
    "chat top_logprobs 5": _refused("logprobs"),
    "chat top_logprobs str": {"body.error.param": ("logprobs", "top_logprobs")},
    # A token id outside the vocabulary is refused on /detokenize too (vLLM decodes it).
    "hostile 37": _refused("tokens"),
    # rt's param names the field the client sent; vLLM's names another or none of its body.
    "chat max_completion_tokens 0": {"body.error.param": ("max_completion_tokens",
                                                          "max_tokens")},
    "cmpl prompt past max_model_len": {"body.error.param": ("prompt", "input_tokens")},
    "cmpl prompt of max_model_len": {"body.error.param": ("prompt", "max_tokens")},
    "chat prompt past max_model_len": {"body.error.param": ("messages", "input_tokens")},
}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Served, str]]:
    from backends.engine.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama()  # vLLM served this directory (its tokenizer, its name)
    server = Served(["--simulate", "--model", str(model_dir), "--max-model-len", "2048"])
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    yield server, model
    server.stop()


def ask(client: httpx.Client, case: dict[str, Any], model: str) -> dict[str, Any]:
    body = case["body_b64"]
    content = None if body is None else base64.b64decode(body).replace(b"@MODEL@",
                                                                        model.encode())
    response = client.request(case["method"], case["path"], content=content,
                              headers=case["headers"])
    return answer_shape(response.status_code, response.headers.get("content-type"),
                        response.content)


def deviations(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    return {path: (mine, vllm) for path, mine, vllm in differences(ours, theirs)
            if harmless((path, mine, vllm)) is None}


# Sampled at temperature 1 on both sides (request ids seed rt's simulated tokens): whether
# the stop string comes up in the 4 tokens is chance, in vLLM's answer as in rt's. A stop
# found changes only these fields of the answer's shape.
_BY_CHANCE = {"cmpl stop str": {"body.choices[0].finish_reason", "body.choices[0].stop_reason",
                                "body.usage.completion_tokens", "body.usage.total_tokens"}}


def _unchanced(name: str, found: dict[str, Any]) -> dict[str, Any]:
    """`found` without the fields that case `name` leaves to chance."""
    return {path: pair for path, pair in found.items() if path not in _BY_CHANCE.get(name, ())}


def test_rt_answers_every_request_as_vllm_did(served: tuple[Served, str]) -> None:
    server, model = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        got = {case["name"]: _unchanced(case["name"],
                                        deviations(ask(client, case, model), case["vllm"]))
               for case in CASES}
    wrong = {name: found for name, found in got.items() if found != DELIBERATE.get(name, {})}
    assert not wrong, json.dumps(wrong, indent=1, default=str)
    assert set(DELIBERATE) <= set(got)  # no stale entry


def test_the_shape_sees_a_changed_answer() -> None:
    """The comparison is not blind: an error's type, a missing key or a usage count differ."""
    case = next(c for c in CASES if c["name"] == "cmpl greedy")
    theirs = case["vllm"]
    body = dict(theirs["body"], usage=dict(theirs["body"]["usage"], completion_tokens=5))
    assert deviations(dict(theirs, body=body), theirs) == {
        "body.usage.completion_tokens": (5, 4)}
    assert deviations(dict(theirs, status=201), theirs) == {"status": (201, 200)}
