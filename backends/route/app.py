"""`rt route`: an OpenAI-compatible router over OpenAI servers.

    POST /v1/completions, /v1/chat/completions   forwarded byte for byte (body, status,
                                                  content type; SSE bytes as they arrive)
                                                  to the backend the policy chooses
    GET  /v1/models     the first backend up's answer
    GET  /health        200 while at least one backend is up, else 503
    GET  /metrics       the router's own metrics (`backends.route.metrics`)

Every forwarded response (streaming or not, whatever its status) carries `x-rt-replica: I`,
the index of the backend that answered (its position among `--backend`, 0-based: the
`replica` of a simulated fleet), so a client can attribute each request to a replica
(`rt replay --endpoint` records it in the `replica` column).

HTTP is the router's own both ways: `backends.route.server` (clients) and
`backends.route.upstream` (backends); the handler is `backends.route.relay`.

Input is checked as `rt serve` checks it (`backends.serve.guard`): with an API key, /v1/*
needs `Authorization: Bearer KEY` (401 in vLLM's body otherwise, from the request's head,
before its body is read: `Router.screen`; /health and /metrics stay open), and the client's
`Authorization` header is forwarded to the backend, so backends sharing the key accept it
(the router's own calls to /v1/models carry its key); a body over `max_request_bytes` gets
413 (`backends.route.server`); a body that is not a UTF-8 JSON object 400. Every error the
router answers itself is vLLM's shape, encoded as rt serve's.

A request's life: the body is parsed for the prompt (`backends.route.prompt`); the shared
policy (`runtime.router`) chooses among the backends up, from their last scraped metrics
and its own state (`on_routed`); the request is sent, its body as received (never
re-serialized), on a keep-alive connection of the backend's own pool (httpx serves only the
start-up check, /v1/models and the /health probes of a backend taken out). /metrics of each
backend (on its pool too) is scraped every refresh when the policy reads a gauge, else
every health check (it is then only a liveness check). If the connection is refused,
nothing reached the backend: it counts a failure and the request is routed again among the
others.
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
import functools
import itertools
import signal
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import certifi
import httpx

from backends.listen import socket_url
from backends.route.backends import Backend, healthy, needed_signals
from backends.route.config import RouterConfig, bearer
from backends.route.flags import REPLICA_HEADER
from backends.route.http1 import field, request_head
from backends.route.metrics import RouterMetrics
from backends.route.prompt import routing_request
from backends.route.relay import handle
from backends.route.server import serve
from backends.route.upstream import (
    ConnectFailed,
    Exchange,
    UpstreamConfig,
    UpstreamError,
    UpstreamFailed,
    UpstreamPool,
    get,
)
from backends.serve.api_error import ApiError
from backends.serve.guard import UNAUTHORIZED, ApiKey, parse_body, require_json
from backends.serve.responses import json_bytes
from runtime.router import RoutingRequest, make_policy

# hop-by-hop and framing headers: never forwarded either way (and `expect`: the router has
# the whole body before it sends)
_SKIP = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection",
                   b"keep-alive", b"upgrade", b"te", b"trailer", b"proxy-connection", b"date",
                   b"server", b"expect"})
_REPLICA = REPLICA_HEADER.encode()
_SESSION = b"x-session-id"
_SCRAPE_TIMEOUT_S = 5.0  # a backend saturated by load answers /metrics late, not never
_CONNECT_TIMEOUT_S = 5.0
_MAX_IDLE = 128  # idle keep-alive connections kept per backend
_UNAUTHORIZED = json_bytes(UNAUTHORIZED)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of the header `name` (lower-case), decoded as HTTP's latin-1."""
    return next((v.decode("latin-1") for k, v in headers if k == name), None)


