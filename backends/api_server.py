"""The OpenAI-compatible API server of `rt serve` (FastAPI + uvicorn).

It tokenizes and detokenizes, hands requests to the engine-core process
(`backends.engine_process`) over ZeroMQ and streams what comes back:

    POST /v1/completions, /v1/chat/completions   (SSE `data: {json}` chunks, a final usage
                                                  chunk with stream_options.include_usage,
                                                  `data: [DONE]`; or one JSON response)
    GET  /v1/models, /health, /metrics            POST /tokenize, /detokenize

Errors are OpenAI-style JSON, `{"error": {"message", "type", "param", "code"}}`: 400 for
malformed JSON, invalid parameters or a prompt too long for max_model_len; 404 for an
unknown model; 503 above `--max-num-queued-requests` (requests sent to the engine without
a first token yet); 500 once the engine process is dead (`/health` then says so; streams
in flight end with an error event). A client that disconnects aborts its request in the
engine at once. Times are monotonic seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backends.engine_process import (
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    ExecutorFactory,
    RequestOutput,
    decode,
    encode,
    run_engine_process,
)
from backends.sampling_options import SamplingOptions
from backends.serve_metrics import ServeMetrics
from backends.text import ByteTokenizer, IncrementalDecoder, TextCodec
from runtime import SamplingParams

_HEALTH_POLL_S = 0.2  # how often the engine process's liveness is checked


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """The server's own settings (the engine's come from its factory).

    Attributes:
        model_name: the name clients pass as `model` (and the `model_name` label).
        factory, factory_kwargs: the executor factory run in the engine process.
        tokenizer_dir: a model directory whose tokenizer to use; None: `ByteTokenizer`.
        max_num_queued_requests: 503 above this many requests awaiting a first token.
        engine_start_timeout_s: how long the engine may take to say "ready".
    """

    model_name: str
    factory: ExecutorFactory
    factory_kwargs: dict[str, Any] = field(default_factory=dict)
    tokenizer_dir: Path | None = None
    max_num_queued_requests: int | None = None
    engine_start_timeout_s: float = 300.0


class ApiError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or {400: "BadRequestError", 404: "NotFoundError",
                             503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class EngineDeadError(ApiError):
    def __init__(self) -> None:
        super().__init__(500, "the engine process died", kind="EngineDeadError")


# ---- the engine client -----------------------------------------------------------------------


class EngineClient:
    """The API server's side of the engine process: start it, send, route its outputs."""

    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.tmpdir = tempfile.TemporaryDirectory(prefix="rt-serve-")
        self.input = self.context.socket(zmq.PUSH)
        self.output = self.context.socket(zmq.PULL)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.info: EngineInfo | None = None
        self.streams: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self.outgoing: asyncio.Queue[bytes] = asyncio.Queue()
        self.dead = False
        self.on_outputs: Callable[[EngineOutputs], None] = lambda _: None
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, factory: ExecutorFactory, kwargs: dict[str, Any],
                    timeout_s: float) -> EngineInfo:
        """Spawn the engine process and wait for its "ready" (RuntimeError if it fails)."""
        base = Path(self.tmpdir.name)
        in_addr, out_addr = f"ipc://{base / 'in'}", f"ipc://{base / 'out'}"
        self.input.bind(in_addr)
        self.output.bind(out_addr)
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=run_engine_process, name="rt-engine-core",
                                   args=(factory, kwargs, in_addr, out_addr, os.getpid()),
                                   daemon=True)
        self.process.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.output.poll(200):
                kind, payload = decode(await self.output.recv())
                if kind == "failed":
                    raise RuntimeError(f"the engine failed to start: {payload}")
                self.info = payload
                self.tasks = [asyncio.create_task(self._route()),
                              asyncio.create_task(self._send()),
                              asyncio.create_task(self._watch())]
                return payload
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited ({self.process.exitcode})")
        raise RuntimeError(f"the engine did not start within {timeout_s:g} s")

    def submit(self, request: EngineRequest) -> asyncio.Queue[RequestOutput | Exception]:
        if self.dead:
            raise EngineDeadError()
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.streams[request.request_id] = queue
        self.outgoing.put_nowait(encode(("add", request)))
        return queue

    def abort(self, request_id: str) -> None:
        """Synchronous (safe in a `finally` of a cancelled task)."""
        if self.streams.pop(request_id, None) is not None and not self.dead:
            self.outgoing.put_nowait(encode(("abort", [request_id])))

    def release(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    async def _send(self) -> None:
        while True:
            data = await self.outgoing.get()
            await self.input.send(data)

    async def _route(self) -> None:
        while True:
            kind, payload = decode(await self.output.recv())
            if kind != "outputs":
                continue
            self.on_outputs(payload)
            for out in payload.outputs:
                queue = self.streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    async def _watch(self) -> None:
        """Fail every open request once the engine process is gone."""
        assert self.process is not None
        while self.process.is_alive():
            await asyncio.sleep(_HEALTH_POLL_S)
        self.dead = True
        for queue in self.streams.values():
            queue.put_nowait(EngineDeadError())

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Tell the engine to stop, wait for it, close the sockets."""
        for task in self.tasks:
            task.cancel()
        process = self.process
        if process is not None and process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await asyncio.wait_for(self.input.send(encode(("shutdown", None))), 1.0)
            deadline = time.monotonic() + timeout_s
            while process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if process.is_alive():
                process.terminate()
                process.join(2.0)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()
        self.tmpdir.cleanup()


# ---- request parsing -------------------------------------------------------------------------


@dataclass(slots=True)
class Parsed:
    """A validated generation request."""

    prompt_ids: list[int]
    params: SamplingParams
    sampling: SamplingOptions
    stream: bool
    include_usage: bool
    continuous_usage: bool


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise ApiError(400, f"{name} must be {kinds[0].__name__}, got a boolean", name)
    if not isinstance(value, kinds):
        raise ApiError(400, f"{name} must be {kinds[0].__name__}, got {value!r}", name)
    return value


def _token_list(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, f"{name} must be a list of token ids", name)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, f"{name}: token id {bad[0]} is outside the vocabulary "
                       f"[0, {vocab_size})", name)
    return value


class RequestParser:
    """Validates OpenAI request bodies into `Parsed` (ApiError 400 otherwise)."""

    def __init__(self, codec: TextCodec, info: EngineInfo) -> None:
        self.codec = codec
        self.info = info
        self.max_model_len = info.scheduler.max_model_len

    def completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.codec.encode(prompt)
        if isinstance(prompt, list):
            return _token_list(prompt, "prompt", self.info.vocab_size)
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of "
                       "one of them (batches of several prompts are not supported)", "prompt")

    def chat_prompt(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", "messages")
        clean = []
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ApiError(400, "each message needs a string role", "messages")
            content = message.get("content") or ""
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(part.get("text", "") for part in content
                                  if isinstance(part, dict) and part.get("type") == "text")
            if not isinstance(content, str):
                raise ApiError(400, "message content must be a string or text parts",
                               "messages")
            clean.append({"role": message["role"], "content": content})
        return self.codec.chat_prompt(clean)

    def parse(self, body: dict[str, Any], prompt_ids: list[int], chat: bool) -> Parsed:
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, your request has {len(prompt_ids)} input tokens, "
                           "which leaves no room for output.", "prompt" if not chat
                           else "messages")
        max_tokens = self._max_tokens(body, chat, len(prompt_ids))
        unsupported = [name for name in ("stop", "logprobs", "echo", "best_of", "tools",
                                         "logit_bias", "response_format") if body.get(name)]
        if unsupported:
            raise ApiError(400, f"{unsupported[0]} is not supported by rt serve",
                           unsupported[0])
        if _get(body, "n", (int,), 1) != 1:
            raise ApiError(400, "only n=1 is supported", "n")
        min_tokens = _get(body, "min_tokens", (int,), 0)
        if not 0 <= min_tokens <= max_tokens:
            raise ApiError(400, f"min_tokens must be in [0, max_tokens={max_tokens}], got "
                           f"{min_tokens}", "min_tokens")
        ignore_eos = _get(body, "ignore_eos", (bool,), False)
        stop_ids = tuple(_token_list(body.get("stop_token_ids") or [], "stop_token_ids",
                                     self.info.vocab_size))
        eos_ids = self.info.eos_token_ids
        eos = eos_ids[0] if eos_ids else None
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                                ignore_eos=ignore_eos, eos_token_id=eos,
                                stop_token_ids=stop_ids + tuple(eos_ids[1:]) * (not ignore_eos))
        sampler_stops = tuple(stop_ids) + (() if ignore_eos else tuple(eos_ids))
        sampling = self._sampling(body, min_tokens, sampler_stops)
        stream = _get(body, "stream", (bool,), False)
        options = _get(body, "stream_options", (dict,), {})
        return Parsed(prompt_ids, params, sampling, stream,
                      bool(options.get("include_usage")),
                      bool(options.get("continuous_usage_stats")))

    def _max_tokens(self, body: dict[str, Any], chat: bool, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") \
            is not None else "max_tokens"
        value = _get(body, name, (int,), None)
        if value is None:
            return room if chat else min(16, room)
        if value < 1:
            raise ApiError(400, f"{name} must be at least 1, got {value}", name)
        if value > room:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, you requested {prompt_len + value} tokens "
                           f"({prompt_len} in the prompt, {value} in the completion).", name)
        return value

    @staticmethod
    def _sampling(body: dict[str, Any], min_tokens: int,
                  stops: tuple[int, ...]) -> SamplingOptions:
        temperature = float(_get(body, "temperature", (int, float), 1.0))
        top_p = float(_get(body, "top_p", (int, float), 1.0))
        top_k = _get(body, "top_k", (int,), 0)
        seed = _get(body, "seed", (int,), None)
        if temperature < 0:
            raise ApiError(400, f"temperature must be >= 0, got {temperature}", "temperature")
        if not 0 < top_p <= 1:
            raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
        if top_k < 0 and top_k != -1:
            raise ApiError(400, f"top_k must be -1, 0 or positive, got {top_k}", "top_k")
        return SamplingOptions(temperature, top_p, max(top_k, 0), seed, min_tokens, stops)


# ---- responses -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Generation:
    """One request in flight, as the handler sees it."""

    request_id: str
    parsed: Parsed
    arrival_s: float
    decoder: IncrementalDecoder
    queue: asyncio.Queue[RequestOutput | Exception]
    output_len: int = 0
    cached: int = 0
    last_output_s: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def usage(self) -> dict[str, Any]:
        prompt = len(self.parsed.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.output_len,
                "total_tokens": prompt + self.output_len,
                "prompt_tokens_details": {"cached_tokens": self.cached}}


def _sse(data: dict[str, Any] | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"


class Server:
    """Handlers and the state they share."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.engine = EngineClient()
        self.codec: TextCodec | None = None
        self.parser: RequestParser | None = None
        self.metrics: ServeMetrics | None = None
        self.info: EngineInfo | None = None
        self.gens: dict[str, _Generation] = {}
        self.awaiting_first = 0  # requests sent without a first output yet

    async def start(self) -> None:
        cfg = self.config
        info = await self.engine.start(cfg.factory, cfg.factory_kwargs,
                                       cfg.engine_start_timeout_s)
        self.info = info
        self.codec = self._codec(info)
        self.parser = RequestParser(self.codec, info)
        self.metrics = ServeMetrics(cfg.model_name, info.scheduler.max_model_len,
                                    info.cache.num_blocks, info.cache.block_size,
                                    info.cache.enable_prefix_caching)
        self.engine.on_outputs = self.on_outputs

    def _codec(self, info: EngineInfo) -> TextCodec:
        if self.config.tokenizer_dir is not None:
            from backends.engine_setup import load_tokenizer
            from backends.text import HfCodec

            tokenizer = load_tokenizer(self.config.tokenizer_dir)
            if tokenizer is not None:
                return HfCodec(tokenizer)
        return ByteTokenizer(info.vocab_size)

    # ---- engine outputs -> metrics -------------------------------------------------------

    def on_outputs(self, batch: EngineOutputs) -> None:
        metrics = self.metrics
        assert metrics is not None
        s = batch.stats
        metrics.on_stats(s.num_running, s.num_waiting, s.kv_cache_usage,
                         s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions)
        now = time.monotonic()
        iteration = 0
        for out in batch.outputs:
            gen = self.gens.get(out.request_id)
            if gen is None or not out.new_token_ids:
                continue
            iteration += len(out.new_token_ids)
            if gen.last_output_s is None:
                self.awaiting_first -= 1
                prompt_len = len(gen.parsed.prompt_ids)
                iteration += prompt_len - out.num_cached_tokens
                metrics.on_first_output(prompt_len, out.num_cached_tokens, now - gen.arrival_s)
                metrics.on_tokens(len(out.new_token_ids), None)
            else:
                metrics.on_tokens(len(out.new_token_ids), batch.timestamp - gen.last_output_s)
            gen.last_output_s = batch.timestamp
        metrics.on_iteration(iteration)

    def _finished(self, gen: _Generation, out: RequestOutput) -> None:
        """Record a finished request's metrics and forget it."""
        metrics = self.metrics
        assert metrics is not None
        self.gens.pop(gen.request_id, None)
        self.engine.release(gen.request_id)
        if gen.last_output_s is None:
            self.awaiting_first -= 1
        phases = _phases(out)
        metrics.on_finished(out.finish_reason or "abort", prompt_len=len(gen.parsed.prompt_ids),
                            output_len=gen.output_len, max_tokens=gen.parsed.params.max_tokens,
                            cached=out.num_cached_tokens, e2e_s=time.monotonic() - gen.arrival_s,
                            num_preemptions=out.num_preemptions, **phases)

    def _forget(self, gen: _Generation, abort: bool) -> None:
        """The handler gave up on a request (client gone, engine dead)."""
        if self.gens.pop(gen.request_id, None) is None:
            return
        if gen.last_output_s is None:
            self.awaiting_first -= 1
        if abort:
            self.engine.abort(gen.request_id)
            assert self.metrics is not None
            self.metrics.success.labels(**self.metrics.labels, finished_reason="abort").inc()
        else:
            self.engine.release(gen.request_id)

    # ---- generation ---------------------------------------------------------------------

    def admit(self, parsed: Parsed, arrival_s: float) -> _Generation:
        limit = self.config.max_num_queued_requests
        assert self.metrics is not None and self.codec is not None
        if self.engine.dead:
            raise EngineDeadError()
        if limit is not None and self.awaiting_first >= limit:
            self.metrics.on_rejected()
            raise ApiError(503, f"the server is at its queue limit ({limit} requests "
                           "waiting); retry later")
        request_id = uuid.uuid4().hex
        queue = self.engine.submit(EngineRequest(request_id, parsed.prompt_ids, parsed.params,
                                                 parsed.sampling, arrival_s))
        gen = _Generation(request_id, parsed, arrival_s, self.codec.decoder(), queue)
        self.gens[request_id] = gen
        self.awaiting_first += 1
        return gen

    async def outputs(self, gen: _Generation) -> AsyncIterator[tuple[str, RequestOutput]]:
        """(text delta, output) per engine output until the request finishes."""
        while True:
            item = await gen.queue.get()
            if isinstance(item, Exception):
                self._forget(gen, abort=False)
                raise item
            gen.output_len += len(item.new_token_ids)
            gen.cached = item.num_cached_tokens or gen.cached
            text = gen.decoder.step(item.new_token_ids)
            if item.finish_reason is not None:
                gen.finish_reason, gen.stop_reason = item.finish_reason, item.stop_reason
                self._finished(gen, item)
                yield text, item
                return
            yield text, item

    async def complete(self, gen: _Generation) -> str:
        """All of a request's text (non-streaming); aborts it if the handler is cancelled."""
        parts = []
        try:
            async for text, _ in self.outputs(gen):
                parts.append(text)
        finally:
            self._forget(gen, abort=True)
        return "".join(parts)

    async def stream(self, gen: _Generation, model: str, chat: bool) -> AsyncIterator[str]:
        """SSE chunks as vLLM emits them; a disconnect (cancellation) aborts the request."""
        rid = ("chatcmpl-" if chat else "cmpl-") + gen.request_id
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": model}
        parsed = gen.parsed
        try:
            if chat:
                yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                        "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            async for text, out in self.outputs(gen):
                choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                          "finish_reason": out.finish_reason,
                                          "stop_reason": out.stop_reason}
                if chat:
                    choice["delta"] = {"content": text}
                else:
                    choice["text"] = text
                chunk = {**head, "choices": [choice]}
                if parsed.continuous_usage:
                    chunk["usage"] = gen.usage()
                yield _sse(chunk)
            if parsed.include_usage:
                yield _sse({**head, "choices": [], "usage": gen.usage()})
            yield _sse("[DONE]")
        except ApiError as err:
            yield _sse(err.body())
        finally:
            self._forget(gen, abort=True)

    def response(self, gen: _Generation, text: str, model: str, chat: bool) -> dict[str, Any]:
        rid = ("chatcmpl-" if chat else "cmpl-") + gen.request_id
        choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                  "finish_reason": gen.finish_reason,
                                  "stop_reason": gen.stop_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model, "choices": [choice],
                "usage": gen.usage()}


