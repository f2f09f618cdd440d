"""What `rt serve` checks before a handler runs: the API key and the body's size, and the
bounded reading of a JSON body.

    /v1/*  without `Authorization: Bearer KEY` (when a key is set)   401 {"error": "Unauthorized"}
    a body longer than `max_request_bytes` (Content-Length or read)  413, OpenAI-style error
    a body that is not a UTF-8 JSON object                           400, OpenAI-style error

The key check is vLLM's (`AuthenticationMiddleware`, entrypoints/openai/api_server.py): the
SHA-256 digests of the sent and the expected token are compared with
`secrets.compare_digest`, so the time taken says nothing about the key, not even its length;
its 401 body is vLLM's. The middleware is plain ASGI (no per-request task, unlike Starlette's
`BaseHTTPMiddleware`), so streams pay nothing for it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic_core import from_json
from starlette.types import ASGIApp, Receive, Scope, Send

from backends.serve.openai_protocol import ApiError


class RequestGuard:
    """ASGI middleware: 401 on /v1/* without the API key, 413 on a declared oversize body."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.key_digest = None if api_key is None else _digest(api_key.encode())
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.key_digest is not None and scope["path"].startswith("/v1") \
                and not self._authorized(headers.get(b"authorization", b"")):
            await JSONResponse({"error": "Unauthorized"}, 401)(scope, receive, send)
            return
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_request_bytes:
            await too_large(self.max_request_bytes).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        assert self.key_digest is not None
        return secrets.compare_digest(_digest(token), self.key_digest)


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _no_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


def parse_json(text: str) -> Any:
    """`json.loads(text)` without NaN or infinities, through pydantic-core's parser (in
    Rust, a dependency of FastAPI's): a 256-token prompt's body parses in ~30 us instead of
    ~75 us (timeit at load ~8), ~7% of the API process's CPU per admitted request. Whatever
    it refuses is parsed again by `json.loads`, so every error (and every body only
    `json.loads` takes: a lone surrogate escape, nesting deeper than 200) is `json`'s; where
    both parse, the values are equal (tests/backends/serve/test_parse_json.py)."""
    try:
        return from_json(text, allow_inf_nan=False, cache_strings="keys")
    except ValueError:
        return json.loads(text, parse_constant=_no_constant)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is longer than {limit} bytes",
                    kind="RequestTooLargeError")


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, read up to `limit` bytes (a chunked body has no
    Content-Length for the middleware to check). ApiError 413 or 400 otherwise."""
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise too_large(limit)
    try:
        body = parse_json(bytes(data).decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8") from None
    except ValueError as err:  # JSONDecodeError, or an integer of over 4300 digits
        raise ApiError(400, f"malformed JSON body: {err}") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body
