"""The OpenAI-compatible API server of `rt serve` (FastAPI + uvicorn).

It tokenizes and detokenizes, hands requests to the engine-core process
(`backends.serve.engine_process`) over ZeroMQ and streams what comes back:

    POST /v1/completions, /v1/chat/completions   (SSE `data: {json}` chunks, a final usage
                                                  chunk with stream_options.include_usage,
                                                  `data: [DONE]`; or one JSON response)
    GET  /v1/models, /health, /version, /metrics  POST /tokenize, /detokenize

Errors are OpenAI-style JSON, `{"error": {"message", "type", "param", "code"}}`: 400 for
malformed JSON, invalid parameters or a prompt too long for max_model_len; 404 for an
unknown model; 401 without the API key (`--api-key`) and 413 past `--max-request-bytes`
(`guard`); 503 above `--max-num-queued-requests` (requests sent to the engine without a first
token yet); 500 once the engine process is dead (`/health` then answers 503, streams in
flight end with an error event, and the server stops, exiting non-zero). A client that
leaves a stream aborts its request in the engine at once (a non-streaming request runs to its
end: nothing watches its connection). The handlers' shared state is `server.Server`. What
uvicorn serves is `build_app`'s `front(routes_app)`: the guard, then the two generation
routes as bare ASGI (`stream_path.StreamPath`), then the FastAPI app for the rest (it keeps
the two routes for `/openapi.json`). Times are monotonic seconds.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.listen import listening_socket, socket_url
from backends.serve import parallel_sampling
from backends.serve.api_error import ApiError, body_error
from backends.serve.body_fields import token_list
from backends.serve.guard import RequestGuard, json_body
from backends.serve.openai_protocol import PRIORITY_HEADER
from backends.serve.openapi_schema import request_schema
from backends.serve.server import ServeConfig, Server
from backends.serve.stream_path import (
    ASGIApp,
    ClientGone,
    EventStream,
    EventStreamResponse,
    Generate,
    StreamPath,
    unless_client_leaves,
)

__all__ = ["HttpStack", "ServeConfig", "Server", "build_app", "front", "http_stack",
           "listening_socket", "routes_app", "run_server", "socket_url"]

logger = logging.getLogger("rt.serve")


# ---- the app ---------------------------------------------------------------------------------


def build_app(config: ServeConfig) -> ASGIApp:
    """What `rt serve` serves: `front(routes_app(config))`, the guard first."""
    return front(routes_app(config))


def routes_app(config: ServeConfig) -> FastAPI:
    """The FastAPI app of every route, without the guard (API key, body size): serve it only
    behind `front`. The engine process starts with the app's lifespan."""
    server = Server(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            await server.start()
        except Exception as err:  # noqa: BLE001 - kept for `run_server`'s one line
            # not uvicorn's traceback: an error escaping here skips the `finally` below, and
            # the engine left running (SIGTERM ignored) hangs the exit. RuntimeError: the
            # engine's start; ValueError: the API side's (--model's tokenizer), already named
            server.start_error = (str(err) if isinstance(err, (RuntimeError, ValueError))
                                  else f"{type(err).__name__}: {err}")
            server.engine.dead = True  # until uvicorn exits: /health 503, generation 500
            server.request_exit()
        try:
            yield
        finally:
            await server.engine.shutdown()

    app = FastAPI(title="rt serve", lifespan=lifespan)
    app.state.server = server
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(Exception, _internal_error)
    _generation_routes(app, _generator(server))
    _info_routes(app, server)
    _token_routes(app, server)
    return app


def front(app: FastAPI) -> ASGIApp:
    """What uvicorn serves: the guard (API key, body size) on every request, then the
    generation routes as bare ASGI, then `app` for everything else (the lifespan included).
    Outside FastAPI, so a generation request skips its middleware chain (its per-request
    telemetry check, the body-limit and exception layers, the wrapper of every `send`):
    ~40-60 us per streamed request in-process (docs/serve.md, "uvloop and httptools")."""
    server: Server = app.state.server
    config = server.config
    return RequestGuard(StreamPath(app, _generator(server)), api_key=config.api_key,
                        max_request_bytes=config.max_request_bytes)


async def _api_error(_: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, ApiError)
    return err.response()


async def _internal_error(_: Request, err: Exception) -> JSONResponse:
    """Our bug, answered in the OpenAI shape (the traceback goes to the log)."""
    logger.error("unhandled error", exc_info=err)
    return ApiError(500, f"internal error: {type(err).__name__}").response()


def _generator(server: Server) -> Generate:
    """The generation handler: a JSON response, or the SSE events of a stream (ApiError for
    a bad request)."""
    config = server.config

    async def generate(request: Request, chat: bool) -> Response | EventStream:
        try:
            return await _generate(request, chat)
        except (ApiError, ClientGone):
            raise
        except Exception as err:  # as `_internal_error` (StreamPath runs outside FastAPI)
            logger.error("unhandled error", exc_info=err)
            raise ApiError(500, f"internal error: {type(err).__name__}") from None

    async def _generate(request: Request, chat: bool) -> Response | EventStream:
        arrival = time.monotonic()
        body = await json_body(request, config.max_request_bytes)
        model = body.get("model") or config.model_name
        if not isinstance(model, str):
            raise body_error("model must be a string", "body.model")
        if model != config.model_name:
            raise ApiError(404, f"The model `{model[:200]}` does not exist.", "model")
        parser = server.parser
        assert parser is not None
        prompt = parser.chat_prompt(body) if chat else parser.completion_prompt(body)
        parsed = parser.parse(body, prompt, chat, request.headers.get(PRIORITY_HEADER))
        if parsed.n > 1:  # parallel sampling: n engine requests (`parallel_sampling`)
            parent = await parallel_sampling.fan_out(server, parsed, arrival)
            if parsed.stream:
                return parallel_sampling.stream_all(server, parent, model, chat)
            texts = await unless_client_leaves(parallel_sampling.complete_all(server, parent),
                                               request.receive)
            return JSONResponse(parent.response(texts, model, chat, int(time.time())))
        gen = server.admit(parsed, arrival)
        if parsed.stream:
            return server.stream(gen, model, chat)
        text = await unless_client_leaves(server.complete(gen), request.receive)
        return JSONResponse(server.response(gen, text, model, chat))

    return generate


def _generation_routes(app: FastAPI, generate: Generate) -> None:
    """The routes `StreamPath` serves, kept in FastAPI for /openapi.json (and for
    `routes_app` served alone, as the tests compare); a stream's request is aborted whenever
    its response ends early, as on `StreamPath` (`EventStreamResponse`)."""

    async def respond(request: Request, chat: bool) -> Response:
        try:
            answer = await generate(request, chat)
        except ClientGone:  # its request aborted; what is sent here reaches nobody
            return Response(status_code=499)  # nginx's "client closed request"
        if isinstance(answer, Response):
            return answer
        return EventStreamResponse(answer)

    @app.post("/v1/completions", openapi_extra=request_schema("completion"))
    async def completions(request: Request) -> Response:
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_schema("chat"))
    async def chat_completions(request: Request) -> Response:
        return await respond(request, chat=True)


