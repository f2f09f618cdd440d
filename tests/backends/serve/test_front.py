"""`api_server.front`: what uvicorn serves. The generation routes run outside FastAPI (the
guard, then `StreamPath`); what they answer must be what the FastAPI routes answer, errors
included, and a bug in a handler is still a 500 in the OpenAI shape, never a dropped
connection. In-process (httpx's ASGI transport; the lifespan, and so the engine, never
starts: the handler's missing parser is the bug)."""

from __future__ import annotations

import asyncio
import logging

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from backends.serve.api_server import build_app, front, routes_app  # noqa: E402
from backends.serve.server import ServeConfig  # noqa: E402

BODIES = [
    b'{"prompt": "hi"',  # malformed JSON: 400
    b"[1, 2]",  # not an object: 400
    b'{"prompt": "hi", "model": 7}',  # 400
    b'{"prompt": "hi", "model": "other"}',  # unknown model: 404
    b'{"prompt": "hi", "stream": true}',  # past the checks, the parser is missing: 500
]


def _factory() -> None:  # never called: the engine does not start here
    raise AssertionError


async def _answers(app: object, path: str) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        answers = []
        for body in BODIES:
            response = await client.post(path, content=body,
                                         headers={"content-type": "application/json"})
            answers.append((response.status_code, sorted(response.headers.items()),
                            response.content))
        return answers


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_front_answers_as_the_fastapi_routes(path: str, caplog: pytest.LogCaptureFixture
                                             ) -> None:
    app = routes_app(ServeConfig("m", _factory))
    with caplog.at_level(logging.CRITICAL):  # the 500's traceback, logged on both sides
        outside = asyncio.run(_answers(front(app), path))
        inside = asyncio.run(_answers(app, path))
    assert [status for status, _, _ in outside] == [400, 400, 400, 404, 500]
    assert outside == inside
    assert b'"internal error: AssertionError"' in outside[-1][2]
    assert b'"type":"InternalServerError"' in outside[-1][2]


def test_front_puts_the_guard_before_every_route() -> None:
    app = build_app(ServeConfig("m", _factory, api_key="k"))  # = front(routes_app(...))

    async def statuses() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.post("/v1/completions", json={})).status_code,
                    (await client.get("/v1/models")).status_code,
                    (await client.get("/openapi.json")).status_code]

    assert asyncio.run(statuses()) == [401, 401, 200]


def test_version_answers_the_configs_rt_version() -> None:
    """/version names the version cli.py computed (`ServeConfig.rt_version`), not one the
    API server looks up itself (that was the installed one only: "unknown" from a plain
    checkout on PYTHONPATH, where run.json and profiles named the checkout's)."""
    app = build_app(ServeConfig("m", _factory, rt_version="0.0.0+serve"))

    async def answer() -> tuple[int, object]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.get("/version")
            return response.status_code, response.json()

    assert asyncio.run(answer()) == (200, {"version": "0.0.0+serve"})
