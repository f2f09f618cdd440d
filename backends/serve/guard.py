"""What `rt serve` checks before a handler runs: the API key and the body's size, and the
bounded reading of a JSON body. `rt route` checks the same with `ApiKey`, `too_large` and
`parse_body` (its own HTTP server has no ASGI middleware).

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

from backends.serve.api_error import ApiError, body_error

# vLLM's 401 body (not the OpenAI error shape: vLLM's middleware answers it so)
UNAUTHORIZED = {"error": "Unauthorized"}


class ApiKey:
    """The API-key check: a request to /v1/* must carry `Authorization: Bearer KEY`."""

    def __init__(self, key: str) -> None:
        self._digest = _digest(key.encode())

    def refuses(self, path: str, authorization: bytes | None) -> bool:
        """Whether a request to `path` with this `Authorization` header value (None: none)
        gets the 401."""
        if not path.startswith("/v1"):
            return False
        scheme, _, token = (authorization or b"").partition(b" ")
        return scheme.lower() != b"bearer" or not secrets.compare_digest(_digest(token),
                                                                         self._digest)


class RequestGuard:
    """ASGI middleware: 401 on /v1/* without the API key, 413 on a declared oversize body."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int) -> None:
        self.app = app
        self.key = None if api_key is None else ApiKey(api_key)
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.key is not None and self.key.refuses(scope["path"],
                                                     headers.get(b"authorization")):
            await JSONResponse(UNAUTHORIZED, 401)(scope, receive, send)
            return
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_request_bytes:
            await too_large(self.max_request_bytes).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


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
    Content-Length for the middleware to check). ApiError 413 or 400 otherwise; 400 too for
    a Content-Type other than application/json, as vLLM (a body of any other type, or none,
    is refused once read, so an oversized one is still 413)."""
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise too_large(limit)
    require_json(request.headers.get("content-type"))
    return parse_body(bytes(data))


def require_json(content_type: str | None) -> None:
    """ApiError 400 (vLLM's words and shape) unless the Content-Type is application/json
    (parameters such as a charset allowed). rt route checks the same before routing."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        shown = media if len(media) <= 40 else media[:37] + "..."
        raise body_error("Unsupported Media Type: Only 'application/json' is allowed "
                         f"(content-type {shown or 'none'})", param=None)


def parse_body(data: bytes) -> dict[str, Any]:
    """A request body as a JSON object; ApiError 400 (in vLLM's shape) otherwise: not UTF-8,
    malformed, nested too deeply, or not an object."""
    try:
        body = parse_json(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise body_error("the body is not UTF-8") from None
    except ValueError as err:  # JSONDecodeError, or an integer of over 4300 digits
        raise body_error(f"malformed JSON body: {err}") from None
    except RecursionError:
        raise body_error("malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise body_error("the body must be a JSON object")
    return body
