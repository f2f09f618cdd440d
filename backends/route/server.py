"""The router's HTTP/1.1 server: asyncio protocols, one task per request, no ASGI layer.

    await serve(handler, sock, shutdown_timeout_s, stop, max_body, screen)

Each connection parses its requests (head, then a Content-Length or chunked body; `Expect:
100-continue` answered) and runs `handler(request, connection)` for one at a time (bytes of
a pipelined next request wait). The handler answers through the connection:

    connection.respond(status, headers, body)        # a whole body: one write
    connection.start_stream(status, headers, first)  # head and first bytes: one write
    connection.send(data, last)                      # a piece (chunk-framed for HTTP/1.1;
    await connection.drain()                         #   last: the final chunk too)
    connection.on_lost = callback                    # called once if the client goes

An HTTP/1.0 client (or one that sent `connection: close`) gets `connection: close` and, for a
stream, a body framed by the close. A connection idle (no request, or a request's bytes
stalled) for `KEEP_ALIVE_S` is closed. A malformed request gets a 400 and the close; a body
over `max_body` bytes a 413 and the close (declared: as soon as the head is in; chunked: once
its data passes the limit, or its bytes with their framing pass twice it). `screen`, when
given, may refuse a request from its head, before its body is read (the router's API key):
its answer, then the close.

Shutdown (`stop` set): the listening socket closes, idle connections close, requests in
flight may finish for `shutdown_timeout_s`; then the drain is cut: the handlers still running
are cancelled and answer the cut themselves (a handler that catches CancelledError writes its
end, then re-raises); a request whose response has not started gets `SHUT_DOWN` (503) from
the server; then every connection is closed (a client that is not reading:
aborted). `serve` returns how many requests were cut. Times are seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from backends.route.http1 import (
    LAST_CHUNK,
    MAX_HEAD,
    ChunkedDecoder,
    ProtocolError,
    ReadBuffer,
    body_framing,
    chunk,
    field,
    split_head,
)
from backends.serve.api_error import SHUT_DOWN, ApiError
from backends.serve.guard import too_large

KEEP_ALIVE_S = 5.0  # as uvicorn's default
_PHRASES = {s.value: s.phrase.encode() for s in http.HTTPStatus}


@dataclass(frozen=True, slots=True)
class Request:
    """Attributes:
    method, target: as sent (target: path and query).
    path: the target without its query, as text.
    headers: (lower-case name, value) in order.
    body: the whole body (de-chunked).
    arrival_s: time.monotonic() when its head was complete.
    """

    method: bytes
    target: bytes
    path: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    arrival_s: float


Handler = Callable[[Request, "Connection"], Awaitable[None]]
# A request's path and headers -> the status and JSON body refusing it, or None to read on
Screen = Callable[[str, list[tuple[bytes, bytes]]], tuple[int, bytes] | None]


class _State:
    """The server's connections and the requests running on them."""

    def __init__(self, handler: Handler, max_body: int, screen: Screen | None) -> None:
        self.handler = handler
        self.max_body = max_body  # bytes of a request body at most (413 above)
        self.screen = screen
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.read_buffer = ReadBuffer()  # its connections' reads (one loop: shared)


