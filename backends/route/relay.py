"""The router's request handler (`backends.route.server`'s): the two generation routes,
POST /v1/completions and /v1/chat/completions, relayed to a backend, and GET /v1/models,
/health and /metrics.

A generation request is routed and sent (`Router.dispatch`); the backend's answer goes back
as it came: a whole body in one write, or an SSE stream as its bytes arrive (what arrived
together goes out together: the head with the bytes that came with the backend's head, then
each later piece, the last with the end of the body), chunk-framed anew for the client (the
backend's chunk boundaries are not kept; its bytes are), whole events only (`_Output`).

(A request to /v1/* without the API key never gets here: `Router.screen` answers it from
its head.) Errors the router answers itself are `ApiError`s encoded as rt serve's
(`ApiError.encoded`; an SSE error event as `backends.serve.sse.event`).

Stream semantics: the first event with output calls the policy's `on_prefill_done` (chat:
the second, after the role), the end or failure `on_finished`. A stream cut by its backend
(the process died, the backend was taken out) ends with an OpenAI-style `data: {"error":
...}` event (502) and `data: [DONE]`, as vLLM ends a stream on an error; one cut by the
router's shutdown (`--shutdown-timeout` ran out) the same way with rt serve's
`SHUT_DOWN` (503), its backend request aborted. A client that disconnects closes the
backend's connection at once (its request is aborted there), whether the backend's head
has come or not (a non-streaming answer's comes with its body, at the end). Flow control
is end to end: while the client's transport is paused the relay does not read the backend,
whose connection stops being read once its buffer holds `upstream`'s high-water mark, so
the backend's socket fills and its server stops writing.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.route.upstream import UpstreamFailed
from backends.serve.api_error import SHUT_DOWN, ApiError
from backends.serve.openai_protocol import GENERATION_PATHS as PATHS
from backends.serve.sse import DONE, event

if TYPE_CHECKING:
    from backends.route.app import Router
    from backends.route.backends import Backend
    from backends.route.server import Connection, Request
    from backends.route.upstream import Exchange

_JSON = (b"content-type", b"application/json")
_SSE = b"text/event-stream"


async def handle(router: Router, request: Request, conn: Connection) -> None:
    """Answer one request."""
    chat = PATHS.get(request.path)
    if chat is not None and request.method == b"POST":
        await _generate(router, request, conn, chat)
    elif request.method == b"GET" and request.path == "/health":
        if router.any_up:
            conn.respond(200, [], b"")
        else:
            _error(conn, ApiError(503, "no backend is up"))
    elif request.method == b"GET" and request.path == "/metrics":
        conn.respond(200, [(b"content-type", CONTENT_TYPE_LATEST.encode())],
                     generate_latest(router.metrics.registry))
    elif request.method == b"GET" and request.path == "/v1/models":
        try:
            status, content_type, body = await router.models()
        except ApiError as err:
            _error(conn, err)
            return
        conn.respond(status, [(b"content-type", content_type)] if content_type else [], body)
    elif chat is not None or request.path in ("/health", "/metrics", "/v1/models"):
        _error(conn, ApiError(405, f"{request.method.decode('latin-1')} is not allowed on "
                                   f"{request.path}", kind="MethodNotAllowed"))
    else:
        _error(conn, ApiError(404, f"no route {request.path}"))


def _error(conn: Connection, err: ApiError) -> None:
    conn.respond(err.status, [_JSON], err.encoded())


async def _generate(router: Router, request: Request, conn: Connection, chat: bool) -> None:
    # Until the backend's head comes, a client that leaves cancels this handler: the
    # exchange is closed (`Router.dispatch`), so the backend aborts its request. rt serve
    # sends a non-streaming answer's head with its body, at the end: without this, the
    # request ran to max_tokens after its client had gone (a stream's head comes at once).
    # The server's `_run` answers nothing to a client that is gone.
    if conn.gone:  # it left before this handler ran: nothing to send the backend
        return
    task = asyncio.current_task()
    assert task is not None
    conn.on_lost = task.cancel
    try:
        backend, upstream, request_id = await router.dispatch(
            request.body, request.headers, request.target, chat, request.arrival_s)
    except ApiError as err:
        conn.on_lost = None
        _error(conn, err)
        return
    conn.on_lost = upstream.close  # from here on, the relay's (`_whole`, `_relay`)
    forward = router.answered(backend, upstream)
    try:
        if any(k == b"content-type" and v.startswith(_SSE) for k, v in upstream.headers):
            await _relay(router, backend, upstream, request_id, chat, forward, conn)
        else:
            await _whole(router, backend, upstream, request_id, forward, conn)
    finally:
        upstream.close()
        backend.streams.discard(upstream)
        router.finish(backend, request_id)


async def _whole(router: Router, backend: Backend, upstream: Exchange, request_id: str,
                 headers: list[tuple[bytes, bytes]], conn: Connection) -> None:
    """A non-streaming answer: read it all, then write it (502 if the backend fails)."""
    try:
        content = await upstream.read_all()
    except UpstreamFailed as err:
        if not conn.gone:
            router.metrics.errors.labels(backend.url, "stream").inc()
            _error(conn, ApiError(502, f"backend {backend.url} failed: {err}"))
        return
    finally:
        router.policy.on_prefill_done(request_id)
    conn.respond(upstream.status, headers, content)


async def _relay(router: Router, backend: Backend, upstream: Exchange, request_id: str,
                 chat: bool, headers: list[tuple[bytes, bytes]], conn: Connection) -> None:
    """The backend's SSE bytes as they come; an error event if the stream is cut."""
    output = _Output(router, request_id, 2 if chat else 1)  # chat: the role event first
    # what came with the backend's head
    conn.start_stream(upstream.status, headers, output.forward(upstream.read_nowait(), False))
    try:
        while not upstream.complete:
            if conn.paused:  # the client is not reading: neither do we (flow control)
                await conn.drain()
            data = await upstream.read()  # every byte that has come; b"": the end
            conn.send(output.forward(data, upstream.complete), last=upstream.complete)
            if upstream.complete:
                return
        conn.send(output.forward(upstream.read_nowait(), True), last=True)
    except UpstreamFailed as err:
        if conn.gone:
            return
        router.metrics.errors.labels(backend.url, "stream").inc()
        _end_with(conn, output, ApiError(502, f"backend {backend.url} failed mid-stream: {err}"))
    except asyncio.CancelledError:  # the router's drain was cut: answered, then cancelled
        if not conn.gone:
            _end_with(conn, output, SHUT_DOWN)
        raise


