"""`n` > 1 (parallel sampling, `backends/serve/parallel_sampling.py`) as vLLM 0.32 serves it:
n child requests `f"{i}_{parent}"` (seed + i when seeded), merged into one answer whose
choices carry their index, usage summing the children's tokens over the prompt counted once.

In process: the parser's rules, the fan-out, and `stream_all`'s bytes for outputs fed
by hand. Over HTTP: `--simulate` (n = 3 whole and streamed, a disconnect, the metrics) and the
tiny model (child i is the plain request with seed + i; a stop string ends its child only).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backends.engine.sampling_options import SamplingOptions
from backends.engine.text import ByteTokenizer
from backends.serve.api_error import ApiError, EngineDeadError
from backends.serve.engine_client import OutputQueue
from backends.serve.messages import RequestOutput, decode
from backends.serve.metrics import ServeMetrics
from backends.serve.openai_protocol import MAX_N, Parsed
from backends.serve.parallel_sampling import (
    FAN_OUT_CHUNK,
    ParentRequest,
    child_request_id,
    child_sampling,
    complete_all,
    fan_out,
    stream_all,
)
from backends.serve.request_state import RequestState
from backends.serve.server import ServeConfig, Server
from runtime import SamplingParams
from tests.backends.serve.test_parse_rules import parser
from tests.backends.serve.test_serve import Served, _first_data

# ---- the rules, at the parser -----------------------------------------------------------


@pytest.mark.parametrize(("body", "n"), [({}, 1), ({"n": 3}, 3), ({"n": 2.0}, 2),
                                         ({"n": MAX_N}, MAX_N)])
def test_n_in_vllms_range_is_served(body: dict[str, Any], n: int) -> None:
    assert parser().parse(body, [5, 6], chat=False).n == n


def test_a_null_n_is_1_in_chat_only() -> None:
    """vLLM's schemas: the chat API's `n` is `int | None`, the completions API's `int`."""
    assert parser().parse({"n": None}, [5, 6], chat=True).n == 1
    with pytest.raises(ApiError) as err:
        parser().parse({"n": None}, [5, 6], chat=False)
    assert (err.value.status, err.value.param, err.value.kind) == (400, "body.n",
                                                                     "Bad Request")


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"n": 0}, "n", "n must be at least 1, got 0."),
    ({"n": -1}, "n", "n must be at least 1, got -1."),
    ({"n": MAX_N + 1}, "n", "n must be at most 16384, got 16385. To increase this limit, "
                            "set the VLLM_MAX_N_SEQUENCES environment variable."),
    ({"n": "2"}, "body.n", "n must be int, got '2'"),
    ({"n": True}, "body.n", "n must be int, got a boolean"),
    # vLLM's SamplingParams._verify_greedy_sampling (temperature below 1e-5 is greedy)
    ({"n": 2, "temperature": 0}, "n", "n must be 1 when using greedy sampling, got 2."),
    ({"n": 2, "temperature": 1e-6}, "n", "n must be 1 when using greedy sampling, got 2."),
    ({"n": 2, "best_of": 3}, "best_of", "best_of is not supported by rt serve"),
])
def test_n_out_of_range_or_greedy_refused(body: dict[str, Any], param: str,
                                          message: str) -> None:
    with pytest.raises(ApiError) as err:
        parser().parse(body, [5, 6], chat=False)
    assert (err.value.status, err.value.param, err.value.message) == (400, param, message)


def test_greedy_n_1_is_served() -> None:
    assert parser().parse({"n": 1, "temperature": 0}, [5, 6], chat=True).n == 1


def test_children_get_vllms_ids_and_seed_plus_index() -> None:
    seeded = SamplingOptions(temperature=0.7, seed=(1 << 63) - 1)
    assert [child_request_id(i, "abc") for i in range(3)] == ["0_abc", "1_abc", "2_abc"]
    assert [child_sampling(seeded, i).seed for i in range(3)] == \
        [(1 << 63) - 1, 1 << 63, (1 << 63) + 1]  # torch's manual_seed takes up to 2**64 - 1
    assert child_sampling(seeded, 2).temperature == 0.7
    unseeded = SamplingOptions(temperature=0.7)
    assert child_sampling(unseeded, 5) is unseeded


