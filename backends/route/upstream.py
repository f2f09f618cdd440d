"""The router's HTTP/1.1 client to one backend: a keep-alive connection pool on asyncio
protocols (no streams, no task per request, no per-request pool bookkeeping).

    exchange = UpstreamPool(UpstreamConfig("127.0.0.1", 8001)).exchange()
    await exchange.start(head, body)      # the request in one write; the response head read
    exchange.status, exchange.headers     # int, [(lower-case name, value)] as bytes
    while chunk := await exchange.read(): # the body as it arrives, de-chunked, what arrived
        ...                               # together joined
    exchange.close()                      # idempotent; an unfinished response is aborted

Framing: Content-Length, chunked, or until the backend closes; no body for 204 and 304, 1xx
skipped. A connection returns to the pool when its response's last byte is parsed, unless
the response forbids reuse (`connection: close`, HTTP/1.0, framed by the close, bytes past
its end); at most `max_idle` idle connections are kept, the most recently used first.
`ConnectFailed`: nothing reached the backend (the router may send the request elsewhere);
`UpstreamFailed`: anything after (cut, malformed, silent for `read_timeout_s` before the
head or between two pieces of the body, or `close(reason)`, as when the router takes the
backend out). A reused connection the backend closed before answering (its keep-alive
timeout crossing the request) is retried once on a new one. Times are seconds.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

from backends.route.http1 import (
    MAX_HEAD,
    ChunkedDecoder,
    ProtocolError,
    ReadBuffer,
    body_framing,
    field,
    split_head,
    status_line,
)

_HIGH_WATER = 256 * 1024  # buffered body bytes above which the socket stops being read


class UpstreamError(Exception):
    """The backend did not answer as HTTP/1.1 should."""


class ConnectFailed(UpstreamError):
    """No connection: the request reached nothing."""


class UpstreamFailed(UpstreamError):
    """The request was sent (or may have been) and its response failed."""


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Attributes:
    host, port: the backend's address.
    tls: a TLS context for an https:// backend, else None.
    max_idle: idle keep-alive connections kept at most.
    connect_timeout_s: longest wait for a connection.
    read_timeout_s: longest silence of the backend, before the head or within the body.
    """

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    max_idle: int = 32
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_idle < 0:
            raise ValueError(f"max_idle must be >= 0, got {self.max_idle}")
        if not (self.connect_timeout_s > 0 and self.read_timeout_s > 0):
            raise ValueError("connect_timeout_s and read_timeout_s must be > 0, got "
                             f"{self.connect_timeout_s}, {self.read_timeout_s}")


