"""`rt route`: an OpenAI-compatible router over OpenAI servers (FastAPI + httpx).

    POST /v1/completions, /v1/chat/completions   forwarded byte for byte (body, status,
                                                  content type; SSE chunk by chunk) to the
                                                  backend the policy chooses
    GET  /v1/models     the first backend up's answer
    GET  /health        200 while at least one backend is up, else 503
    GET  /metrics       the router's own metrics (`backends.route.metrics`)

Every forwarded response (streaming or not, whatever its status) carries `x-rt-replica: I`,
the index of the backend that answered (its position among `--backend`, 0-based: the
`replica` of a simulated fleet), so a client can attribute each request to a replica
(`rt replay --endpoint` records it in the `replica` column).

A request's life: the body is parsed for the prompt (`backends.route.prompt`); the shared
policy (`runtime.router`) chooses among the backends up, from their last scraped metrics and
its own state (`on_routed`); the request is sent. If the connection is refused, nothing
reached the backend: it counts a failure and the request is routed again among the others.
The first SSE event with output (chat: the second, after the role) calls `on_prefill_done`;
the end of the response, or its failure, `on_finished`. A response cut by its backend (the
process died, the stream broke, or the backend was taken out while silent) ends with an
OpenAI-style error (a JSON body, or an SSE `data: {"error": ...}` event), never a hang:
waits for a backend are bounded by `backend_timeout_s` and by its being taken out.

Everything runs on one asyncio loop, so the policy is called from one thread.
Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.route.backends import Backend, check_backends, healthy, scrape
from backends.route.flags import REPLICA_HEADER
from backends.route.metrics import RouterMetrics
from backends.route.prompt import routing_request
from backends.serve.openai_protocol import ApiError
from runtime.router import RoutingRequest, make_policy

# hop-by-hop and framing headers: never forwarded either way
_SKIP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive",
         "upgrade", "te", "trailer", "proxy-connection", "date", "server"}
_SCRAPE_TIMEOUT_S = 5.0  # a backend saturated by load answers /metrics late, not never


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The router's settings.

    Attributes:
        backends: base URLs (normalized: no trailing / or /v1); backend i is replica i.
        policy, policy_args, seed: the policy (`runtime.router.make_policy`).
        refresh_s: seconds between /metrics scrapes of each backend (0: scrape all before
            each decision).
        max_failures: consecutive failures that take a backend out.
        health_check_s: how often a backend taken out is probed on /health.
        backend_timeout_s: the longest a backend may stay silent within one request.
    """

    backends: tuple[str, ...]
    policy: str = "round-robin"
    policy_args: tuple[str, ...] = ()
    seed: int = 0
    refresh_s: float = 0.05
    max_failures: int = 3
    health_check_s: float = 0.5
    backend_timeout_s: float = 300.0


class _BackendDown(Exception):
    """The backend was taken out while the request waited for its headers."""


