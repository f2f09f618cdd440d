"""A fake OpenAI-compatible streaming server (FastAPI + uvicorn in a thread, loopback) for
the `rt replay --endpoint` tests: its behaviour knobs, what it saw; `running_fake_server` and
`endpoint_trace` are the test modules' fixtures (`pytest.fixture(...)` there)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fastapi
import uvicorn
from fastapi.responses import JSONResponse, StreamingResponse

from backends.replay.endpoint_probe import EndpointConfig
from workloads import Trace, TraceRequest

ROOT = Path(__file__).resolve().parents[3]
MODEL = "fake-model"
FIRST_CHUNK_DELAY_S = 0.02
CHUNK_GAP_S = 0.004


@dataclass
class FakeState:
    """How the fake server behaves, and what it saw."""

    tokens_per_chunk: int = 1
    text: str = "x"  # one token's text (sent as raw UTF-8, as vLLM does)
    fail_every: int = 0  # every n-th request (by arrival at the server) gets HTTP 500
    hang_first_s: float = 0.0  # the first request waits this long before streaming
    usage: bool = True
    seen: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _fake_app(state: FakeState) -> fastapi.FastAPI:
    api = fastapi.FastAPI()

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model",
                                            "max_model_len": 4096}]}

    @api.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> Any:
        state.seen += 1
        number = state.seen
        state.bodies.append(body)
        if body.get("model") != MODEL:
            return JSONResponse({"error": {"message": "no such model", "code": 404}}, 404)
        if state.fail_every and number % state.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure", "code": 500}}, 500)
        hang = state.hang_first_s if number == 1 else 0.0
        return StreamingResponse(_events(state, body, hang), media_type="text/event-stream")

    return api


async def _events(state: FakeState, body: dict[str, Any], hang_s: float) -> Any:
    """vLLM's completions stream: content chunks, the finish reason on the last one, a usage
    chunk (choices: []), then [DONE]."""
    state.in_flight += 1
    state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
    try:
        await asyncio.sleep(FIRST_CHUNK_DELAY_S + hang_s)
        total = int(body["max_tokens"])
        sent = 0
        while sent < total:
            n = min(state.tokens_per_chunk, total - sent)
            sent += n
            last = sent == total
            choice = {"index": 0, "text": state.text * n, "logprobs": None,
                      "finish_reason": "length" if last else None, "stop_reason": None}
            chunk = json.dumps({"object": "text_completion", "choices": [choice]},
                               ensure_ascii=False)
            yield f"data: {chunk}\n\n"
            if not last:
                await asyncio.sleep(CHUNK_GAP_S)
        yield ": keep-alive\n\n"
        if state.usage:
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": total,
                     "total_tokens": len(body["prompt"]) + total}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        state.in_flight -= 1


@dataclass
class FakeServer:
    url: str
    state: FakeState


def running_fake_server() -> Iterator[FakeServer]:
    """A fresh fake server per test, on a free loopback port; stopped afterwards."""
    state = FakeState()
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets (as uvicorn's own
    # binding does); without it, Nagle holds a kept-alive stream's chunks ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(_fake_app(state), log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    try:
        yield FakeServer(f"http://127.0.0.1:{port}", state)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def endpoint_trace() -> Trace:
    """12 requests over 0.22 s, prompts 8-52 tokens, outputs 3-9 tokens."""
    return Trace(tuple(
        TraceRequest(f"r{i}", arrival_s=0.02 * i, prompt_len=8 + 4 * i, output_len=3 + i % 7)
        for i in range(12)), name="endpoint-test")


def config_for(server: FakeServer, **kwargs: Any) -> EndpointConfig:
    return EndpointConfig(server.url, **kwargs)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def rt_serve(args: list[str]) -> Iterator[str]:
    """`rt serve ARGS` on a free port; yields its URL once /health answers; SIGTERM after."""
    import httpx

    port = closed_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--port", str(port), *args], cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"rt serve exited: {proc.stdout.read()}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "rt serve did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