class _Connection(asyncio.BufferedProtocol):
    """One TCP connection; feeds what it reads (into its pool's `ReadBuffer`) to its current
    exchange."""

    def __init__(self, buffer: ReadBuffer) -> None:
        self._buffer = buffer
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.reusable = True  # false once a response forbids reuse

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer.view

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._buffer.take(nbytes))

    def data_received(self, data: bytes) -> None:
        if self.exchange is None:
            self.abort()  # bytes nobody asked for: the connection is unusable
        else:
            self.exchange._feed(data)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.exchange is not None:
            self.exchange._lost(exc)

    def abort(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.transport.abort()


class UpstreamPool:
    """Keep-alive connections to one backend (see the module docstring)."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.host_header = f"{config.host}:{config.port}".encode()
        self.opened = 0  # connections opened so far (reuse shows as fewer)
        self._idle: list[_Connection] = []
        self._buffer = ReadBuffer()  # its connections' reads (one loop: shared)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def exchange(self, read_timeout_s: float | None = None) -> Exchange:
        """A new exchange; `read_timeout_s` overrides the pool's for it."""
        return Exchange(self, read_timeout_s or self.config.read_timeout_s)

    async def _acquire(self) -> tuple[_Connection, bool]:
        """An open connection and whether it was reused; ConnectFailed otherwise."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.reusable:
                return conn, True
        cfg = self.config
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(self._buffer), cfg.host, cfg.port, ssl=cfg.tls),
                cfg.connect_timeout_s)
        except OSError as err:  # TimeoutError included
            raise ConnectFailed(f"cannot connect to {cfg.host}:{cfg.port}: "
                                f"{err or type(err).__name__}") from None
        self.opened += 1
        return conn, False

    def _release(self, conn: _Connection) -> None:
        conn.exchange = None
        if conn.closed or not conn.reusable:
            conn.abort()
        elif len(self._idle) >= self.config.max_idle:
            assert conn.transport is not None
            conn.transport.close()
        else:
            self._idle.append(conn)

    def close(self) -> None:
        """Close the idle connections (exchanges in flight keep theirs)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None:
                conn.transport.close()


class Exchange:
    """One request and its response on a pooled connection (see the module docstring)."""

    def __init__(self, pool: UpstreamPool, read_timeout_s: float) -> None:
        self._pool = pool
        self._timeout_s = read_timeout_s
        self._conn: _Connection | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._head_done = self._ended = False  # ended: the whole body was received
        self._error: UpstreamError | None = None
        self._received = 0  # response bytes seen (a retry is safe only at 0)
        self._buf = b""  # unparsed bytes (head or chunk framing)
        self._body: list[bytes] = []  # parsed body bytes not yet read
        self._buffered = 0
        self._mode = ""  # "length", "chunked" or "close" once the head is parsed
        self._left = 0  # length: body bytes to come
        self._chunked = ChunkedDecoder()
        self._waiter: asyncio.Future[None] | None = None
        # closed by close(); dropped: the connection closed before any response byte
        self._closed_by_caller = self._dropped = False

    # ---- the caller's side -----------------------------------------------------------------

    async def start(self, head: bytes, body: bytes) -> None:
        """Send the request (`head`: request line and headers, CRLF-terminated, blank line
        included) and wait for the response head."""
        conn, reused = await self._pool._acquire()
        try:
            await self._send(conn, head + body)
        except UpstreamFailed:
            if not (reused and self._dropped and not self._closed_by_caller):
                raise
            # a keep-alive connection closed under us: once more, anew
            self._conn, self._error, self._dropped = None, None, False
            conn, _ = await self._pool._acquire()
            await self._send(conn, head + body)

    async def _send(self, conn: _Connection, data: bytes) -> None:
        if self._error is not None:  # closed by the caller before a connection came
            conn.exchange = None
            self._pool._release(conn)
            raise self._error
        self._conn = conn
        conn.exchange = self
        assert conn.transport is not None
        conn.transport.write(data)
        while not self._head_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read (waiting for some); b"" once
        the body is complete; UpstreamFailed if it fails (after the bytes before it)."""
        while not self._body:
            if self._error is not None:
                raise self._error
            if self._ended:
                return b""
            await self._wait()
        return self.read_nowait()

    def read_nowait(self) -> bytes:
        """The body bytes that arrived since the last read, maybe none; never waits."""
        if not self._body:
            return b""
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        paused, self._buffered = self._buffered > _HIGH_WATER, 0
        if paused and self._conn is not None and not self._conn.closed:
            assert self._conn.transport is not None
            self._conn.transport.resume_reading()
        return data

    async def read_all(self) -> bytes:
        parts = [await self.read()]
        while parts[-1]:
            parts.append(await self.read())
        return b"".join(parts)

    @property
    def complete(self) -> bool:
        return self._ended

    def close(self, reason: str = "closed") -> None:
        """Done with the exchange: an unfinished response is aborted (its connection
        closed, so the backend sees the client gone) and a waiting caller gets
        UpstreamFailed(reason)."""
        if self._ended or self._error is not None:
            return
        self._closed_by_caller = True
        self._fail(UpstreamFailed(reason))

    # ---- waiting ---------------------------------------------------------------------------

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(self._timeout_s, self._timed_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if waiter is self._waiter:
            seconds = self._timeout_s
            self._fail(UpstreamFailed(f"no answer from the backend within {seconds:g} s"))

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.exchange = None
            conn.abort()
        self._wake()

    # ---- the connection's side -------------------------------------------------------------

    def _lost(self, exc: Exception | None) -> None:
        if self._mode == "close" and exc is None:  # the body was framed by the close
            self._finish()
            self._wake()
            return
        self._dropped = self._received == 0
        what = "mid-response" if self._received else "before answering"
        self._fail(UpstreamFailed(f"the backend closed the connection {what}"
                                  + (f": {exc}" if exc else "")))

    def _feed(self, data: bytes) -> None:
        conn = self._conn
        self._received += len(data)
        try:
            if not self._head_done:
                data = self._feed_head(data)
            if data:
                if self._ended:
                    raise UpstreamFailed("the backend sent bytes after its response")
                self._feed_body(data)
        except (UpstreamFailed, ProtocolError) as err:
            if not self._ended:
                self._fail(err if isinstance(err, UpstreamFailed) else UpstreamFailed(str(err)))
                return
            if conn is not None:  # the response is whole; its connection is not reusable
                conn.abort()
        if self._buffered > _HIGH_WATER and self._conn is not None:
            assert self._conn.transport is not None
            self._conn.transport.pause_reading()
        self._wake()

    def _feed_head(self, data: bytes) -> bytes:
        """Parse the head once it is all there; returns the bytes after it."""
        buf = self._buf + data if self._buf else data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                raise UpstreamFailed(f"response head over {MAX_HEAD} bytes")
            self._buf = buf
            return b""
        self._buf = b""
        first, headers = split_head(buf[:end])
        version, status = status_line(first)
        if status < 200:  # 100 Continue and the like: the real head follows
            return self._feed_head(buf[end + 4:]) if len(buf) > end + 4 else b""
        self.status, self.headers = status, headers
        self._framing(version)
        self._head_done = True
        return buf[end + 4:]

    def _framing(self, version: bytes) -> None:
        assert self._conn is not None
        if version != b"HTTP/1.1" or b"close" in (field(self.headers, b"connection")
                                                  or b"").lower():
            self._conn.reusable = False
        self._mode, self._left = body_framing(self.headers)
        if self.status in (204, 304) or self._mode == "length" and self._left == 0:
            self._finish()
        elif self._mode == "none":  # the close ends the body
            self._mode, self._conn.reusable = "close", False

    def _feed_body(self, data: bytes) -> None:
        if self._mode == "chunked":
            self._feed_chunked(data)
        elif self._mode == "length":
            take = min(len(data), self._left)
            self._left -= take
            self._push(data[:take] if take < len(data) else data)
            if self._left == 0:
                self._finish()
                if take < len(data):
                    raise UpstreamFailed("the backend sent more than its content-length")
        else:
            self._push(data)

    def _feed_chunked(self, data: bytes) -> None:
        decoder = self._chunked
        for piece in decoder.feed(data):
            self._push(piece)
        if decoder.done:
            self._finish()
            if decoder.leftover:
                raise UpstreamFailed("the backend sent bytes after its response")

    def _push(self, data: bytes) -> None:
        if data:
            self._body.append(data)
            self._buffered += len(data)

    def _finish(self) -> None:
        self._ended = True
        conn, self._conn = self._conn, None
        if conn is not None:
            if conn.transport is not None and self._buffered > _HIGH_WATER:
                conn.transport.resume_reading()
            self._pool._release(conn)


async def get(pool: UpstreamPool, target: bytes, timeout_s: float) -> tuple[int, bytes]:
    """GET `target` (path and query): the status and the whole body; UpstreamError if it
    fails, every wait bounded by `timeout_s`."""
    exchange = pool.exchange(timeout_s)
    try:
        await exchange.start(b"GET %s HTTP/1.1\r\nhost: %s\r\n\r\n" % (target, pool.host_header),
                             b"")
        return exchange.status, await exchange.read_all()
    finally:
        exchange.close()
