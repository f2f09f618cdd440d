"""OpenAI-style errors, as `rt serve` and `rt route` answer them:
`{"error": {"message", "type", "param", "code"}}` with the HTTP status as `code`.

`ApiError` is the one exception a handler raises for an answer that is not a generation;
`body_error` is vLLM's shape for a body that does not fit the request's schema.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from backends.serve.responses import json_bytes


class ApiError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or {400: "BadRequestError", 401: "AuthenticationError",
                             404: "NotFoundError", 413: "RequestTooLargeError",
                             503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def encoded(self) -> bytes:
        """The body's bytes as `response()` sends them (for a server without Starlette's
        responses: `rt route`)."""
        return json_bytes(self.body())


def body_error(message: str, param: str | None = "body") -> ApiError:
    """A body that does not fit the request's schema (malformed JSON, a field of the wrong
    type, a required one missing): vLLM's shape for it (FastAPI's validation errors), type
    "Bad Request" and `param` the location, `body.<field>`."""
    return ApiError(400, message, param, kind="Bad Request")


# A request still running when the server stops waiting for it (`--shutdown-timeout` ran out,
# or a second Ctrl-C): aborted, and answered with this (a stream: as its last event, then
# `[DONE]`); rt serve's and rt route's words.
SHUT_DOWN = ApiError(503, "the server shut down before the request finished")


class EngineDeadError(ApiError):
    def __init__(self) -> None:
        super().__init__(500, "the engine process died", kind="EngineDeadError")
