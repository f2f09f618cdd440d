"""The router's HTTP/1.1 client (`backends.route.upstream`) against scripted loopback
servers: Content-Length and chunked bodies however they are split, keep-alive reuse, a
bounded idle pool, a backend that closes mid-stream or never answers (a bounded error, never
a hang), and the caller closing an exchange. Every test runs under a 10 s bound."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from backends.route.http1 import request_head
from backends.route.upstream import ConnectFailed, UpstreamConfig, UpstreamFailed, UpstreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n"


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))


class Server:
    """A loopback server running `handler` per connection; records connections and the
    requests it read."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request


def pool(server: Server, **kwargs: Any) -> UpstreamPool:
    return UpstreamPool(UpstreamConfig("127.0.0.1", server.port, **kwargs))


async def fetch(upstream: UpstreamPool, body: bytes = b"{}") -> tuple[int, bytes]:
    exchange = upstream.exchange()
    try:
        await exchange.start(HEAD, body)
        return exchange.status, await exchange.read_all()
    finally:
        exchange.close()


def test_request_head_drops_hop_by_hop_headers_and_sets_its_own_framing() -> None:
    head = request_head(b"POST", b"/v1/completions", b"h:1", 7,
                        [(b"content-type", b"application/json"), (b"connection", b"close"),
                         (b"content-length", b"99"), (b"x-session-id", b"s")],
                        frozenset({b"connection", b"content-length"}))
    assert head == (b"POST /v1/completions HTTP/1.1\r\nhost: h:1\r\ncontent-length: 7\r\n"
                    b"content-type: application/json\r\nx-session-id: s\r\n\r\n")


def test_content_length_bodies_reuse_one_keep_alive_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 11\r\n\r\n{\"ok\": tru")
            await writer.drain()
            writer.write(b"e")

    async def test() -> None:
        upstream = pool(server)
        for _ in range(3):
            assert await fetch(upstream) == (200, b'{"ok": true}'[:11])
        assert (upstream.opened, server.connections, upstream.idle) == (1, 1, 1)
        assert server.requests == [HEAD + b"{}"] * 3
        upstream.close()

    server = Server(handler)

    async def main() -> None:
        async with server:
            await test()
    run(main)


CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"transfer-encoding: chunked\r\n\r\n"
           b"d\r\ndata: first\n\n\r\n"
           b"F;ext=1\r\ndata: second!\n\n\r\n"
           b"0\r\nx-trailer: t\r\n\r\n")


@pytest.mark.parametrize("piece", [1, 2, 3, 7, len(CHUNKED)])
def test_a_chunked_body_is_decoded_however_it_is_split(piece: int) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_request(reader)
            for i in range(0, len(CHUNKED), piece):
                writer.write(CHUNKED[i:i + piece])
                await writer.drain()
                await asyncio.sleep(0)

    server = Server(handler)

    async def main() -> None:
        async with server:
            upstream = pool(server)
            for _ in range(2):
                exchange = upstream.exchange()
                await exchange.start(HEAD, b"{}")
                assert exchange.headers == [(b"content-type", b"text/event-stream"),
                                            (b"transfer-encoding", b"chunked")]
                pieces = []
                while chunk := await exchange.read():
                    pieces.append(chunk)
                assert b"".join(pieces) == b"data: first\n\ndata: second!\n\n"
                assert exchange.complete
                exchange.close()
            assert (upstream.opened, server.connections) == (1, 1)  # reused
            upstream.close()
    run(main)


def test_a_backend_that_closes_mid_stream_fails_after_the_bytes_it_sent() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(CHUNKED[:CHUNKED.index(b"F;ext")])  # the first event, then gone
        await writer.drain()

    server = Server(handler)

    async def main() -> None:
        async with server:
            upstream = pool(server)
            exchange = upstream.exchange()
            await exchange.start(HEAD, b"{}")
            assert await exchange.read() == b"data: first\n\n"
            with pytest.raises(UpstreamFailed, match="closed the connection mid-response"):
                await exchange.read()
            exchange.close()
            assert upstream.idle == 0
    run(main)