class Router:
    """The handlers' shared state: policy, backends, HTTP client, metrics."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy = make_policy(config.policy, config.policy_args, config.seed)
        self.backends = [Backend(i, url) for i, url in enumerate(config.backends)]
        self.metrics = RouterMetrics(config.policy, self.backends)
        self.client: httpx.AsyncClient | None = None
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle and backend state -------------------------------------------------------

    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.backend_timeout_s, connect=5.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        await asyncio.gather(*(self._scrape(b) for b in self.backends))
        self._tasks = [asyncio.create_task(self._watch(b)) for b in self.backends]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.client is not None:
            await self.client.aclose()

    async def _watch(self, backend: Backend) -> None:
        """Scrape the backend every refresh while up; probe /health while down."""
        cfg = self.config
        while True:
            if backend.up:
                await asyncio.sleep(cfg.refresh_s or cfg.health_check_s)
                if backend.up:
                    await self._scrape(backend)
                continue
            await asyncio.sleep(cfg.health_check_s)
            assert self.client is not None
            if await healthy(self.client, backend, _SCRAPE_TIMEOUT_S):
                backend.put_back()
                await self._scrape(backend)
            else:
                self.metrics.errors.labels(backend.url, "health").inc()

    async def _scrape(self, backend: Backend) -> None:
        assert self.client is not None
        if await scrape(self.client, backend, _SCRAPE_TIMEOUT_S):
            backend.succeeded()
        else:
            self.metrics.errors.labels(backend.url, "scrape").inc()
            backend.failed(self.config.max_failures)

    @property
    def any_up(self) -> bool:
        return any(b.up for b in self.backends)

    # ---- routing ---------------------------------------------------------------------------

    async def choose(self, routing: RoutingRequest, tried: set[int]) -> Backend | None:
        """The policy's choice among the backends up and not yet tried, recorded as routed;
        None if there is none."""
        if self.config.refresh_s == 0:
            await asyncio.gather(*(self._scrape(b) for b in self.backends if b.up))
        candidates = [b for b in self.backends if b.up and b.replica_id not in tried]
        if not candidates:
            return None
        now = time.monotonic()
        ages = [now - b.scraped_at_s for b in candidates if b.scraped_at_s is not None]
        if ages:
            self.metrics.decision_scrape_age.observe(sum(ages) / len(ages))
        decision = self.policy.choose(routing, [b.snapshot(now) for b in candidates])
        self.policy.on_routed(routing, decision.replica)
        self.metrics.decided(decision.reason)
        backend = self.backends[decision.replica]
        backend.in_flight += 1
        return backend

    def finish(self, backend: Backend, request_id: str) -> None:
        self.policy.on_finished(request_id)
        backend.in_flight -= 1

    async def generate(self, request: Request, path: str, chat: bool) -> Response:
        arrival = time.monotonic()
        body = await request.body()
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"malformed JSON body: {err}") from None
        if not isinstance(payload, dict):
            raise ApiError(400, "the body must be a JSON object")
        request_id = f"route-{next(self._ids)}"
        routing = routing_request(payload, chat, request.headers, request_id, arrival)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        tried: set[int] = set()
        while True:
            backend = await self.choose(routing, tried)
            if backend is None:
                self.metrics.unroutable.inc()
                raise ApiError(503, "no backend is up; retry later")
            self.metrics.routing_latency.observe(time.monotonic() - arrival)
            self.metrics.requests.labels(backend.url).inc()
            try:
                upstream = await self._send(backend, path, body, headers)
            except (httpx.ConnectError, httpx.ConnectTimeout):  # nothing reached it
                self.finish(backend, request_id)
                self.metrics.errors.labels(backend.url, "connect").inc()
                backend.failed(self.config.max_failures)
                self.metrics.retries.inc()
                tried.add(backend.replica_id)
                continue
            except (httpx.HTTPError, _BackendDown) as err:
                self.finish(backend, request_id)
                self.metrics.errors.labels(backend.url, "stream").inc()
                raise ApiError(502, f"backend {backend.url} failed: "
                               f"{err or type(err).__name__}") from None
            break
        return await self._respond(backend, upstream, request_id, chat)

    async def _send(self, backend: Backend, path: str, body: bytes,
                    headers: dict[str, str]) -> httpx.Response:
        """The backend's response, headers read, body not; `_BackendDown` if it is taken
        out first."""
        assert self.client is not None
        outgoing = self.client.build_request("POST", backend.url + path, content=body,
                                             headers=headers)
        send = asyncio.ensure_future(self.client.send(outgoing, stream=True))
        down = asyncio.ensure_future(backend.down_event.wait())
        try:
            await asyncio.wait((send, down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
            if not send.done():
                send.cancel()
        if send.cancelled():
            raise _BackendDown(f"{backend.url} was taken out")
        return send.result()

    async def _respond(self, backend: Backend, upstream: httpx.Response, request_id: str,
                       chat: bool) -> Response:
        status = upstream.status_code
        if status >= 500 and status != 503:  # an engine error, not load shedding
            self.metrics.errors.labels(backend.url, "status").inc()
            backend.failed(self.config.max_failures)
        else:
            backend.succeeded()
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP}
        headers[REPLICA_HEADER] = str(backend.replica_id)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self._relay(backend, upstream, request_id, chat),
                                     status_code=status, headers=headers)
        try:
            content = await upstream.aread()
        except httpx.HTTPError as err:
            self.metrics.errors.labels(backend.url, "stream").inc()
            raise ApiError(502, f"backend {backend.url} failed: "
                           f"{err or type(err).__name__}") from None
        finally:
            await upstream.aclose()
            self.policy.on_prefill_done(request_id)
            self.finish(backend, request_id)
        return Response(content, status_code=status, headers=headers)

    async def _relay(self, backend: Backend, upstream: httpx.Response, request_id: str,
                     chat: bool) -> AsyncIterator[bytes]:
        """The backend's SSE bytes as they come; an error event if the stream is cut."""
        backend.streams.add(upstream)
        first_output = 2 if chat else 1  # chat's first event is the role, no output yet
        events = 0
        tail = b""
        try:
            async for chunk in upstream.aiter_raw():
                if events < first_output:
                    events += chunk.count(b"data:")
                    if events >= first_output:
                        self.policy.on_prefill_done(request_id)
                tail = (tail + chunk)[-32:]
                yield chunk
            if not backend.up and b"[DONE]" not in tail:
                raise httpx.ReadError("the backend was taken out")
        except Exception as err:  # noqa: BLE001 (whatever broke the stream, the client is told)
            self.metrics.errors.labels(backend.url, "stream").inc()
            error = ApiError(502, f"backend {backend.url} failed mid-stream: "
                             f"{err or type(err).__name__}")
            yield f"data: {json.dumps(error.body())}\n\n".encode()
        finally:
            backend.streams.discard(upstream)
            await upstream.aclose()
            self.finish(backend, request_id)

    async def models(self) -> Response:
        assert self.client is not None
        for backend in self.backends:
            if not backend.up:
                continue
            try:
                response = await self.client.get(f"{backend.url}/v1/models",
                                                 timeout=_SCRAPE_TIMEOUT_S)
            except httpx.HTTPError:
                continue
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))
        raise ApiError(503, "no backend is up; retry later")