def test_a_parent_checks_its_children() -> None:
    queue = OutputQueue()
    parsed = Parsed([1], SamplingParams(max_tokens=2), SamplingOptions(1.0), False, False,
                    False, n=2)

    def child(request_id: str, on: OutputQueue) -> RequestState:
        return RequestState(request_id, parsed, 0.0, ByteTokenizer(512).decoder(), on)

    with pytest.raises(ValueError, match="n >= 2"):
        ParentRequest("p", [child("0_p", queue)], queue)
    with pytest.raises(ValueError, match="0_p..1_p in order"):
        ParentRequest("p", [child("1_p", queue), child("0_p", queue)], queue)
    with pytest.raises(ValueError, match="parent's queue"):
        ParentRequest("p", [child("0_p", queue), child("1_p", OutputQueue())], queue)


# ---- the fan-out and the stream, in process -----------------------------------------------


@contextlib.contextmanager
def _serving(limit: int | None = None) -> Iterator[Server]:
    """A server without its engine process (what it sends stays in `engine.outgoing`);
    its sockets closed at the end, whatever happened (a ZeroMQ context collected with open
    sockets blocks forever)."""
    def never() -> None:
        raise AssertionError("the engine is not started in this test")

    server = Server(ServeConfig("m", never, max_num_queued_requests=limit))
    server.metrics = ServeMetrics("m", 256, 64, 16, True)
    server.codec = ByteTokenizer(512)
    try:
        yield server
    finally:
        engine = server.engine
        engine.input.close(linger=0)
        engine.output.close(linger=0)
        engine.context.term()
        engine.tmpdir.cleanup()


def _parsed(n: int, stream: bool = True, include_usage: bool = True,
            continuous: bool = False, seed: int | None = None) -> Parsed:
    return Parsed([5, 6, 7], SamplingParams(max_tokens=9), SamplingOptions(1.0, seed=seed),
                  stream, include_usage, continuous, n=n)


@pytest.mark.parametrize("n", [1, 3])
def test_a_stream_closed_before_it_starts_aborts_its_requests(n: int) -> None:
    """A stream cancelled while its headers go out is closed before its first step, and
    an async generator closed then skips its `finally`: its requests are aborted all the
    same (`EventStream.aclose`), none left running in the engine or held by the server."""
    async def close_unread(server: Server) -> list[str]:
        if n == 1:
            gen = server.admit(_parsed(1), 0.0)
            events, ids = server.stream(gen, "m", False), [gen.request_id]
        else:
            parent = await fan_out(server, _parsed(n), 0.0)
            events = stream_all(server, parent, "m", False)
            ids = [child.request_id for child in parent.children]
        await events.aclose()
        return ids

    with _serving() as server:
        ids = asyncio.run(close_unread(server))
        sent = [decode(server.engine.outgoing.get_nowait()) for _ in range(2 * n)]
        assert server.engine.outgoing.empty()
        assert [kind for kind, _ in sent] == ["add"] * n + ["abort"] * n
        assert [payload for _, payload in sent[n:]] == [[i] for i in ids]
        assert server.gens == {} and server.awaiting_first == 0
        assert server.engine.streams == {}


def test_fan_out_sends_n_children_with_their_seeds_on_one_queue() -> None:
    with _serving() as server:
        parent = asyncio.run(fan_out(server, _parsed(3, seed=40), 0.0))
        sent = [decode(server.engine.outgoing.get_nowait()) for _ in range(3)]
        assert server.engine.outgoing.empty()
        assert [(kind, req.request_id, req.sampling.seed) for kind, req in sent] == \
            [("add", f"{i}_{parent.request_id}", 40 + i) for i in range(3)]
        assert all(req.prompt_token_ids == [5, 6, 7] and req.params.max_tokens == 9
                   for _, req in sent)
        assert set(server.engine.streams) == {f"{i}_{parent.request_id}" for i in range(3)}
        assert {id(q) for q in server.engine.streams.values()} == {id(parent.queue)}
        assert server.awaiting_first == 3 and len(server.gens) == 3