def _info_routes(app: FastAPI, server: Server) -> None:
    name, rt_version = server.config.model_name, server.config.rt_version

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = server.info
        assert info is not None
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "rt",
            "root": name, "parent": None, "max_model_len": info.scheduler.max_model_len,
            "permission": [_permission()]}]}

    @app.get("/health")
    async def health() -> Response:
        if server.engine.dead:  # vLLM: 503 once the engine is dead
            return ApiError(503, "the engine process died", kind="EngineDeadError").response()
        pid = server.info.pid if server.info is not None else 0
        return Response(status_code=200, headers={"x-engine-pid": str(pid)})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": rt_version}  # vLLM's route; rt's version (`ServeConfig`)

    @app.get("/metrics")
    async def metrics() -> Response:
        assert server.metrics is not None
        return Response(generate_latest(server.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


def _permission() -> dict[str, Any]:
    """vLLM's `ModelPermission` of a served model (OpenAI's, deprecated), rt's values: no
    logprobs."""
    return {"id": f"modelperm-{secrets.token_hex(8)}", "object": "model_permission",
            "created": int(time.time()), "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": False, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}


def _token_routes(app: FastAPI, server: Server) -> None:
    limit = server.config.max_request_bytes

    @app.post("/tokenize", openapi_extra=request_schema("tokenize"))
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await json_body(request, limit)
        parser = server.parser
        assert parser is not None
        if "messages" not in body and "prompt" not in body:  # vLLM's schema: one is required
            raise body_error("prompt is required", "body.prompt")
        tokens = parser.chat_prompt(body) if "messages" in body \
            else parser.completion_prompt(body)
        return {"count": len(tokens), "max_model_len": parser.max_model_len, "tokens": tokens}

    @app.post("/detokenize", openapi_extra=request_schema("detokenize"))
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await json_body(request, limit)
        assert server.parser is not None and server.codec is not None
        tokens = token_list(body.get("tokens"), "tokens", server.parser.info.vocab_size)
        return {"prompt": server.codec.decode(tokens)}


def _quiet_server_class() -> type:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after its graceful shutdown (the process then
        dies of the signal); rt serve exits 0 after a clean drain instead. A second Ctrl-C
        (uvicorn's force exit) cuts the drain short and still stops the engine process."""

        async def shutdown(self, sockets: Any = None) -> None:
            """uvicorn's; on a force exit it stops waiting for the requests in flight and
            skips the app's lifespan shutdown, leaving both to asyncio.run's final cancel,
            where the lifespan's cancel is logged as a traceback (`ERROR: Traceback ...
            CancelledError`). Here those requests are cancelled, as when
            --shutdown-timeout runs out, and the lifespan shut down (the engine stopped)."""
            import asyncio

            await super().shutdown(sockets)
            if self.force_exit:
                tasks = list(self.server_state.tasks)
                for task in tasks:
                    task.cancel(msg="Task cancelled, a second Ctrl-C")
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.lifespan.shutdown()

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            import signal

            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return QuietServer


@dataclass(frozen=True, slots=True)
class HttpStack:
    """uvicorn's event loop and HTTP/1.1 implementation (its `loop=` and `http=` names)."""

    loop: str  # "uvloop" or "asyncio"
    http: str  # "httptools" or "h11"

    def describe(self) -> str:
        return f"uvicorn with the {self.loop} event loop and the {self.http} HTTP parser"


def http_stack() -> HttpStack:
    """uvloop and httptools when both import (`uvicorn[standard]`, what vLLM installs), else
    asyncio and h11, uvicorn's pure-Python pair. Chosen here, not by uvicorn's "auto", so the
    start-up line can say which. At 200 streams the C pair cut the API process's CPU per
    streamed token by ~25% and per 1-token request by ~38% (docs/serve.md, "uvloop and
    httptools")."""
    if _imports("uvloop") and _imports("httptools"):
        return HttpStack("uvloop", "httptools")
    return HttpStack("asyncio", "h11")


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def run_server(config: ServeConfig, sock: socket.socket, stack: HttpStack,
               shutdown_timeout_s: float = 10.0, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM: then stop accepting, let streams in flight finish for up
    to `shutdown_timeout_s` (after that they are cancelled, which aborts them), stop the
    engine process and return. If the engine process dies, every stream in flight ends with
    an error event, then the server stops the same way and raises RuntimeError (the command
    exits non-zero, for a supervisor to restart it, as vLLM's API server does). `sock`: the
    listening socket (`listening_socket`), closed on return."""
    import uvicorn

    _Server = _quiet_server_class()
    app = routes_app(config)
    host, port = sock.getsockname()[:2]
    uv_config = uvicorn.Config(front(app), host=host, port=port, loop=stack.loop, http=stack.http,
                               log_level=log_level,
                               timeout_graceful_shutdown=max(int(shutdown_timeout_s), 1),
                               access_log=False)
    server = _Server(uv_config)
    app.state.server.request_exit = lambda: setattr(server, "should_exit", True)
    with sock:
        server.run(sockets=[sock])
    if app.state.server.start_error is not None:
        raise RuntimeError(app.state.server.start_error)
    if not server.started:
        raise RuntimeError("the server did not start (see the messages above)")
    if app.state.server.engine.dead:
        raise RuntimeError("the engine process died; the server stopped")
