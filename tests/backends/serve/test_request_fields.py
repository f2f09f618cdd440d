"""`priority` and `cache_salt` in rt serve's request bodies, as vLLM 0.32 takes them: parsed
and refused at the parser, carried to the engine process, and their effect there (the
waiting queue's order under --policy priority, the prefix cache's sharing) on stand-in
sockets and through `rt serve --simulate`.

vLLM 0.32 accepts a non-zero `priority` under the fcfs policy and ignores it (its V1 engine
has no check; the "Priority scheduling is not enabled" error was the removed V0 engine's),
so rt serve does too (docs/serve.md, "Endpoints").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backends.engine.sampling_options import SamplingOptions
from backends.serve.api_error import ApiError
from backends.serve.messages import EngineRequest
from runtime import CacheConfig, SamplingParams, SchedulerConfig
from tests.backends.serve.test_engine_perf import Inbox, Outbox, Setup, _receive
from tests.backends.serve.test_parse_rules import parser
from tests.backends.serve.test_serve import Served

INT64_MAX = (1 << 63) - 1


# ---- the parser --------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "header", "priority"), [
    ({}, None, 0),
    ({"priority": -7}, None, -7),
    ({"priority": 3.0}, None, 3),  # an integral float is an int, as vLLM's schema takes it
    ({"priority": INT64_MAX}, None, INT64_MAX),
    ({"priority": -INT64_MAX - 1}, None, -INT64_MAX - 1),
    ({"priority": 4}, "-2", -2),  # vLLM's _get_priority: the header replaces the body's
    ({"priority": 4}, " 9 ", 9),  # read with int(), as vLLM
    ({"priority": 4}, "high", 4),  # a header int() cannot read is ignored
    ({}, "", 0),
])
def test_priority_is_parsed_as_vllm(body: dict[str, Any], header: str | None,
                                    priority: int) -> None:
    parsed = parser().parse(body, [5, 6], chat=False, priority_header=header)
    assert parsed.priority == priority


@pytest.mark.parametrize(("body", "header", "param", "kind"), [
    ({"priority": "x"}, None, "body.priority", "Bad Request"),  # the brief's sweep: was 200
    ({"priority": "3"}, None, "body.priority", "Bad Request"),  # rt does not coerce
    ({"priority": None}, None, "body.priority", "Bad Request"),  # vLLM: an int, not nullable
    ({"priority": 1.5}, None, "body.priority", "Bad Request"),
    ({"priority": True}, None, "body.priority", "Bad Request"),
    ({"priority": [1]}, None, "body.priority", "Bad Request"),
    ({"priority": INT64_MAX + 1}, None, "body.priority", "Bad Request"),
    ({}, str(INT64_MAX + 1), "x-vllm-priority", "BadRequestError"),
])
def test_bad_priorities_refused(body: dict[str, Any], header: str | None, param: str,
                                kind: str) -> None:
    with pytest.raises(ApiError) as err:
        parser().parse(body, [5, 6], chat=True, priority_header=header)
    assert (err.value.status, err.value.param, err.value.kind) == (400, param, kind)


@pytest.mark.parametrize("salt", ["s", "tenant-7 key", "é" * 128, "x" * 128])
def test_cache_salts_vllm_takes(salt: str) -> None:
    assert parser().parse({"cache_salt": salt}, [5, 6], chat=False).cache_salt == salt
    assert parser().parse({"cache_salt": None}, [5, 6], chat=False).cache_salt is None


NON_EMPTY = "Parameter 'cache_salt' must be a non-empty string if provided."
FORBIDDEN = ("Parameter 'cache_salt' must be at most 128 characters and must not contain "
             "'@', '/', '\\\\', or NUL.")  # vLLM 0.32's words, its doubled backslash too


@pytest.mark.parametrize(("salt", "message"), [
    ("", NON_EMPTY), (5, NON_EMPTY), (["a"], NON_EMPTY), (True, NON_EMPTY), ({}, NON_EMPTY),
    ("x" * 129, FORBIDDEN), ("a@b", FORBIDDEN), ("a/b", FORBIDDEN), ("a\\b", FORBIDDEN),
    ("a\x00b", FORBIDDEN),
    ("\ud800", "cache_salt is not valid Unicode text (a lone surrogate)"),
])
def test_bad_cache_salts_refused_as_vllm(salt: Any, message: str) -> None:
    """vLLM 0.32's validate_cache_salt runs before its schema: a wrong type is its own 400
    (`BadRequestError`, param `cache_salt`), not the schema's."""
    with pytest.raises(ApiError) as err:
        parser().parse({"cache_salt": salt}, [5, 6], chat=False)
    assert (err.value.status, err.value.param, err.value.kind, err.value.message) == \
        (400, "cache_salt", "BadRequestError", message)


