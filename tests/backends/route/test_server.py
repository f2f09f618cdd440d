"""The router's HTTP/1.1 server (`backends.route.server`) with a scripted handler, over raw
loopback sockets: keep-alive and pipelining, chunked request bodies, Expect: 100-continue,
streams chunk-framed (HTTP/1.1) or framed by the close (HTTP/1.0), a malformed request, a
client that leaves mid-stream, and the drain on stop. Every test runs under a 10 s bound."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from backends.listen import listening_socket
from backends.route.server import Connection, Request, serve


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))


class Harness:
    """`serve` on a free port with `handler` (bodies of at most `max_body` bytes); `stop`
    ends it; `seen` the requests."""

    def __init__(self, handler: Callable[[Request, Connection], Coroutine[Any, Any, None]],
                 shutdown_timeout_s: float = 5.0, max_body: int = 1 << 20) -> None:
        sock = listening_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.seen: list[Request] = []
        self.stop = asyncio.Event()

        async def recording(request: Request, conn: Connection) -> None:
            self.seen.append(request)
            await handler(request, conn)
        self.task = asyncio.ensure_future(serve(recording, sock, shutdown_timeout_s, self.stop,
                                                max_body))

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        for _ in range(100):
            try:
                return await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                await asyncio.sleep(0.02)
        raise AssertionError("the server did not listen")

    async def close(self) -> None:
        self.stop.set()
        await self.task


async def echo(request: Request, conn: Connection) -> None:
    conn.respond(200, [(b"content-type", b"text/plain")],
                 request.method + b" " + request.target + b" " + request.body)


def test_keep_alive_and_pipelined_requests_are_answered_in_turn() -> None:
    async def main() -> None:
        server = Harness(echo)
        reader, writer = await server.connect()
        writer.write(b"POST /a?x=1 HTTP/1.1\r\nhost: h\r\ncontent-length: 3\r\n\r\nabc"
                     b"GET /b HTTP/1.1\r\nhost: h\r\n\r\n")
        first = await reader.readuntil(b"POST /a?x=1 abc")
        second = await reader.readuntil(b"GET /b ")
        assert first == (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                         b"content-length: 15\r\n\r\nPOST /a?x=1 abc")
        assert second.endswith(b"content-length: 7\r\n\r\nGET /b ")
        assert [r.path for r in server.seen] == ["/a", "/b"]
        writer.close()
        await server.close()
    run(main)


def test_a_chunked_request_body_and_expect_100_continue() -> None:
    async def main() -> None:
        server = Harness(echo)
        reader, writer = await server.connect()
        writer.write(b"POST /c HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n"
                     b"expect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"2;x=y\r\nde\r\n0\r\n\r\n")
        assert (await reader.readuntil(b"POST /c abcde")).endswith(b"\r\n\r\nPOST /c abcde")
        writer.close()
        await server.close()
    run(main)


async def stream(request: Request, conn: Connection) -> None:
    conn.start_stream(200, [(b"content-type", b"text/event-stream")], b"data: 1\n\n")
    await asyncio.sleep(0.01)
    conn.send(b"data: 2\n\n")
    conn.send(b"data: [DONE]\n\n", last=True)


@pytest.mark.parametrize(("version", "expected"), [
    (b"HTTP/1.1", b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
     b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
     b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"),
    (b"HTTP/1.0", b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
     b"connection: close\r\n\r\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"),
])
def test_streams_are_chunk_framed_or_framed_by_the_close(version: bytes, expected: bytes
                                                          ) -> None:
    async def main() -> None:
        server = Harness(stream)
        reader, writer = await server.connect()
        writer.write(b"POST /s %s\r\nhost: h\r\nconnection: close\r\n\r\n" % version)
        assert await reader.read() == expected  # then the server closes
        writer.close()
        await server.close()
    run(main)


def test_a_malformed_request_is_a_400_and_the_close() -> None:
    async def main() -> None:
        server = Harness(echo)
        reader, writer = await server.connect()
        writer.write(b"NONSENSE\r\n\r\n")
        answer = await reader.read()
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
        assert b"not an HTTP/1.x request line" in answer and not server.seen
        writer.close()
        await server.close()
    run(main)


TOO_LARGE = (b'{"error":{"message":"the request body is longer than 64 bytes",'
             b'"type":"RequestTooLargeError","param":null,"code":413}}')


@pytest.mark.parametrize("body", [
    b"20\r\n" + b"x" * 32 + b"\r\n" + b"21\r\n" + b"x" * 33 + b"\r\n",  # data: 65 bytes
    b"1\r\nx\r\n" * 22,  # data: 22 bytes, but 132 bytes on the wire (over twice the limit)
])
def test_a_chunked_body_over_the_limit_is_a_413(body: bytes) -> None:
    async def main() -> None:
        server = Harness(echo, max_body=64)
        reader, writer = await server.connect()
        writer.write(b"POST /c HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n"
                     + body)
        answer = await reader.read()
        assert answer.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n")
        assert answer.endswith(b"\r\n\r\n" + TOO_LARGE) and not server.seen
        writer.close()
        await server.close()
    run(main)


def test_a_chunked_body_of_exactly_the_limit_is_served() -> None:
    async def main() -> None:
        server = Harness(echo, max_body=64)
        reader, writer = await server.connect()
        writer.write(b"POST /c HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n"
                     b"20\r\n" + b"x" * 32 + b"\r\n20\r\n" + b"y" * 32 + b"\r\n0\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert await reader.readexactly(8 + 64) == b"POST /c " + b"x" * 32 + b"y" * 32
        writer.close()
        await server.close()
    run(main)


def test_a_declared_body_over_the_limit_is_a_413_before_it_is_sent() -> None:
    async def main() -> None:
        server = Harness(echo, max_body=64)
        reader, writer = await server.connect()
        writer.write(b"POST /c HTTP/1.1\r\nhost: h\r\ncontent-length: 65\r\n"
                     b"expect: 100-continue\r\n\r\n")
        answer = await reader.read()  # no 100 Continue: the answer, then the close
        assert answer.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n")
        assert answer.endswith(b"\r\n\r\n" + TOO_LARGE) and not server.seen
        writer.close()
        await server.close()
    run(main)


def test_a_client_that_leaves_mid_stream_is_noticed_at_once() -> None:
    lost = asyncio.Event()

    async def slow(request: Request, conn: Connection) -> None:
        conn.on_lost = lost.set
        conn.start_stream(200, [], b"data: 1\n\n")
        await asyncio.sleep(30)  # a backend that has nothing more yet

    async def main() -> None:
        server = Harness(slow, shutdown_timeout_s=0.1)
        reader, writer = await server.connect()
        writer.write(b"POST /s HTTP/1.1\r\nhost: h\r\n\r\n")
        await reader.readuntil(b"data: 1\n\n\r\n")
        writer.close()
        await lost.wait()
        await server.close()  # the handler still sleeps: cut after the shutdown timeout
    run(main)


def test_stop_lets_requests_in_flight_finish_and_closes_idle_connections() -> None:
    started = asyncio.Event()

    async def handler(request: Request, conn: Connection) -> None:
        if request.path == "/slow":
            started.set()
            await asyncio.sleep(0.2)
        conn.respond(200, [], b"done")

    async def main() -> None:
        server = Harness(handler)
        idle_reader, idle_writer = await server.connect()
        idle_writer.write(b"GET /fast HTTP/1.1\r\nhost: h\r\n\r\n")
        await idle_reader.readuntil(b"done")
        reader, writer = await server.connect()
        writer.write(b"GET /slow HTTP/1.1\r\nhost: h\r\n\r\n")
        await started.wait()
        server.stop.set()
        assert (await reader.read()).endswith(b"connection: close\r\n\r\ndone")
        assert await idle_reader.read() == b""  # closed without a response
        await server.task
        for w in (writer, idle_writer):
            w.close()
    run(main)


def test_a_request_not_yet_answered_when_the_drain_runs_out_gets_a_503() -> None:
    """The drain cut: a handler still waiting is cancelled; its request, not yet answered,
    gets the server's 503 (a stream started is its handler's to end: `relay`); `serve`
    returns how many were cut."""
    async def handler(request: Request, conn: Connection) -> None:
        if request.path == "/stream":
            conn.start_stream(200, [], b"first")
        await asyncio.sleep(60)

    async def main() -> None:
        server = Harness(handler, shutdown_timeout_s=0.2)
        waiting, waiting_writer = await server.connect()
        waiting_writer.write(b"GET /wait HTTP/1.1\r\nhost: h\r\n\r\n")
        streaming, streaming_writer = await server.connect()
        streaming_writer.write(b"GET /stream HTTP/1.1\r\nhost: h\r\n\r\n")
        await streaming.readuntil(b"first\r\n")
        server.stop.set()
        answer = await waiting.read()
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
        assert answer.endswith(b'{"error":{"message":"the server shut down before the '
                               b'request finished","type":"ServiceUnavailableError",'
                               b'"param":null,"code":503}}')  # rt serve's bytes
        assert await streaming.read() == b""  # closed; no end written by this handler
        assert await server.task == 2
        for w in (waiting_writer, streaming_writer):
            w.close()
    run(main)
