"""The streaming fast path byte for byte: the templated SSE chunks (`backends.serve.sse`)
against the dict -> `json.dumps` encoding they replaced, `Server.stream` end to end (role
chunk, tokens, finish and stop reasons, usage, an error mid-stream), the bulk ITL
histogram against `observe`, the bare-ASGI stream path (`stream_path`) and the FastAPI
routes' `EventStreamResponse` against Starlette's `StreamingResponse`, disconnect included,
and a stream cut before its first event aborting its requests on both paths."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from starlette.responses import StreamingResponse

from backends.engine.sampling_options import SamplingOptions
from backends.engine.text import ByteTokenizer
from backends.serve.api_error import EngineDeadError
from backends.serve.api_server import front, routes_app
from backends.serve.engine_client import OutputQueue
from backends.serve.messages import RequestOutput, decode
from backends.serve.metrics import ITL_BUCKETS, ServeMetrics, observe_all
from backends.serve.openai_protocol import Parsed
from backends.serve.request_state import RequestState
from backends.serve.server import ServeConfig, Server
from backends.serve.sse import ChunkEncoder
from backends.serve.stream_path import EventStream, EventStreamResponse, Last, stream
from runtime import SamplingParams
from tests.backends.serve.test_parse_rules import VOCAB, parser

TEXTS = ["", "a", 'quote " back \\ slash', "tab\tnew\nline\r\x00\x1f", "é ü 中文 🙂",
         "\u2028\u2029", "</script>"]
REASONS = [(None, None), ("length", None), ("stop", None), ("stop", 2), ("stop", "END"),
           ("abort", None)]
HEAD = {"id": "cmpl-r", "object": "text_completion", "created": 1700000000, "model": "m é"}


def _reference(head: dict[str, Any], text: str, chat: bool, finish: str | None,
               stop: int | str | None, usage: dict[str, Any] | None) -> bytes:
    """The chunk as the server built it before the templates (a dict through json.dumps)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish,
                              "stop_reason": stop}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    chunk = {**head, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()


@pytest.mark.parametrize("chat", [False, True])
def test_template_chunks_equal_the_dict_encoding(chat: bool) -> None:
    head = {**HEAD, "object": "chat.completion.chunk" if chat else "text_completion"}
    encoder = ChunkEncoder(head["id"], head["object"], head["created"], head["model"], chat)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 0}}
    for text in TEXTS:
        assert encoder.token(text) == _reference(head, text, chat, None, None, None)
        for finish, stop in REASONS:
            for use in (None, usage):
                assert encoder.chunk(text, finish, stop, use) == \
                    _reference(head, text, chat, finish, stop, use)


def _server() -> Server:
    def never() -> None:
        raise AssertionError("the engine is not started in this test")

    server = Server(ServeConfig("m", never))
    server.metrics = ServeMetrics("m", 256, 64, 16, True)
    return server


def _close(server: Server) -> None:
    engine = server.engine
    engine.input.close(linger=0)
    engine.output.close(linger=0)
    engine.context.term()
    engine.tmpdir.cleanup()


def _stream(chat: bool, items: list[RequestOutput | Exception], include_usage: bool,
            continuous: bool) -> list[bytes]:
    """`Server.stream`'s events for outputs queued one by one (each written before the
    next arrives, so none merge)."""

    async def scenario() -> list[bytes]:
        server = _server()
        parsed = Parsed([5, 6, 7], SamplingParams(max_tokens=9), SamplingOptions(), True,
                        include_usage, continuous)
        gen = RequestState("r", parsed, 0.0, ByteTokenizer(512).decoder(), OutputQueue())
        server.gens["r"] = gen
        server.awaiting_first = 1
        events = []
        chunks = server.stream(gen, "m", chat).events
        for item in items:
            gen.queue.put_nowait(item)
            events.append(await chunks.__anext__())
            if chat and len(events) == 1 and isinstance(item, RequestOutput):
                events.append(await chunks.__anext__())  # the role chunk came first
        events += [event async for event in chunks]
        _close(server)
        return events

    return asyncio.run(scenario())