# ---- the engine process (stand-in sockets, `test_engine_perf`'s) ---------------------------


def _add(req_id: str, prompt_len: int, max_tokens: int, priority: int = 0,
         salt: str | None = None) -> tuple[str, EngineRequest]:
    return ("add", EngineRequest(req_id, list(range(10, 10 + prompt_len)),
                                 SamplingParams(max_tokens, ignore_eos=True), SamplingOptions(),
                                 0.0, priority, salt))


def _run(setup: Setup, batches: list[list[tuple[str, Any]]]) -> list[Any]:
    """Every output the loop sent, in order."""
    from backends.serve.engine_process import EngineLoop

    inbox, outbox = Inbox(batches), Outbox()
    loop = EngineLoop(setup, inbox, outbox)  # type: ignore[arg-type]
    inbox.loop = loop  # type: ignore[assignment]
    loop.receive = lambda block: _receive(loop, inbox, block)  # type: ignore[method-assign]
    loop.run()
    return [out for message in outbox.sent for out in message.outputs]


def _one_seat(policy: str) -> Setup:
    return Setup(scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1,
                                           max_model_len=64, policy=policy))  # type: ignore[arg-type]


@pytest.mark.parametrize(("policy", "order"), [
    ("priority", ["b", "c", "a"]),  # priorities 0, 3, 5
    ("fcfs", ["a", "b", "c"]),  # arrival order: the priorities change nothing
])
def test_the_priority_orders_the_waiting_queue_under_the_priority_policy(
        policy: str, order: list[str]) -> None:
    """One seat (max_num_seqs 1), three requests in the queue at the first step: each runs
    its 2 tokens before the next is admitted, so the outputs come one request after the
    other, in the order the waiting queue hands them out."""
    outputs = _run(_one_seat(policy), [[_add("a", 8, 2, priority=5), _add("b", 8, 2, priority=0),
                                         _add("c", 8, 2, priority=3)]])
    assert [out.request_id for out in outputs] == [r for r in order for _ in range(2)]


def test_a_cache_salt_separates_prefix_caches() -> None:
    """40-token prompts, 16-token blocks: a hit is the 2 full blocks, 32 tokens. Each request
    (1 token) ends before the next arrives; its blocks stay cached. The salt is the first
    block's extra key, so a salted prompt shares nothing with the same prompt unsalted or
    salted otherwise, and everything with the same salt."""
    setup = Setup(cache=CacheConfig(block_size=16, num_blocks=32, enable_prefix_caching=True))
    requests = [("a", "s1"), ("b", "s1"), ("c", "s2"), ("d", None), ("e", None), ("f", "s2")]
    outputs = _run(setup, [[_add(name, 40, 1, salt=salt)] for name, salt in requests])
    assert [(out.request_id, out.num_cached_tokens) for out in outputs] == [
        ("a", 0), ("b", 32), ("c", 0), ("d", 0), ("e", 32), ("f", 32)]


# ---- rt serve --simulate -----------------------------------------------------------------


@pytest.fixture(scope="module")
def fcfs() -> Iterator[Served]:
    server = Served(["--simulate", "--gpu", "h200", "--max-model-len", "4096"])
    yield server
    server.stop()


def _completion(server: Served, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=30, headers=headers,
                      json={"max_tokens": 1, "ignore_eos": True, **body})


def _cached(server: Served, prompt: str, **extra: Any) -> int:
    response = _completion(server, {"prompt": prompt, **extra})
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


BAD_FIELDS: list[tuple[dict[str, Any], str, str]] = [
    ({"priority": "x"}, "body.priority", "Bad Request"),
    ({"priority": None}, "body.priority", "Bad Request"),
    ({"cache_salt": ""}, "cache_salt", "BadRequestError"),
    ({"cache_salt": 5}, "cache_salt", "BadRequestError"),
    ({"cache_salt": "a/b"}, "cache_salt", "BadRequestError")]
PROMPTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]