def _phases(out: RequestOutput) -> dict[str, float | None]:
    """vLLM's per-request phase times from the engine timestamps (None if not reached)."""
    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    return {"queue_s": diff(out.scheduled_s, out.queued_s),
            "prefill_s": diff(out.first_token_s, out.scheduled_s),
            "decode_s": diff(out.last_token_s, out.first_token_s),
            "inference_s": diff(out.last_token_s, out.scheduled_s)}


# ---- the app ---------------------------------------------------------------------------------


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"malformed JSON body: {err}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def build_app(config: ServeConfig) -> FastAPI:
    """The FastAPI app; the engine process starts with the app's lifespan."""
    server = Server(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await server.start()
        try:
            yield
        finally:
            await server.engine.shutdown()

    app = FastAPI(title="rt serve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return err.response()

    async def generate(request: Request, chat: bool) -> Response:
        arrival = time.monotonic()
        body = await _json_body(request)
        model = body.get("model") or config.model_name
        if model != config.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        parser = server.parser
        assert parser is not None
        prompt = parser.chat_prompt(body) if chat else parser.completion_prompt(body)
        parsed = parser.parse(body, prompt, chat)
        gen = server.admit(parsed, arrival)
        if parsed.stream:
            return StreamingResponse(server.stream(gen, model, chat),
                                     media_type="text/event-stream")
        text = await server.complete(gen)
        return JSONResponse(server.response(gen, text, model, chat))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = server.info
        assert info is not None
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "rt", "root": config.model_name, "parent": None,
            "max_model_len": info.scheduler.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if server.engine.dead:
            return EngineDeadError().response()
        pid = server.info.pid if server.info is not None else 0
        return Response(status_code=200, headers={"x-engine-pid": str(pid)})

    @app.get("/metrics")
    async def metrics() -> Response:
        assert server.metrics is not None
        return Response(generate_latest(server.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        parser = server.parser
        assert parser is not None
        tokens = parser.chat_prompt(body) if "messages" in body \
            else parser.completion_prompt(body)
        return {"count": len(tokens), "max_model_len": parser.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        assert server.parser is not None and server.codec is not None
        tokens = _token_list(body.get("tokens"), "tokens", server.parser.info.vocab_size)
        return {"prompt": server.codec.decode(tokens)}

    return app


def _quiet_server_class() -> type:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after its graceful shutdown (the process then
        dies of the signal); rt serve exits 0 after a clean drain instead."""

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


def run_server(config: ServeConfig, host: str, port: int, shutdown_timeout_s: float = 10.0,
               log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM: then stop accepting, let streams in flight finish for up
    to `shutdown_timeout_s` (after that they are cancelled, which aborts them), stop the
    engine process and return."""
    import uvicorn

    _Server = _quiet_server_class()
    uv_config = uvicorn.Config(build_app(config), host=host, port=port, log_level=log_level,
                               timeout_graceful_shutdown=max(int(shutdown_timeout_s), 1),
                               access_log=False)
    server = _Server(uv_config)
    server.run()
    if not server.started:
        raise RuntimeError("the server did not start (see the messages above)")