def _expected(chat: bool, items: list[RequestOutput | Exception], include_usage: bool,
              continuous: bool, created: int) -> list[bytes]:
    """What the dict-built stream sent for the same outputs."""
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + "r",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": "m"}
    decoder = ByteTokenizer(512).decoder()
    events, done = [], 0

    def usage() -> dict[str, Any]:
        return {"prompt_tokens": 3, "completion_tokens": done, "total_tokens": 3 + done,
                "prompt_tokens_details": {"cached_tokens": 0}}

    for i, item in enumerate(items):
        if isinstance(item, Exception):
            assert isinstance(item, EngineDeadError)
            return [*events, f"data: {json.dumps(item.body(), separators=(',', ':'))}\n\n"
                    .encode() + b"data: [DONE]\n\n"]
        if chat and i == 0:
            role: dict[str, Any] = {**head, "choices": [{
                "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}]}
            if continuous:
                role["usage"] = {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
            events.append(f"data: {json.dumps(role, separators=(',', ':'))}\n\n".encode())
        done += len(item.new_token_ids)
        # vLLM leaves the text of the token that stopped the request out
        ids = item.new_token_ids[:-1] if item.finish_reason == "stop" else item.new_token_ids
        events.append(_reference(head, decoder.step(ids), chat,
                                 item.finish_reason, item.stop_reason,
                                 usage() if continuous else None))
    if include_usage:
        final = {**head, "choices": [], "usage": usage()}
        events.append(f"data: {json.dumps(final, separators=(',', ':'))}\n\n".encode())
    return [*events, b"data: [DONE]\n\n"]


def _created(events: list[bytes]) -> int:
    return int(json.loads(events[0][6:])["created"])


def _tokens(text: str) -> list[int]:
    return [3 + b for b in text.encode()]  # ByteTokenizer's ids


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(("include_usage", "continuous"), [(False, False), (True, False),
                                                           (True, True)])
@pytest.mark.parametrize("finish", [("length", None), ("stop", 2)])
def test_server_stream_equals_the_dict_built_stream(chat: bool, include_usage: bool,
                                                    continuous: bool, finish: tuple) -> None:
    # a multi-byte character split over two outputs: the first chunk's text is empty
    items: list[RequestOutput | Exception] = [
        RequestOutput("r", _tokens('a"\n')), RequestOutput("r", _tokens("é")[:1]),
        RequestOutput("r", _tokens("é")[1:] + _tokens("z")),
        RequestOutput("r", _tokens("!"), finish_reason=finish[0], stop_reason=finish[1])]
    events = _stream(chat, items, include_usage, continuous)
    expected = _expected(chat, items, include_usage, continuous, _created(events))
    # the stream's end is one write: the last token's chunk, the usage chunk, [DONE]
    tail = 3 if include_usage else 2
    assert events == [*expected[:-tail], b"".join(expected[-tail:])]
    assert events[-1].endswith(b"data: [DONE]\n\n") and len(events) == len(expected) - tail + 1
    # ... marked as the last (the ASGI stream ends with it), and only it
    assert [type(event) is Last for event in events] == [False] * (len(events) - 1) + [True]


@pytest.mark.parametrize("chat", [False, True])
def test_an_error_mid_stream_ends_it_with_the_error_then_done(chat: bool) -> None:
    """As vLLM's stream generators (serving_completion / serving_chat: `except Exception`
    yields the error event, then `data: [DONE]` follows it), in one last write."""
    items: list[RequestOutput | Exception] = [RequestOutput("r", _tokens("hi")),
                                              EngineDeadError()]
    events = _stream(chat, items, True, False)
    assert events == _expected(chat, items, True, False, _created(events))
    assert events[-1].startswith(b'data: {"error":')
    assert events[-1].endswith(b"\n\ndata: [DONE]\n\n")
    assert type(events[-1]) is Last


def test_bulk_itl_observations_equal_one_observe_each() -> None:
    values = [0.0, 0.01, 0.0100001, 0.003, 0.025, 1e-9, 80.0, 80.5, 7.5, 1e300, 0.1 + 0.2,
              *[0.001 * k for k in range(1, 300, 7)], math.nan, 0.05]
    one, bulk = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("itl", "x", ["m"], buckets=ITL_BUCKETS, registry=one).labels("a")
    h2 = Histogram("itl", "x", ["m"], buckets=ITL_BUCKETS, registry=bulk).labels("a")
    for value in [0.02, *values]:
        h1.observe(value)
    h2.observe(0.02)
    observe_all(h2, values[:10])
    observe_all(h2, [])
    observe_all(h2, values[10:])
    def samples(registry: CollectorRegistry) -> list[bytes]:
        return [line for line in generate_latest(registry).splitlines()
                if b"_created" not in line]  # when each was made

    assert samples(one) == samples(bulk)
    assert b'itl_bucket{le="0.01",m="a"} 6.0' in samples(bulk)


# ---- the bare-ASGI stream path against StreamingResponse ---------------------------------


async def _events(log: list[str], parts: list[bytes], hold: asyncio.Event | None = None
                  ) -> AsyncGenerator[bytes, None]:
    try:
        for part in parts:
            yield part
        if hold is not None:
            await hold.wait()  # a stream waiting for the engine's next output
    finally:
        log.append("closed")


def _drive(app: Any, disconnect_after: float | None) -> list[dict]:
    """ASGI messages an app sends for one request whose client leaves after
    `disconnect_after` seconds (None: stays)."""

    async def scenario() -> list[dict]:
        sent: list[dict] = []
        requests = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict:
            if requests:
                return requests.pop()
            await asyncio.sleep(3600 if disconnect_after is None else disconnect_after)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(dict(message))

        scope = {"type": "http", "method": "POST", "path": "/", "headers": [],
                 "asgi": {"version": "3.0", "spec_version": "2.3"}}
        await asyncio.wait_for(app(scope, receive, send), 5)
        return sent

    return asyncio.run(scenario())


def _nothing() -> None:
    """A stream's `forget` where no request stands behind it."""


@pytest.mark.parametrize("hold", [False, True])
def test_the_stream_path_sends_what_streaming_response_sent(hold: bool) -> None:
    """`stream` (rt serve's path) and `EventStreamResponse` (the FastAPI routes') send what
    Starlette's `StreamingResponse` sent, and close the stream."""
    parts = [b"data: {\"a\":1}\n\n", b"data: [DONE]\n\n"]
    logs: dict[str, list[str]] = {"new": [], "old": [], "routes": []}

    def events(log: str) -> AsyncGenerator[bytes, None]:
        return _events(logs[log], parts, asyncio.Event() if hold else None)

    async def new(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await stream(EventStream(events("new"), _nothing), receive, send)

    async def old(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        response = StreamingResponse(events("old"), media_type="text/event-stream")
        await response(scope, receive, send)

    async def routes(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await EventStreamResponse(EventStream(events("routes"), _nothing))(scope, receive,
                                                                            send)

    # held: the client leaves while the stream waits; all end quietly and close the stream
    sent_new = _drive(new, 0.05 if hold else None)
    sent_old = _drive(old, 0.05 if hold else None)
    assert sent_new == sent_old == _drive(routes, 0.05 if hold else None)
    assert logs == {"new": ["closed"], "old": ["closed"], "routes": ["closed"]}
    assert sent_new[0] == {"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8")]}
    assert sent_new[-1]["more_body"] is (True if hold else False)


def _chunked(messages: list[dict]) -> tuple[bytes, int]:
    """The response body on the wire as uvicorn frames `messages` (chunked), and the number
    of socket writes it makes for them (one per message)."""
    wire = b""
    for message in messages[1:]:
        body = message.get("body", b"")
        wire += (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + \
            (b"" if message.get("more_body") else b"0\r\n\r\n")
    return wire, len(messages)


def test_a_last_event_ends_the_stream_in_one_write_with_the_same_bytes() -> None:
    """`Last`: the stream's end goes out with the last event's message (one socket write
    less); the framed bytes are StreamingResponse's, to which `Last` is plain bytes."""
    parts = [b"data: {\"a\":1}\n\n", Last(b"data: {\"b\":2}\n\ndata: [DONE]\n\n")]
    logs: dict[str, list[str]] = {"new": [], "old": []}

    async def new(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await stream(EventStream(_events(logs["new"], [*parts, b"never sent"]), _nothing),
                     receive, send)

    async def old(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await StreamingResponse(_events(logs["old"], parts),
                                media_type="text/event-stream")(scope, receive, send)

    sent_new, sent_old = _drive(new, None), _drive(old, None)
    assert sent_new[1:] == [
        {"type": "http.response.body", "body": parts[0], "more_body": True},
        {"type": "http.response.body", "body": parts[1], "more_body": False}]
    assert _chunked(sent_new) == (_chunked(sent_old)[0], 3)
    assert _chunked(sent_old)[1] == 4
    assert logs == {"new": ["closed"], "old": ["closed"]}  # closed at its Last


def test_request_outputs_survive_the_wire_with_every_field() -> None:
    """`RequestOutput.__reduce__` lists the fields by hand: a field it forgets is lost."""
    import dataclasses

    from backends.serve.messages import EngineOutputs, SchedulerStats, decode, encode

    values: dict[str, Any] = {"request_id": "r", "new_token_ids": [7, 8],
                              "finish_reason": "stop", "stop_reason": "END"}
    for i, f in enumerate(dataclasses.fields(RequestOutput)):
        values.setdefault(f.name, i + 0.5 if "_s" in f.name else i + 1)
    out = RequestOutput(**values)
    batch = EngineOutputs(1.5, [out, RequestOutput("q", [1])],
                          SchedulerStats(1, 0, 0.5, 10, 2, 0))
    kind, back = decode(encode(("outputs", batch)))
    assert kind == "outputs" and back == batch
    assert [dataclasses.astuple(o) for o in back.outputs] == \
        [dataclasses.astuple(o) for o in batch.outputs]


# ---- a stream cut before its first event, on both paths ---------------------------------


def _cut_before_the_first_event(app: Any, body: dict[str, Any], spec: str
                                ) -> tuple[list[dict], str | None]:
    """The ASGI messages `app` sent for one request whose client leaves while the stream's
    headers are written (ASGI 2.3, uvicorn's: it disconnects then, the write still pending;
    2.4: the write fails), and the name of what `app` raised (None: nothing)."""

    async def scenario() -> tuple[list[dict], str | None]:
        sent: list[dict] = []
        writing = asyncio.Event()  # the headers are being written
        requests = [{"type": "http.request", "body": json.dumps(body).encode(),
                     "more_body": False}]

        async def receive() -> dict:
            if requests:
                return requests.pop()
            await writing.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(dict(message))
            if message["type"] == "http.response.start":
                writing.set()
                if spec == "2.4":
                    raise OSError("the client is gone")
                await asyncio.Event().wait()  # a socket that never drains

        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-type", b"application/json")], "query_string": b"",
                 "asgi": {"version": "3.0", "spec_version": spec}}
        try:
            await asyncio.wait_for(app(scope, receive, send), 5)
        except Exception as err:  # noqa: BLE001 - named for the test
            return sent, type(err).__name__
        return sent, None

    return asyncio.run(scenario())


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("spec", ["2.3", "2.4"])
@pytest.mark.parametrize("path", ["fastapi", "stream_path"])
def test_a_stream_cut_before_its_first_event_aborts_its_requests(
        n: int, spec: str, path: str, caplog: pytest.LogCaptureFixture) -> None:
    """The FastAPI routes (`routes_app` served alone) close their streams as `StreamPath`
    does: a stream cut while its headers are written never started its events (an async
    generator closed then skips its `finally`), and Starlette's `StreamingResponse` never
    closed it, which left its requests running in the engine and held by the server. Now,
    on both paths, every request is aborted and forgotten."""
    app = routes_app(ServeConfig("m", _never_started))
    server: Server = app.state.server
    server.metrics = ServeMetrics("m", 256, 64, 16, True)
    server.codec = ByteTokenizer(VOCAB)
    server.parser = parser()
    body = {"prompt": "hi", "stream": True, "max_tokens": 4, "n": n}
    try:
        with caplog.at_level(logging.CRITICAL):  # 2.4's ClientDisconnect, logged by FastAPI
            sent, raised = _cut_before_the_first_event(
                app if path == "fastapi" else front(app), body, spec)
        assert [message["type"] for message in sent] == ["http.response.start"]
        assert raised == (None if spec == "2.3" else
                          "ClientDisconnect" if path == "fastapi" else "OSError")
        engine = server.engine
        messages = [decode(engine.outgoing.get_nowait()) for _ in range(engine.outgoing.qsize())]
        ids = [request.request_id for kind, request in messages[:n] if kind == "add"]
        assert len(ids) == n and len(messages) == 2 * n
        assert messages[n:] == [("abort", [request_id]) for request_id in ids]
        assert server.gens == {} and server.awaiting_first == 0 and engine.streams == {}
    finally:
        _close(server)


def _never_started() -> None:
    raise AssertionError("the engine is not started in this test")