def test_bad_fields_get_400_in_vllms_shape(fcfs: Served) -> None:
    for body, param, kind in BAD_FIELDS:
        for path, prompt in PROMPTS:
            response = httpx.post(f"{fcfs.url}{path}", json={**prompt, **body}, timeout=10)
            assert response.status_code == 400, (path, body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["code"], error["param"], error["type"]) == (400, param, kind)


def test_a_priority_under_fcfs_is_accepted_as_vllm(fcfs: Served) -> None:
    assert _completion(fcfs, {"prompt": "hi", "priority": 7}).status_code == 200
    assert _completion(fcfs, {"prompt": "hi"}, **{"X-Vllm-Priority": "-3"}).status_code == 200


def test_a_cache_salt_keeps_identical_prompts_apart_end_to_end(fcfs: Served) -> None:
    """A 40-character prompt is 40 tokens (the byte tokenizer), 2 full 16-token blocks: a
    hit is 32 tokens. Chat prompts are salted the same way."""
    prompt = "salted prompt, 40 characters long ......"
    assert len(prompt) == 40
    assert _cached(fcfs, prompt, cache_salt="tenant-a") == 0
    assert _cached(fcfs, prompt, cache_salt="tenant-a") == 32
    assert _cached(fcfs, prompt, cache_salt="tenant-b") == 0
    assert _cached(fcfs, prompt) == 0  # unsalted: none of the salted blocks
    assert _cached(fcfs, prompt) == 32
    assert _cached(fcfs, prompt, cache_salt="tenant-b") == 32
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
            "cache_salt": "tenant-c"}
    usages = [httpx.post(f"{fcfs.url}/v1/chat/completions", json=chat, timeout=30
                         ).json()["usage"] for _ in range(2)]
    full_blocks = (usages[0]["prompt_tokens"] - 1) // 16 * 16  # the last token is computed
    assert full_blocks >= 32
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, full_blocks]
    # n > 1: each child is an engine request of its own, salted as its parent
    other = "parallel children salted, 40 chars ....."
    assert len(other) == 40
    assert _completion(fcfs, {"prompt": other, "n": 2, "temperature": 1.0,
                              "cache_salt": "tenant-n"}).status_code == 200
    assert _cached(fcfs, other, cache_salt="tenant-n") == 32
    assert _cached(fcfs, other) == 0


def _wait_until(server: Served, waiting: int) -> None:
    """Until the engine reports `waiting` requests in its queue (10 s at most)."""
    deadline = time.monotonic() + 10
    while server.metrics()["vllm:num_requests_waiting"] != waiting:
        assert time.monotonic() < deadline, f"never {waiting} waiting"
        time.sleep(0.02)


@pytest.mark.parametrize(("policy", "first"), [("priority", "urgent"), ("fcfs", "late")])
def test_the_priority_orders_the_queue_end_to_end(policy: str, first: str) -> None:
    """One seat: a stream holds it while `late` (priority 5), then `urgent` (priority 0, by
    the header) queue behind it; the stream's client leaves, and the queue's head runs to
    its end before the other starts. Under --policy priority `urgent` finishes first; under
    fcfs `late` does (it came first), its priority changing nothing."""
    server = Served(["--simulate", "--gpu", "h200", "--max-model-len", "4096",
                     "--max-num-seqs", "1", "--policy", policy])
    finished: list[str] = []
    statuses: dict[str, int] = {}

    def send(name: str, body: dict[str, Any], **headers: str) -> None:
        response = _completion(server, {"prompt": name, "max_tokens": 20, **body}, **headers)
        statuses[name] = response.status_code
        finished.append(name)

    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30, json={
                "prompt": "blocker", "max_tokens": 3000, "ignore_eos": True,
                "stream": True}) as blocker:
            lines = blocker.iter_lines()  # kept: the connection stays open
            next(line for line in lines if line.startswith("data:"))
            threads = [threading.Thread(target=send, args=("late", {"priority": 5}))]
            threads[0].start()
            _wait_until(server, 1)
            threads.append(threading.Thread(target=send, args=("urgent", {"priority": 9}),
                                            kwargs={"X-Vllm-Priority": "0"}))
            threads[1].start()
            _wait_until(server, 2)
        for thread in threads:  # leaving the block closed the blocker's connection
            thread.join(30)
        assert statuses == {"late": 200, "urgent": 200}
        assert finished[0] == first
    finally:
        server.stop()
