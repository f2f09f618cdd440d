"""`rt serve`'s generation routes as bare ASGI: POST /v1/completions and /v1/chat/completions.

ASGI middleware in front of the FastAPI app (`api_server.front`: behind `guard.RequestGuard`,
so the API key and the body limit apply first, and outside FastAPI's own middleware chain): it
runs the handler itself (`Generate`, the same one FastAPI's routes run) and writes a stream as
ASGI messages, each SSE event's bytes as one `http.response.body` with `more_body`, skipping
FastAPI's routing and middlewares, its exception wrappers around every `send` and Starlette's
`StreamingResponse` (a task group per response): most of the API process's CPU per streamed
token at 200 streams (docs/serve.md, "Where tokens bunched at 200 streams", "uvloop and
httptools"). FastAPI keeps the routes (and so `/openapi.json`); every other path and method
goes to it.

What the client sees is `StreamingResponse`'s: the same status, headers
(`content-type: text/event-stream; charset=utf-8`, chunked) and bytes; a non-streaming answer
or an error is the same `JSONResponse`. A client that disconnects cancels the stream at once,
even while it waits for its first token (as `StreamingResponse` listening for
`http.disconnect` under ASGI spec 2.3, uvicorn's), which aborts its request in the engine; a
non-streaming one is gathered under `unless_client_leaves`, which does the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from backends.serve import sse
from backends.serve.api_error import SHUT_DOWN, ApiError
from backends.serve.openai_protocol import GENERATION_PATHS as PATHS

T = TypeVar("T")
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class EventStream:
    """A streamed answer: its SSE events, and `forget`, what closing it owes the request
    whatever the events did. An async generator closed before its first step skips its
    `finally`, so a stream cancelled while its headers were sent (the client gone, a
    shutdown) would leave its request running in the engine and held by the server;
    `aclose` calls `forget` after the events' own end (it must do nothing for a request
    that end already let go)."""

    events: AsyncGenerator[bytes, None]
    forget: Callable[[], None]

    def __aiter__(self) -> AsyncGenerator[bytes, None]:
        return self.events

    async def aclose(self) -> None:
        try:
            await self.events.aclose()
        finally:
            self.forget()


class EventStreamResponse(StreamingResponse):
    """Starlette's `StreamingResponse` of an `EventStream` (the FastAPI routes' answer to a
    stream, `api_server._generation_routes`) that closes it however the response ends:
    `StreamingResponse` never closes its body, so a stream cut before its first step (the
    client gone while the headers were written, a send that failed, a cancellation) left
    its request running in the engine and held by the server. Same status, headers and
    bytes as `StreamingResponse`."""

    def __init__(self, events: EventStream) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()  # the abort, if the request still runs


# (request, chat) -> a response to send, or the SSE events of a stream
Generate = Callable[[Request, bool], Awaitable[Response | EventStream]]

_SSE_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")


class Last(bytes):
    """A stream's last bytes, yielded as such by a generator that knows they are: `stream`
    sends them as the response's last message (`more_body` false), so the server writes
    them and the chunked body's terminator in one socket write instead of two (the bytes
    on the wire are the same; at 200 streams of 1-token requests the API process made 3
    writes per request, now 2). To anything else (Starlette's `StreamingResponse`) they are
    plain bytes."""

    __slots__ = ()


class StreamPath:
    """ASGI middleware: the generation routes through `generate`, the rest to `app`."""

    def __init__(self, app: ASGIApp, generate: Generate) -> None:
        self.app = app
        self.generate = generate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if chat is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            answer = await self.generate(Request(scope, receive), chat)
        except ApiError as err:
            answer = err.response()
        except ClientGone:  # its request aborted; nobody to answer
            return
        except asyncio.CancelledError:  # a shutdown cut it (no response started yet): the
            # handler was cancelled (uvicorn's `Server.shutdown`), which aborted the request;
            # the log has uvicorn's one line ("Cancel N running task(s) ..."), no traceback
            _uncancel()
            answer = SHUT_DOWN.response()
        if isinstance(answer, Response):
            await answer(scope, receive, send)
        else:
            await stream(answer, receive, send)


class ClientGone(Exception):
    """The client disconnected before its non-streaming answer was ready (nothing to send)."""


async def unless_client_leaves(work: Awaitable[T], receive: Receive) -> T:
    """`work`'s result (a non-streaming answer being gathered, its body read already); when
    the client disconnects first, `work` is cancelled, which aborts its request in the engine
    (`Server.complete`, `complete_all`), and ClientGone raised: as vLLM's `with_cancellation`
    (a client that gave up once left its request generating to `max_tokens`). A cancellation
    of the caller (a shutdown) cancels `work` too."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    raise ClientGone


async def _disconnect(receive: Receive) -> None:
    """Returns when the client has disconnected (every message after the body is that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _uncancel() -> None:
    """Take back every cancellation of the current task: its handler ends by itself."""
    task = asyncio.current_task()
    assert task is not None
    while task.cancelling():
        task.uncancel()


class _Watch:
    """A stream's disconnect watcher: cancels the streaming task when the client leaves."""

    __slots__ = ("task", "gone", "done")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.gone = False  # the client left before the stream ended
        self.done = False  # the stream ended (its last message was sent)

    async def run(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.done:
            self.gone = True
            self.task.cancel()


async def stream(events: EventStream, receive: Receive, send: Send) -> None:
    """`events` as a 200 `text/event-stream` response, each as it comes, up to the first
    `Last` (then closed) or the end; cancelled (which closes `events`, aborting the request)
    when the client disconnects."""
    task = asyncio.current_task()
    assert task is not None
    watch = _Watch(task)
    watcher = asyncio.ensure_future(watch.run(receive))
    started = False
    try:
        # fresh messages per stream: a wrapper of `send` may add headers to them
        await send({"type": "http.response.start", "status": 200, "headers": [_SSE_TYPE]})
        started = True
        async for data in events:
            if type(data) is Last:
                watch.done = True
                await send({"type": "http.response.body", "body": data, "more_body": False})
                return
            await send({"type": "http.response.body", "body": data, "more_body": True})
        watch.done = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        shutdown = not watch.gone or task.cancelling() > 1  # not (only) the client leaving
        _uncancel()  # the stream ends here (the client left: as StreamingResponse's)
        if shutdown and started and not watch.done:
            watch.done = True
            try:
                await send({"type": "http.response.body", "more_body": False,
                            "body": sse.event(SHUT_DOWN.body()) + sse.DONE})
            except asyncio.CancelledError:  # a reader that never drains, cancelled again
                _uncancel()
    finally:
        watch.done = True
        watcher.cancel()
        await events.aclose()  # the abort, if the request still runs