class Refused(Exception):
    """A request answered from its head alone (a body over `max_body`, or `screen`'s
    refusal): the status and JSON body of the answer."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


def response_head(status: int, headers: list[tuple[bytes, bytes]], framing: bytes,
                  close: bool) -> bytes:
    """A response head: `framing` is the content-length or transfer-encoding line (or
    nothing)."""
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, _PHRASES.get(status, b"Unknown"))]
    parts += [b"%s: %s\r\n" % (name, value) for name, value in headers]
    parts.append(framing)
    parts.append(b"connection: close\r\n\r\n" if close else b"\r\n")
    return b"".join(parts)


class Connection(asyncio.BufferedProtocol):
    """One client connection (see the module docstring); reads into its server's
    `ReadBuffer`."""

    def __init__(self, state: _State) -> None:
        self._state = state
        self.transport: asyncio.Transport | None = None
        self.gone = False  # the client's connection is closed
        # called once if the client goes; its result is ignored (Task.cancel returns a bool)
        self.on_lost: Callable[[], object] | None = None
        self._buf = b""  # bytes not yet parsed (a partial or next request)
        self._busy = False  # a request is being handled
        self._close_after = False  # close once the current response is done
        self._chunked = True  # frame streams with chunks (HTTP/1.1 client)
        self._responded = False  # the current request's response has started
        self._paused = False  # the transport's write buffer is full
        self._drained: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None

    # ---- asyncio callbacks -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._state.connections.add(self)
        self._arm_idle()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._state.read_buffer.view

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._state.read_buffer.take(nbytes))

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if not self._busy:
            self._arm_idle()
            self._parse()
        elif len(self._buf) > MAX_HEAD + 2 * self._state.max_body:  # pipelining: wait for us
            self.transport.pause_reading()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self._state.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        self._wake_drain()
        callback, self.on_lost = self.on_lost, None
        if callback is not None:
            callback()

    @property
    def paused(self) -> bool:
        """The client's socket buffer is full: `drain` before writing more."""
        return self._paused

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain()

    # ---- the handler's side ----------------------------------------------------------------

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self._responded = True
        self._close_after |= self._state.stopping
        self._write(response_head(status, headers, b"content-length: %d\r\n" % len(body),
                                  self._close_after) + body)

    def start_stream(self, status: int, headers: list[tuple[bytes, bytes]],
                     first: bytes) -> None:
        self._responded = True
        self._close_after |= self._state.stopping
        framing = b"transfer-encoding: chunked\r\n" if self._chunked else b""
        self._close_after |= not self._chunked  # the close frames the body
        head = response_head(status, headers, framing, self._close_after)
        self._write(head + (chunk(first) if self._chunked else first))

    def send(self, data: bytes, last: bool = False) -> None:
        if self._chunked:
            data = chunk(data) + LAST_CHUNK if last else chunk(data)
        if data:
            self._write(data)

    async def drain(self) -> None:
        """Wait while the client's socket buffer is full (returns if the client goes)."""
        while self._paused and not self.gone:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def _write(self, data: bytes) -> None:
        if not self.gone:
            assert self.transport is not None
            self.transport.write(data)

    def _wake_drain(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # ---- requests --------------------------------------------------------------------------

    def _parse(self) -> None:
        """Start the next request if its bytes are all here."""
        try:
            request = self._next_request()
        except ProtocolError as err:
            self._reject(400, ApiError(400, str(err)).encoded())
            return
        except Refused as refused:
            self._reject(refused.status, refused.body)
            return
        if request is None:
            return
        self._busy = True
        if self._idle is not None:
            self._idle.cancel()
        task = asyncio.get_running_loop().create_task(self._run(request))
        self._state.tasks.add(task)
        task.add_done_callback(self._state.tasks.discard)

    def _next_request(self) -> Request | None:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD:
                raise ProtocolError(f"a request head over {MAX_HEAD} bytes")
            return None
        first, headers = split_head(self._buf[:end])
        method, target, version = _request_line(first)
        path = target.split(b"?", 1)[0].decode("latin-1")
        if self._state.screen is not None:
            refusal = self._state.screen(path, headers)
            if refusal is not None:
                raise Refused(*refusal)
        body, used = self._body(headers, end + 4)
        if body is None:
            return None
        self._buf = self._buf[used:]
        self._chunked = version == b"HTTP/1.1"  # an HTTP/1.0 client: one request
        self._close_after = not self._chunked or b"close" in (field(headers, b"connection")
                                                              or b"").lower()
        self._responded = False
        return Request(method, target, path, headers, body, time.monotonic())

    def _body(self, headers: list[tuple[bytes, bytes]], start: int) -> tuple[bytes | None, int]:
        """The body once it is all here (None before) and where the request ends."""
        mode, size = body_framing(headers)
        limit = self._state.max_body
        if mode == "chunked":
            if len(self._buf) - start > 2 * limit:  # bounded as it arrives, framing included
                raise Refused(413, too_large(limit).encoded())
            decoder = ChunkedDecoder()
            pieces = decoder.feed(self._buf[start:])
            if sum(map(len, pieces)) > limit:
                raise Refused(413, too_large(limit).encoded())
            if not decoder.done:
                self._expect_continue(headers, len(self._buf) - start)
                return None, 0
            return b"".join(pieces), len(self._buf) - len(decoder.leftover)
        if size > limit:
            raise Refused(413, too_large(limit).encoded())
        if len(self._buf) - start < size:
            self._expect_continue(headers, len(self._buf) - start)
            return None, 0
        return self._buf[start:start + size], start + size

    def _expect_continue(self, headers: list[tuple[bytes, bytes]], received: int) -> None:
        if received == 0 and (field(headers, b"expect") or b"").lower() == b"100-continue":
            self._write(b"HTTP/1.1 100 Continue\r\n\r\n")

    async def _run(self, request: Request) -> None:
        try:
            await self._state.handler(request, self)
        except asyncio.CancelledError:  # the drain was cut: answered here, not raised
            if not self._responded and not self.gone:
                self._reject(SHUT_DOWN.status, SHUT_DOWN.encoded())
            return
        except Exception as err:  # noqa: BLE001 (a bug must not take the server down)
            if self._responded and self.transport is not None:
                self.transport.abort()  # a response cut in the middle: the client sees it
            elif not self.gone:
                self._reject(500, ApiError(500, f"the router failed: {type(err).__name__}: "
                                                f"{err}").encoded())
            return
        finally:
            self.on_lost = None
            self._busy = False
        if self.gone:
            return
        if self._close_after or self._state.stopping:
            assert self.transport is not None
            self.transport.close()
            return
        self._arm_idle()
        self.transport.resume_reading()  # type: ignore[union-attr]
        if self._buf:
            self._parse()

    def _reject(self, status: int, body: bytes) -> None:
        """Answer `body` (JSON) and close: what is left of the request is not read."""
        self._close_after = True
        self.respond(status, [(b"content-type", b"application/json")], body)
        assert self.transport is not None
        self.transport.close()

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        assert self.transport is not None
        self._idle = asyncio.get_running_loop().call_later(KEEP_ALIVE_S, self.transport.close)

    def close_if_idle(self) -> None:
        if not self._busy and self.transport is not None:
            self.transport.close()

    def close_now(self) -> None:
        """Close after what is written is sent; abort if the client is not reading."""
        if self.transport is not None and not self.gone:
            if self._paused:
                self.transport.abort()
            else:
                self.transport.close()


def _request_line(line: bytes) -> tuple[bytes, bytes, bytes]:
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not parts[1]:
        raise ProtocolError(f"not an HTTP/1.x request line: {line[:80]!r}")
    return parts[0], parts[1], parts[2]


async def serve(handler: Handler, sock: socket.socket, shutdown_timeout_s: float,
                stop: asyncio.Event, max_body: int, screen: Screen | None = None) -> int:
    """Serve on `sock` (listening: `backends.listen.listening_socket`; closed on return)
    until `stop` is set, then drain (see the module docstring); request bodies of at most
    `max_body` bytes; `screen` asked first (None: every request is read). Returns the number
    of requests cut when the drain ran out of time."""
    state = _State(handler, max_body, screen)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(state), sock=sock)
    try:
        await stop.wait()
    finally:
        state.stopping = True
        server.close()
        for connection in list(state.connections):
            connection.close_if_idle()
        deadline = time.monotonic() + shutdown_timeout_s
        while state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        cut = await _cut(state)
        await server.wait_closed()
    return cut


async def _cut(state: _State) -> int:
    """Cancel the requests still running (each answers the cut), then close every
    connection; how many were cut."""
    tasks = list(state.tasks)
    for task in tasks:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*tasks, return_exceptions=True)
    for connection in list(state.connections):
        connection.close_now()
    await asyncio.sleep(0)  # the closes' callbacks: the sockets closed
    return len(tasks)
