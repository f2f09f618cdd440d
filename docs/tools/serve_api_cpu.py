"""The API server's Python path per request and per token, in-process (no sockets, no engine):
N streams through `api_server.front` (the guard, the stream path, the handler), T engine steps
of outputs pickled, routed (`Server.on_outputs`, `EngineClient.deliver`) and written to an ASGI
`send` that frames them as uvicorn's does (chunked), on uvloop. Prints the CPU
(`time.process_time`) per request and per token, the writes per stream and a digest of one
stream's bytes (id and `created` masked), which must not change with the code.

    cd CHECKOUT && PYTHONPATH=$PWD python docs/tools/serve_api_cpu.py 200 1 20    # 1-token
    cd CHECKOUT && PYTHONPATH=$PWD python docs/tools/serve_api_cpu.py 200 128 3   # 128 tokens

A measuring aid for docs/serve.md ("The API process's CPU per request and per token"), not
part of rt.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import re
import sys
import time
from typing import Any

import uvloop

from backends.engine.text import ByteTokenizer
from backends.serve.api_server import front, routes_app
from backends.serve.messages import (
    EngineInfo,
    EngineOutputs,
    RequestOutput,
    SchedulerStats,
    decode,
    encode,
)
from backends.serve.metrics import ServeMetrics
from backends.serve.openai_protocol import RequestParser
from backends.serve.server import ServeConfig, Server
from runtime import CacheConfig, SchedulerConfig

VOCAB = 128256


def setup() -> tuple[Any, Server]:
    app = routes_app(ServeConfig("m", None))  # type: ignore[arg-type]
    server = app.state.server
    info = EngineInfo(SchedulerConfig(max_model_len=4096), CacheConfig(num_blocks=1000),
                      VOCAB, (2,), 1)
    server.info, server.codec = info, ByteTokenizer(VOCAB)
    server.parser = RequestParser(server.codec, info)
    server.metrics = ServeMetrics("m", 4096, 1000, 16, True)
    server.engine._post = lambda data: None  # the message is built (pickled), not sent
    return front(app), server


class Conn:
    """One client connection as uvicorn's httptools protocol serves it, without the socket."""

    def __init__(self, body: bytes) -> None:
        self.out: list[bytes] = []
        self.body: bytes | None = body
        self.done = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.done.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            content = [b"HTTP/1.1 200 OK\r\n"]
            for name, value in message["headers"]:
                content.extend([name.lower(), b": ", value, b"\r\n"])
            content.append(b"transfer-encoding: chunked\r\n\r\n")
            self.out.append(b"".join(content))
            return
        body, more = message.get("body", b""), message.get("more_body", False)
        content = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
        if not more:
            content.append(b"0\r\n\r\n")
            self.done.set()
        self.out.append(b"".join(content))


async def one_round(app: Any, server: Server, n: int, steps: int) -> list[Conn]:
    body = json.dumps({"model": "m", "prompt": list(range(1000, 1256)), "max_tokens": steps,
                       "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [
        (b"host", b"x"), (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode())], "query_string": b"",
        "http_version": "1.1", "scheme": "http", "root_path": ""}
    conns = [Conn(body) for _ in range(n)]
    tasks = [asyncio.ensure_future(app(dict(scope), c.receive, c.send)) for c in conns]
    for _ in range(3):
        await asyncio.sleep(0)
    ids = list(server.gens)
    assert len(ids) == n, len(ids)
    for t in range(steps):
        last = t == steps - 1
        times = (1.0, 1.0, 1.0, 1.0) if last else (None, None, None, None)
        outs = [RequestOutput(r, [1000 + t % 90], "length" if last else None, None, 0, 0,
                              *times) for r in ids]
        stats = SchedulerStats(n, 0, 0.5, 0, 0, 0)
        _, batch = decode(encode(("outputs", EngineOutputs(float(t), outs, stats))))
        server.on_outputs(batch)
        server.engine.deliver(batch.outputs)
        for _ in range(4):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return conns


def main() -> None:
    n, steps, rounds = (int(arg) for arg in sys.argv[1:4])
    app, server = setup()
    loop = uvloop.new_event_loop()
    conns = loop.run_until_complete(one_round(app, server, n, steps))  # warm-up
    wire = re.sub(rb'"created":\d+', b'"created":0',
                  re.sub(rb"cmpl-[0-9a-f]{32}", b"cmpl-X", b"".join(conns[0].out)))
    gc.collect()
    gc.freeze()
    per_request = []
    for _ in range(rounds):
        start = time.process_time()
        loop.run_until_complete(one_round(app, server, n, steps))
        per_request.append(1e6 * (time.process_time() - start) / n)
    median = sorted(per_request)[len(per_request) // 2]
    print(f"{n} streams x {steps} tokens: {median:.1f} us per request, "
          f"{median / steps:.2f} us per token (median of {rounds}); "
          f"{len(conns[0].out)} writes per stream; stream bytes sha256 "
          f"{hashlib.sha256(wire).hexdigest()[:16]}")


if __name__ == "__main__":
    main()
