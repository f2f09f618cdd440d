"""The router's hot path as a bare ASGI app: POST /v1/completions and /v1/chat/completions.

In front of the FastAPI app (which keeps /v1/models, /health, /metrics and the lifespan),
`FastPath` takes the two generation routes itself: the body is read from the ASGI messages,
routed and sent (`Router.dispatch`), and the backend's answer is written back as ASGI
messages: a body at once, or an SSE stream as the backend's bytes arrive (what arrived
together goes out in one message; uvicorn frames it with chunked transfer encoding). This
skips FastAPI's routing and Starlette's `StreamingResponse` (a task group per response).

Stream semantics are `backends.route.app`'s: the first event with output calls the policy's
`on_prefill_done` (chat: the second, after the role), the end or failure `on_finished`; a
stream cut by its backend ends with an OpenAI-style `data: {"error": ...}` event. A client
that disconnects is noticed at the backend's next chunk: the backend's connection is closed
(its request aborted).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from backends.route.upstream import UpstreamFailed
from backends.serve.openai_protocol import ApiError

if TYPE_CHECKING:
    from backends.route.app import Router
    from backends.route.backends import Backend
    from backends.route.upstream import Exchange

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
_JSON = (b"content-type", b"application/json")
_SSE = b"text/event-stream"


class FastPath:
    """ASGI: the generation routes to `router`, everything else to `app`."""

    def __init__(self, app: ASGIApp, router: Router) -> None:
        self.app = app
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        chat = PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if chat is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        arrival = time.monotonic()
        body = await _read_body(receive)
        try:
            backend, upstream, request_id = await self.router.dispatch(
                body, scope["headers"], scope["path"], chat, arrival)
        except ApiError as err:
            await _send_json(send, err.status, err.body())
            return
        forward = self.router.answered(backend, upstream)
        if any(k == b"content-type" and v.startswith(_SSE) for k, v in upstream.headers):
            await _relay(self.router, backend, upstream, request_id, chat, forward, receive,
                         send)
        else:
            await _whole(self.router, backend, upstream, request_id, forward, send)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left before sending it all
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _send_json(send: Send, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [_JSON, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _whole(router: Router, backend: Backend, upstream: Exchange, request_id: str,
                 headers: list[tuple[bytes, bytes]], send: Send) -> None:
    """A non-streaming answer: read it all, then write it (502 if the backend fails)."""
    try:
        content = await upstream.read_all()
    except UpstreamFailed as err:
        router.metrics.errors.labels(backend.url, "stream").inc()
        error = ApiError(502, f"backend {backend.url} failed: {err}")
        await _send_json(send, 502, error.body())
        return
    finally:
        upstream.close()
        backend.streams.discard(upstream)
        router.policy.on_prefill_done(request_id)
        router.finish(backend, request_id)
    headers.append((b"content-length", str(len(content)).encode()))
    await send({"type": "http.response.start", "status": upstream.status,
                "headers": headers})
    await send({"type": "http.response.body", "body": content})


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (or the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _relay(router: Router, backend: Backend, upstream: Exchange, request_id: str,
                 chat: bool, headers: list[tuple[bytes, bytes]], receive: Receive,
                 send: Send) -> None:
    """The backend's SSE bytes as they come; an error event if the stream is cut."""
    await send({"type": "http.response.start", "status": upstream.status,
                "headers": headers})
    gone = asyncio.ensure_future(_disconnected(receive))
    first_output = 2 if chat else 1  # chat's first event is the role, no output yet
    events = 0
    try:
        try:
            while chunk := await upstream.read():
                if events < first_output:
                    events += chunk.count(b"data:")
                    if events >= first_output:
                        router.policy.on_prefill_done(request_id)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if gone.done():  # the client left: closing the exchange aborts the request
                    break
        except Exception as err:  # noqa: BLE001 (whatever broke the stream, the client is told)
            router.metrics.errors.labels(backend.url, "stream").inc()
            error = ApiError(502, f"backend {backend.url} failed mid-stream: "
                             f"{err or type(err).__name__}")
            event = f"data: {json.dumps(error.body())}\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        gone.cancel()
        upstream.close()
        backend.streams.discard(upstream)
        router.finish(backend, request_id)
