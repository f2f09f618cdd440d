"""`rt replay --endpoint` keeps one connection for back-to-back requests, as vLLM's client
does: a stream left unread after `[DONE]` made httpx close the connection, so every request
paid a new TCP connection (~1.5 ms more TTFT than `vllm bench serve` on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest

from backends.replay.endpoint import replay_endpoint
from backends.replay.endpoint_probe import EndpointConfig, EndpointInfo
from workloads import Trace, TraceRequest

_BODY = (b'data: {"choices":[{"index":0,"text":"a","finish_reason":"length"}]}\n\n'
         b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1}}\n\n'
         b"data: [DONE]\n\n")
_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
             b"transfer-encoding: chunked\r\n\r\n"
             + b"%x\r\n%s\r\n0\r\n\r\n" % (len(_BODY), _BODY))


class _KeepAliveServer:
    """An HTTP/1.1 keep-alive server on the loopback that answers every POST with one SSE
    stream, counting the TCP connections it accepts."""

    def __init__(self) -> None:
        self.connections = 0
        self.port = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(_RESPONSE)
                await writer.drain()
        writer.close()

    def __enter__(self) -> _KeepAliveServer:
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop).result(10)
        self.port = server.sockets[0].getsockname()[1]
        self._server = server
        return self

    async def _close(self) -> None:
        self._server.close()
        for writer in self._writers:  # kept-alive connections: their handlers then end
            writer.close()
        await asyncio.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def server() -> Iterator[_KeepAliveServer]:
    with _KeepAliveServer() as running:
        yield running


def test_back_to_back_requests_share_one_connection(server: _KeepAliveServer) -> None:
    trace = Trace(tuple(TraceRequest(f"r{i}", arrival_s=0.0, prompt_len=4, output_len=1)
                        for i in range(6)), name="keep-alive")
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    config = EndpointConfig(url, max_concurrency=1, timeout_s=10, vocab_size=64)
    result = replay_endpoint(trace, config, EndpointInfo(url, "m", None))
    assert result.num_failed == 0 and len(result.requests) == 6
    assert server.connections == 1