def test_admission_counts_n_requests() -> None:
    """vLLM's check_admission: a request with n > 1 takes n slots of the queue limit."""
    with _serving(limit=3) as server:
        asyncio.run(fan_out(server, _parsed(2), 0.0))  # 2 of 3 awaiting a first token
        with pytest.raises(ApiError) as err:
            asyncio.run(fan_out(server, _parsed(2), 0.0))
        assert err.value.status == 503
        assert server.engine.outgoing.qsize() == 2  # the refused request sent nothing
        server.admit(_parsed(1), 0.0)  # the third slot
        assert server.awaiting_first == 3


def test_a_large_fan_out_lets_other_tasks_run() -> None:
    """`fan_out` yields to the event loop after every `FAN_OUT_CHUNK` children: a task that
    notes how many children were sent each time it gets to run sees each chunk's end, in
    order (before: nothing ran until all n were sent)."""
    n = 3 * FAN_OUT_CHUNK + 5

    async def scenario(server: Server) -> tuple[list[int], ParentRequest]:
        seen: list[int] = []

        async def note() -> None:
            while True:
                seen.append(len(server.gens))
                await asyncio.sleep(0)

        noting = asyncio.create_task(note())
        parent = await fan_out(server, _parsed(n), 0.0)
        noting.cancel()
        return seen, parent

    with _serving() as server:
        seen, parent = asyncio.run(scenario(server))
        assert seen == [FAN_OUT_CHUNK, 2 * FAN_OUT_CHUNK, 3 * FAN_OUT_CHUNK]
        assert [child.request_id for child in parent.children] == \
            [f"{i}_{parent.request_id}" for i in range(n)]
        assert server.engine.outgoing.qsize() == n and server.awaiting_first == n


def test_a_fan_out_holds_its_n_places_while_it_yields() -> None:
    """Admission is checked once for all n, and their places are taken at once: a request
    that comes while the fan-out yields (one chunk sent) finds the queue limit reached."""
    n = 2 * FAN_OUT_CHUNK

    async def scenario(server: Server) -> list[tuple[int, int]]:
        refused: list[tuple[int, int]] = []  # (children sent, status) per refusal

        async def admit_one() -> None:
            try:
                server.admit(_parsed(1), 0.0)
            except ApiError as err:
                refused.append((len(server.gens), err.status))

        await asyncio.gather(fan_out(server, _parsed(n), 0.0), admit_one())
        return refused

    with _serving(limit=n) as server:
        assert asyncio.run(scenario(server)) == [(FAN_OUT_CHUNK, 503)]
        assert server.awaiting_first == n and len(server.gens) == n


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_fan_out_cancelled_half_way_aborts_exactly_the_children_sent(chunks: int) -> None:
    """Cancelled at its yield after `chunks` chunks (the client gone, a shutdown): the
    children sent are aborted in the engine, in order, and none is left held by the server
    or the engine client; none after them is sent; the places held for them are free."""
    n, cut = 4 * FAN_OUT_CHUNK, chunks * FAN_OUT_CHUNK

    async def scenario(server: Server) -> None:
        fanning = asyncio.create_task(fan_out(server, _parsed(n), 0.0))

        async def cancel_at_cut() -> None:
            while len(server.gens) < cut:
                await asyncio.sleep(0)
            fanning.cancel()

        cancelling = asyncio.create_task(cancel_at_cut())
        with pytest.raises(asyncio.CancelledError):
            await fanning
        await cancelling

    with _serving(limit=n) as server:
        asyncio.run(scenario(server))
        sent = [decode(server.engine.outgoing.get_nowait())
                for _ in range(server.engine.outgoing.qsize())]
        assert len(sent) == 2 * cut
        parent_id = sent[0][1].request_id.partition("_")[2]
        ids = [child_request_id(i, parent_id) for i in range(cut)]
        assert [(kind, req.request_id) for kind, req in sent[:cut]] == \
            [("add", i) for i in ids]
        assert sent[cut:] == [("abort", [i]) for i in ids]
        assert server.gens == {} and server.awaiting_first == 0
        assert server.engine.streams == {}
        assert server.metrics is not None
        assert server.metrics.registry.get_sample_value(
            "vllm:request_success_total",
            {"model_name": "m", "engine": "0", "finished_reason": "abort"}) == cut
        asyncio.run(fan_out(server, _parsed(n), 0.0))  # every place is free again
        assert server.awaiting_first == n