class Router:
    """The handlers' shared state: policy, backends, HTTP client, metrics."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy = make_policy(config.policy, config.policy_args, config.seed)
        # a policy that reads no gauge (round-robin, prefix-aware, ...) needs /metrics only
        # as a liveness check: scraped every health check, not every refresh
        self.reads_metrics = bool(needed_signals(self.policy))
        self.reads_ids = self.policy.reads_token_ids
        self.backends = [Backend(i, url) for i, url in enumerate(config.backends)]
        self.scrape_period_s = config.refresh_s if self.reads_metrics else config.health_check_s
        self.metrics = RouterMetrics(config.policy, self.backends, self.scrape_period_s)
        self.key = None if config.api_key is None else ApiKey(config.api_key)
        self.client: httpx.AsyncClient | None = None  # scrapes, health, /v1/models
        # the requests' connections, per backend (index = replica id), and the path each
        # backend's URL puts before /v1/...
        https = any(url.startswith("https:") for url in config.backends)
        # the default trust store (certifi), loaded once (0.17 s) for all the backends
        tls = ssl.create_default_context(cafile=certifi.where()) if https else None
        self.pools = [UpstreamPool(_upstream(url, tls, config.backend_timeout_s))
                      for url in config.backends]
        self._prefixes = [urlsplit(url).path.encode() for url in config.backends]
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle and backend state -------------------------------------------------------

    async def start(self) -> None:
        timeout = httpx.Timeout(self.config.backend_timeout_s, connect=_CONNECT_TIMEOUT_S)
        self.client = httpx.AsyncClient(timeout=timeout, headers=bearer(self.config.api_key))
        await asyncio.gather(*(self._scrape(b) for b in self.backends))
        self._tasks = [asyncio.create_task(self._watch(b)) for b in self.backends]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for pool in self.pools:
            pool.close()
        if self.client is not None:
            await self.client.aclose()

    async def _watch(self, backend: Backend) -> None:
        """Scrape the backend every refresh while up (every health check if the policy
        reads no gauge), on a fixed tick (a scrape that takes long delays the next one, not
        every later one: the period stays the refresh, as a simulated fleet's); probe
        /health while down."""
        cfg = self.config
        period = self.scrape_period_s or cfg.health_check_s  # 0: scraped at decisions
        tick = time.monotonic()
        while True:
            if backend.up:
                tick = max(tick + period, time.monotonic())
                await asyncio.sleep(tick - time.monotonic())
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
        """/metrics of the backend, on a connection of its pool, into it."""
        target = self._prefixes[backend.replica_id] + b"/metrics"
        try:
            status, text = await get(self.pools[backend.replica_id], target, _SCRAPE_TIMEOUT_S)
        except UpstreamError:
            status, text = 0, b""
        if status == 200:
            backend.scraped(text.decode("utf-8", "replace"))
            backend.succeeded()
        else:
            self.metrics.errors.labels(backend.url, "scrape").inc()
            backend.failed(self.config.max_failures)

    def screen(self, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes] | None:
        """vLLM's 401 for a request to /v1/* without the API key, from its head (the server
        asks before it reads the body: `backends.route.server.Screen`); None: read on."""
        if self.key is not None and self.key.refuses(path, field(headers, b"authorization")):
            return 401, _UNAUTHORIZED
        return None

    @property
    def any_up(self) -> bool:
        return any(b.up for b in self.backends)

    # ---- routing ---------------------------------------------------------------------------

    async def choose(self, routing: RoutingRequest, tried: set[int]) -> Backend | None:
        """The policy's choice among the backends up and not yet tried, recorded as routed;
        None if there is none."""
        if self.config.refresh_s == 0 and self.reads_metrics:
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

    async def dispatch(self, body: bytes, headers: list[tuple[bytes, bytes]], target: bytes,
                       chat: bool, arrival: float) -> tuple[Backend, Exchange, str]:
        """Route the request (body bytes, headers with lower-case names, the target path
        and query) and send it: its backend, the exchange with the backend's response head
        read, and its router id.
        ApiError (400 bad body, 503 nothing up, 502 the backend failed) otherwise; a refused
        connection is routed again among the backends not yet tried. Cancelled (the client
        gone) while the head is awaited: the exchange is closed, which aborts the request
        at the backend, and the routing finished."""
        require_json(_header(headers, b"content-type"))  # as rt serve, before the body
        payload = parse_body(body)
        request_id = f"route-{next(self._ids)}"
        session = _header(headers, _SESSION)
        routing = routing_request(payload, chat, {"x-session-id": session} if session
                                  is not None else {}, request_id, arrival, self.reads_ids)
        tried: set[int] = set()
        while True:
            backend = await self.choose(routing, tried)
            if backend is None:
                self.metrics.unroutable.inc()
                raise ApiError(503, "no backend is up; retry later")
            self.metrics.routing_latency.observe(time.monotonic() - arrival)
            self.metrics.dispatched(backend.replica_id)
            try:
                return backend, await self._send(backend, target, body, headers), request_id
            except ConnectFailed:  # nothing reached it
                self.finish(backend, request_id)
                self.metrics.errors.labels(backend.url, "connect").inc()
                backend.failed(self.config.max_failures)
                self.metrics.retries.inc()
                tried.add(backend.replica_id)
            except UpstreamFailed as err:
                self.finish(backend, request_id)
                self.metrics.errors.labels(backend.url, "stream").inc()
                raise ApiError(502, f"backend {backend.url} failed: {err}") from None
            except asyncio.CancelledError:  # the client left, or the drain was cut: the
                self.finish(backend, request_id)  # exchange is closed (`_send`)
                raise

    async def _send(self, backend: Backend, target: bytes, body: bytes,
                    headers: list[tuple[bytes, bytes]]) -> Exchange:
        """The exchange with the backend's response head read (registered in
        `backend.streams` until the relay is done with it, so that taking the backend out
        fails it)."""
        pool = self.pools[backend.replica_id]
        head = request_head(b"POST", self._prefixes[backend.replica_id] + target,
                            pool.host_header, len(body), headers, _SKIP)
        exchange = pool.exchange()
        backend.streams.add(exchange)
        try:
            await exchange.start(head, body)
        except BaseException:
            backend.streams.discard(exchange)
            exchange.close()
            raise
        return exchange

    def answered(self, backend: Backend, upstream: Exchange) -> list[tuple[bytes, bytes]]:
        """Count the backend's status (an engine error, a 5xx other than load shedding's
        503, is a failure) and return the response headers to forward: the backend's but
        hop-by-hop and framing ones, plus `x-rt-replica`."""
        status = upstream.status
        if status >= 500 and status != 503:
            self.metrics.errors.labels(backend.url, "status").inc()
            backend.failed(self.config.max_failures)
        else:
            backend.succeeded()
        headers = [(k, v) for k, v in upstream.headers if k not in _SKIP]
        headers.append((_REPLICA, str(backend.replica_id).encode()))
        return headers

    async def models(self) -> tuple[int, bytes, bytes]:
        """The first backend up's answer to GET /v1/models: status, content type, body."""
        assert self.client is not None
        for backend in self.backends:
            if not backend.up:
                continue
            try:
                response = await self.client.get(f"{backend.url}/v1/models",
                                                 timeout=_SCRAPE_TIMEOUT_S)
            except httpx.HTTPError:
                continue
            content_type = response.headers.get("content-type", "").encode("latin-1")
            return response.status_code, content_type, response.content
        raise ApiError(503, "no backend is up; retry later")