def _end_with(conn: Connection, output: _Output, error: ApiError) -> None:
    """End a stream on an error: its event, then `[DONE]` (unless the backend's came). The
    client has whole events only (`_Output.forward`): the error event starts one."""
    conn.send(b"" if output.done else event(error.body()) + DONE, last=True)


# Bytes after a stream's last event boundary wait for the rest of their event, up to this many
# (then they go as they are: framing without blank lines, which this relay does not know).
_HOLD_MAX = 64 * 1024


class _Output:
    """What the client is sent of a backend's stream: whole events only (an event ends at a
    blank line, `\n\n` or `\r\n\r\n`; the bytes after the last one are held for the next
    read), so a cut's error event never lands inside half an event; all of it at the end.
    Counts the events until the first with output: then `on_prefill_done`; `done`: the bytes
    sent end the stream (`data: [DONE]`)."""

    def __init__(self, router: Router, request_id: str, first_output: int) -> None:
        self.router, self.request_id, self.left = router, request_id, first_output
        self._held = b""  # the start of an event whose end has not come
        self._tail = b""  # the last len(DONE) bytes sent

    @property
    def done(self) -> bool:
        return self._tail == DONE

    def forward(self, data: bytes, last: bool) -> bytes:
        """The bytes to send after `data` came (`last`: the stream's end: all of them)."""
        if self._held:
            data, self._held = self._held + data, b""
        if not last:
            lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
            end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
            if end < len(data) and len(data) - end <= _HOLD_MAX:
                data, self._held = data[:end], data[end:]
        self._seen(data)
        return data

    def _seen(self, data: bytes) -> None:
        if not data:
            return
        self._tail = (self._tail + data[-len(DONE):])[-len(DONE):]
        if self.left > 0:
            self.left -= data.count(b"data:")
            if self.left <= 0:
                self.router.policy.on_prefill_done(self.request_id)