def build_app(config: RouterConfig) -> FastAPI:
    """The FastAPI app; the HTTP client and the scrapers start with its lifespan."""
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="rt route", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.generate(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.generate(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    async def health() -> Response:
        if router.any_up:
            return Response(status_code=200)
        return ApiError(503, "no backend is up").response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    return app


def run_router(config: RouterConfig, host: str, port: int, shutdown_timeout_s: float = 10.0,
               log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM: then stop accepting, let responses in flight finish for
    up to `shutdown_timeout_s` (then they are cut), close the client and return."""
    import uvicorn

    from backends.serve.api_server import _quiet_server_class

    server_class: Any = _quiet_server_class()
    uv_config = uvicorn.Config(build_app(config), host=host, port=port, log_level=log_level,
                               timeout_graceful_shutdown=max(int(shutdown_timeout_s), 1),
                               access_log=False)
    server = server_class(uv_config)
    server.run()
    if not server.started:
        raise RuntimeError("the router did not start (see the messages above)")


def router_config(urls: Sequence[str], policy: str, policy_args: Sequence[str],
                  refresh_ms: float, route: Any, seed: int) -> RouterConfig:
    """The router's settings from its flags (`RouteFlags` as `route`); ValueError (one line)
    on an unknown policy, a bad argument, or a backend that is unreachable, not
    OpenAI-compatible or lacks a metric the policy reads."""
    bases = check_backends(list(urls), make_policy(policy, list(policy_args), seed))
    return RouterConfig(tuple(bases), policy, tuple(policy_args), seed, refresh_ms / 1000.0,
                        route.max_failures, route.health_check_ms / 1000.0,
                        route.backend_timeout)