def _tokens(text: str) -> list[int]:
    return [3 + b for b in text.encode()]  # ByteTokenizer's ids


def _run_stream(chat: bool, parsed: Parsed, feed: list[tuple[int, RequestOutput]]
                ) -> tuple[list[bytes], str]:
    """`stream_all`'s events for `feed` (child index, output), queued in that order (a
    parent's outputs are taken one at a time, never merged)."""

    async def scenario() -> tuple[list[bytes], str]:
        with _serving() as server:
            parent = await fan_out(server, parsed, 0.0)
            for index, out in feed:
                out.request_id = f"{index}_{parent.request_id}"
                parent.queue.put_nowait(out)
            events = [event async for event in stream_all(server, parent, "m", chat)]
            assert not server.gens and server.awaiting_first == 0
            return events, parent.request_id

    return asyncio.run(scenario())


def _split(events: list[bytes]) -> list[Any]:
    data = b"".join(events).decode().split("\n\n")
    assert data[-1] == "" and data[-2] == "data: [DONE]"
    return [json.loads(event.removeprefix("data: ")) for event in data[:-2]]


@pytest.mark.parametrize("chat", [False, True])
def test_the_stream_names_each_choice_and_sums_the_usage(chat: bool) -> None:
    feed = [(1, RequestOutput("", _tokens("ab"), num_cached_tokens=0)),
            (0, RequestOutput("", _tokens("x"), num_cached_tokens=16)),
            (1, RequestOutput("", _tokens("c"), finish_reason="length")),
            (1, RequestOutput("", _tokens("z"))),  # after its end (an abort in flight)
            (0, RequestOutput("", _tokens("yz") + [2], finish_reason="stop", stop_reason=2))]
    events, rid = _run_stream(chat, _parsed(2, continuous=True), feed)
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "model": "m"}
    got = _split(events)
    created = got[0]["created"]

    def chunk(index: int, text: str, finish: str | None, stop: int | None,
              done: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish,
                                  "stop_reason": stop}
        choice |= {"delta": {"content": text}} if chat else {"text": text}
        return {**head, "created": created, "choices": [choice],
                "usage": {"prompt_tokens": 3, "completion_tokens": done,
                          "total_tokens": 3 + done,
                          "prompt_tokens_details": {"cached_tokens": 16 * (index == 0)}}}

    roles = [{**head, "created": created, "choices": [{
        "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
        "finish_reason": None}], "usage": {"prompt_tokens": 3, "completion_tokens": 0,
                                           "total_tokens": 3}} for i in (0, 1)]
    # the stop token's text is left out, its count in; the stream's cached tokens are the
    # first output's (vLLM's `first_iteration`)
    assert got == [*(roles if chat else []), chunk(1, "ab", None, None, 2),
                   chunk(0, "x", None, None, 1), chunk(1, "c", "length", None, 3),
                   chunk(0, "yz", "stop", 2, 4),
                   {**head, "created": created, "choices": [], "usage": {
                       "prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
                       "prompt_tokens_details": {"cached_tokens": 0}}}]


# ---- over HTTP: --simulate ------------------------------------------------------------------