def _upstream(url: str, tls: ssl.SSLContext | None, timeout_s: float) -> UpstreamConfig:
    """The pool settings for a backend's base URL (http or https)."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    return UpstreamConfig(parts.hostname or "127.0.0.1", parts.port or (443 if https else 80),
                          tls if https else None, _MAX_IDLE, _CONNECT_TIMEOUT_S, timeout_s)


def run_router(config: RouterConfig, sock: socket.socket, shutdown_timeout_s: float = 10.0
               ) -> int:
    """Serve on `sock` (listening, `backends.listen.listening_socket`) until SIGINT/SIGTERM:
    then stop accepting, let responses in flight finish for up to `shutdown_timeout_s` (then
    they are cut: a stream ends with an error event and [DONE], a request not yet answered
    gets a 503, their backend requests are aborted), close the clients and return how many
    were cut. The router's own server (`backends.route.server`) logs nothing."""
    return asyncio.run(_serve(config, sock, shutdown_timeout_s))


async def _serve(config: RouterConfig, sock: socket.socket, shutdown_timeout_s: float
                 ) -> int:
    router = Router(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await router.start()
    try:
        return await serve(functools.partial(handle, router), sock, shutdown_timeout_s, stop,
                           config.max_request_bytes, router.screen if router.key else None)
    finally:
        await router.stop()


def route_until_stopped(config: RouterConfig, sock: socket.socket, shutdown_timeout_s: float,
                        say: Callable[[str], None],
                        print_url: Callable[[str], None] | None = None) -> None:
    """`rt route`: the router of `config` (`backends.route.config.router_config`) on `sock`
    (bound by the command, so port 0's real port is known), its URL to `print_url` when
    given, served until SIGINT/SIGTERM (`run_router`), saying where and when it stopped (and
    how many requests the drain cut)."""
    url = f"{socket_url(sock)}/v1"
    if print_url is not None:
        print_url(url)
    say(f"routing ({config.policy}) over {len(config.backends)} backends on {url}")
    cut = run_router(config, sock, shutdown_timeout_s)
    say("router stopped" + (f"; --shutdown-timeout ({shutdown_timeout_s:g} s) cut {cut} "
                            "request(s) in flight" if cut else ""))
