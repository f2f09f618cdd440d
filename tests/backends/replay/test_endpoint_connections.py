"""`rt replay --endpoint` keeps one connection for back-to-back requests, as vLLM's client
does: a stream left unread after `[DONE]` made httpx close the connection, so every request
paid a new TCP connection (~1.5 ms more TTFT than `vllm bench serve` on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

from backends.replay.endpoint import replay_endpoint
from backends.replay.endpoint_probe import EndpointConfig, EndpointInfo
from tests.backends.loop_server import LoopbackServer, read_request
from workloads import Trace, TraceRequest

_BODY = (b'data: {"choices":[{"index":0,"text":"a","finish_reason":"length"}]}\n\n'
         b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1}}\n\n'
         b"data: [DONE]\n\n")
_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
             b"transfer-encoding: chunked\r\n\r\n"
             + b"%x\r\n%s\r\n0\r\n\r\n" % (len(_BODY), _BODY))


class _KeepAliveServer(LoopbackServer):
    """An HTTP/1.1 keep-alive server on the loopback that answers every POST with one SSE
    stream, counting the TCP connections it accepts."""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._accepted(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_request(reader)
                writer.write(_RESPONSE)
                await writer.drain()
        writer.close()


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