@pytest.fixture(scope="module")
def simulated() -> Iterator[Served]:
    server = Served(["--simulate", "--gpu", "h200", "--max-model-len", "4096"])
    yield server
    server.stop()


def _count(m: dict[str, float], name: str) -> float:
    return m.get(name, 0.0)


def test_n3_whole_answer_on_the_simulated_engine(simulated: Served) -> None:
    before = simulated.metrics()
    answer = httpx.post(f"{simulated.url}/v1/completions", timeout=30, json={
        "prompt": "hello", "max_tokens": 5, "n": 3, "ignore_eos": True}).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [(c["finish_reason"], c["stop_reason"]) for c in answer["choices"]] == \
        [("length", None)] * 3
    assert answer["usage"] | {"prompt_tokens_details": None} == {
        "prompt_tokens": 5, "completion_tokens": 15, "total_tokens": 20,
        "prompt_tokens_details": None}
    assert answer["id"].startswith("cmpl-") and "_" not in answer["id"]
    after = simulated.metrics()

    def delta(name: str) -> float:
        return _count(after, name) - _count(before, name)

    # per child: 3 requests of 5 prompt and 5 generated tokens each
    assert delta("vllm:request_success_total") == 3
    assert (delta("vllm:request_generation_tokens_count"),
            delta("vllm:request_generation_tokens_sum")) == (3, 15)
    assert delta("vllm:generation_tokens_total") == 15
    assert delta("vllm:prompt_tokens_total") == 15
    assert delta("vllm:request_prompt_tokens_count") == 3
    assert delta("vllm:request_params_max_tokens_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    # per parent: one n=3 request whose longest child made 5 tokens
    assert (delta("vllm:request_params_n_count"), delta("vllm:request_params_n_sum")) == (1, 3)
    assert (delta("vllm:request_max_num_generation_tokens_count"),
            delta("vllm:request_max_num_generation_tokens_sum")) == (1, 5)


def _events(response: httpx.Response) -> list[Any]:
    lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("chat", [False, True])
def test_n3_streamed_on_the_simulated_engine(simulated: Served, chat: bool) -> None:
    body: dict[str, Any] = {"max_tokens": 4, "n": 3, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hey"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.stream("POST", f"{simulated.url}{path}", json=body, timeout=30) as response:
        events = _events(response)
    prompt = events[-1]["usage"]["prompt_tokens"]
    assert prompt == (19 if chat else 3)  # the chat template around "hi" (ByteTokenizer)
    if chat:  # one role chunk per choice, first
        assert [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in events[:3]] == \
            [(i, {"role": "assistant", "content": ""}) for i in range(3)]
        events = events[3:]
    counts: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for event in events[:-1]:
        (choice,) = event["choices"]
        counts[choice["index"]].append(event["usage"]["completion_tokens"])
        if choice["finish_reason"] is not None:
            finishes[choice["index"]].append(choice["finish_reason"])
    # each choice's own count, growing to 4 (one chunk per token unless merged: never here)
    assert counts == {i: [1, 2, 3, 4] for i in range(3)}
    assert finishes == {i: ["length"] for i in range(3)}
    assert events[-1]["choices"] == []
    assert {k: events[-1]["usage"][k] for k in ("prompt_tokens", "completion_tokens",
                                                 "total_tokens")} == \
        {"prompt_tokens": prompt, "completion_tokens": 12, "total_tokens": prompt + 12}


def test_a_disconnect_aborts_every_child(simulated: Served) -> None:
    before = simulated.metrics()
    with httpx.stream("POST", f"{simulated.url}/v1/completions", timeout=30, json={
            "prompt": "a" * 100, "max_tokens": 3000, "ignore_eos": True, "stream": True,
            "n": 3}) as response:
        lines = response.iter_lines()  # kept: the connection stays open
        _first_data(lines)
        deadline = time.monotonic() + 10
        while simulated.metrics()["vllm:num_requests_running"] < 3:
            assert time.monotonic() < deadline, "the 3 children never ran together"
            time.sleep(0.02)
        assert simulated.metrics()["vllm:kv_cache_usage_perc"] > 0
    disconnected = time.monotonic()
    while (m := simulated.metrics())["vllm:kv_cache_usage_perc"] > 0 \
            or m["vllm:num_requests_running"] > 0:
        assert time.monotonic() < disconnected + 10, "children still run after the disconnect"
        time.sleep(0.02)
    assert m["vllm:request_success_total"] - before["vllm:request_success_total"] == 3
    # aborted: no parent observation (vLLM records n only when the last child finishes)
    assert m["vllm:request_params_n_count"] == before["vllm:request_params_n_count"]


# ---- over HTTP: the tiny model --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> Iterator[Served]:
    """One request per step (`--max-num-seqs 1`): a child then runs alone, as the plain
    request it is compared with (batched with its siblings its logits could differ in the
    last bits: float32 CPU matmuls are not batch invariant, nor are vLLM's). The flake
    once seen here (a plain request's text short of its child's) was the decoder dropping
    a merged output's text that ended in an incomplete character, fixed in
    `backends.engine.text` (tests/backends/engine/test_tiny_model.py)."""
    server = Served(["--max-model-len", "256", "--num-gpu-blocks-override", "64",
                     "--max-num-seqs", "1"])
    yield server
    server.stop()


BODY = {"prompt": [5, 6, 7, 8], "temperature": 1.0, "ignore_eos": True, "max_tokens": 12}


def _complete(server: Served, **extra: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/completions", json={**BODY, **extra}, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_child_i_samples_as_a_plain_request_with_seed_plus_i(tiny: Served) -> None:
    """vLLM's ParentRequest gives child i seed + i: its text is the plain request's with
    that seed, token for token (the tiny model's tokenizer: one character per token)."""
    plain = [_complete(tiny, seed=1000 + i)["choices"][0]["text"] for i in range(3)]
    assert len(set(plain)) == 3  # three different samples to tell apart
    answer = _complete(tiny, seed=1000, n=3)
    assert [c["text"] for c in answer["choices"]] == plain
    assert answer["usage"]["completion_tokens"] == 36
    streamed = httpx.post(f"{tiny.url}/v1/completions", timeout=60, json={
        **BODY, "seed": 1000, "n": 3, "stream": True})
    texts = ["", "", ""]
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] += choice["text"]
    assert texts == plain


def test_a_stop_string_ends_its_child_only(tiny: Served) -> None:
    plain = [_complete(tiny, seed=2000 + i)["choices"][0]["text"] for i in range(2)]
    # two characters of child 0's text that child 1's never holds
    stop = next(plain[0][k:k + 2] for k in range(2, 10) if plain[0][k:k + 2] not in plain[1])
    cut = plain[0].find(stop)
    needed = next(k for k in range(1, 13)
                  if stop in _complete(tiny, seed=2000, max_tokens=k)["choices"][0]["text"])
    answer = _complete(tiny, seed=2000, n=2, stop=stop)
    assert [(c["index"], c["text"], c["finish_reason"], c["stop_reason"])
            for c in answer["choices"]] == [(0, plain[0][:cut], "stop", stop),
                                            (1, plain[1], "length", None)]
    assert answer["usage"]["completion_tokens"] == needed + 12


def test_the_whole_answer_lists_choices_by_index_whatever_order_they_end() -> None:
    """Child 2 ends first, child 0 last; `choices` are still 0, 1, 2, each with its own
    reasons; the usage's cached tokens are the last child's to finish (vLLM's final
    RequestOutput is that child's)."""

    async def scenario() -> dict[str, Any]:
        with _serving() as server:
            parent = await fan_out(server, _parsed(3, stream=False), 0.0)
            rid = parent.request_id
            for index, out in [
                    (2, RequestOutput("", _tokens("c") + [2], "stop", 2, num_cached_tokens=0)),
                    (0, RequestOutput("", _tokens("a"), num_cached_tokens=16)),
                    (1, RequestOutput("", _tokens("bb"), "length", num_cached_tokens=0)),
                    (0, RequestOutput("", _tokens("A"), "length", num_cached_tokens=16))]:
                out.request_id = f"{index}_{rid}"
                parent.queue.put_nowait(out)
            texts = await complete_all(server, parent)
            assert not server.gens and server.awaiting_first == 0
            answer = parent.response(texts, "m", False, 1700000000)
            assert answer["id"] == f"cmpl-{rid}"
            return answer

    answer = asyncio.run(scenario())
    assert [(c["index"], c["text"], c["finish_reason"], c["stop_reason"])
            for c in answer["choices"]] == [(0, "aA", "length", None),
                                            (1, "bb", "length", None), (2, "c", "stop", 2)]
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                               "prompt_tokens_details": {"cached_tokens": 16}}


def _abort_count(server: Server) -> float | None:
    """`vllm:request_success_total{finished_reason="abort"}`."""
    assert server.metrics is not None
    return server.metrics.registry.get_sample_value(
        "vllm:request_success_total",
        {"model_name": "m", "engine": "0", "finished_reason": "abort"})


def test_a_whole_answer_cancelled_aborts_the_children_still_running() -> None:
    """The handler of a whole answer cancelled while it waits (the client gone, a
    shutdown): the two children still running are aborted in the engine, in index order,
    the finished one is not; none is left held, every place is free."""

    async def scenario(server: Server) -> list[str]:
        parent = await fan_out(server, _parsed(3, stream=False), 0.0)
        rid = parent.request_id
        for index, out in [(0, RequestOutput("", _tokens("a"))),
                           (1, RequestOutput("", _tokens("bb"), "length"))]:
            out.request_id = f"{index}_{rid}"
            parent.queue.put_nowait(out)
        waiting = asyncio.create_task(complete_all(server, parent))
        await asyncio.sleep(0)  # it takes both outputs, then waits for the next
        assert parent.queue.empty() and not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return [child_request_id(i, rid) for i in range(3)]

    with _serving() as server:
        ids = asyncio.run(scenario(server))
        sent = [decode(server.engine.outgoing.get_nowait())
                for _ in range(server.engine.outgoing.qsize())]
        assert [kind for kind, _ in sent] == ["add"] * 3 + ["abort"] * 2
        assert [payload for _, payload in sent[3:]] == [[ids[0]], [ids[2]]]
        assert server.gens == {} and server.awaiting_first == 0
        assert server.engine.streams == {}
        assert _abort_count(server) == 2


def test_a_dead_engine_ends_the_stream_with_its_error_and_forgets_every_child() -> None:
    """The children are let go, not aborted (as a plain request's stream: the engine that
    would run an abort is gone), and counted as no abort."""
    async def scenario() -> list[bytes]:
        with _serving() as server:
            parent = await fan_out(server, _parsed(2), 0.0)
            parent.queue.put_nowait(RequestOutput(f"1_{parent.request_id}", _tokens("x")))
            for _ in range(2):  # the engine client fails each child's stream
                parent.queue.put_nowait(EngineDeadError())
            events = [event async for event in stream_all(server, parent, "m", False)]
            assert not server.gens and server.awaiting_first == 0
            sent = [decode(server.engine.outgoing.get_nowait())
                    for _ in range(server.engine.outgoing.qsize())]
            assert [kind for kind, _ in sent] == ["add", "add"]  # no abort sent
            assert server.engine.streams == {}
            assert _abort_count(server) == 0
            return events

    events = asyncio.run(scenario())
    assert [json.loads(e.removeprefix(b"data: "))["choices"][0]["index"]
            for e in events[:-1]] == [1]
    assert events[-1] == f"data: {json.dumps(EngineDeadError().body(), separators=(',', ':'))}"\
        "\n\ndata: [DONE]\n\n".encode()