def test_a_backend_that_never_answers_is_a_bounded_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        await asyncio.sleep(30)

    server = Server(handler)

    async def main() -> None:
        async with server:
            upstream = pool(server, read_timeout_s=0.2)
            with pytest.raises(UpstreamFailed, match="no answer from the backend within 0.2 s"):
                await fetch(upstream)
            assert upstream.idle == 0
    run(main)


def test_a_silent_stream_is_a_bounded_error_too() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(CHUNKED[:CHUNKED.index(b"F;ext")])
        await asyncio.sleep(30)

    server = Server(handler)

    async def main() -> None:
        async with server:
            exchange = pool(server, read_timeout_s=0.2).exchange()
            await exchange.start(HEAD, b"{}")
            assert await exchange.read() == b"data: first\n\n"
            with pytest.raises(UpstreamFailed, match="within 0.2 s"):
                await exchange.read()
    run(main)


def test_the_idle_pool_is_bounded() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_request(reader)
            await release.wait()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    server = Server(handler)

    async def main() -> None:
        async with server:
            upstream = pool(server, max_idle=3)
            for round_, opened in ((1, 10), (2, 17)):  # 10 at once: 10 connections, 3 kept
                tasks = [asyncio.ensure_future(fetch(upstream)) for _ in range(10)]
                while len(server.requests) < 10 * round_:
                    await asyncio.sleep(0.01)
                release.set()
                assert await asyncio.gather(*tasks) == [(200, b"ok")] * 10
                release.clear()
                assert (upstream.opened, upstream.idle) == (opened, 3)
            upstream.close()
    run(main)


def test_an_unreachable_backend_is_connect_failed() -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(ConnectFailed, match="cannot connect"):
            await fetch(UpstreamPool(UpstreamConfig("127.0.0.1", port)))
    run(main)


def test_closing_an_exchange_aborts_its_request_and_wakes_its_reader() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(CHUNKED[:CHUNKED.index(b"F;ext")])
        await writer.drain()
        assert await reader.read() == b""  # the router closed the connection
        gone.set()

    server = Server(handler)

    async def main() -> None:
        async with server:
            exchange = pool(server).exchange()
            await exchange.start(HEAD, b"{}")
            assert await exchange.read() == b"data: first\n\n"
            reading = asyncio.ensure_future(exchange.read())
            await asyncio.sleep(0.01)
            exchange.close("the backend was taken out")
            with pytest.raises(UpstreamFailed, match="taken out"):
                await reading
            await gone.wait()
    run(main)


@pytest.mark.parametrize(("response", "body", "reused"), [
    (b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the close", b"until the close",
     False),
    (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok", b"ok", False),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", b"", True),
])
def test_framing_by_close_and_no_body(response: bytes, body: bytes, reused: bool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_request(reader)
            writer.write(response)
            await writer.drain()
            if not reused:
                return

    server = Server(handler)

    async def main() -> None:
        async with server:
            upstream = pool(server)
            for _ in range(2):
                assert (await fetch(upstream))[1] == body
            assert upstream.opened == (1 if reused else 2)
            upstream.close()
    run(main)


def test_a_keep_alive_connection_the_backend_closed_is_replaced() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)  # one response, then the idle connection closes
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    server = Server(handler)

    async def main() -> None:
        async with server:
            upstream = pool(server)
            for _ in range(3):
                assert await fetch(upstream) == (200, b"ok")
            assert server.connections == 3
    run(main)


@pytest.mark.parametrize("response", [
    b"SPDY/3 200 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: many\r\n\r\n",
])
def test_a_malformed_answer_is_upstream_failed(response: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(response)
        await writer.drain()
        await asyncio.sleep(30)

    server = Server(handler)

    async def main() -> None:
        async with server:
            upstream = pool(server, read_timeout_s=5)
            with pytest.raises(UpstreamFailed):
                await fetch(upstream)
            assert upstream.idle == 0
    run(main)
