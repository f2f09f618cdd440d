"""What `rt serve`'s handlers share: the requests in flight (`request_state`), their
admission, the engine's outputs routed into metrics and streams, and the OpenAI response
bodies (SSE chunks as vLLM emits them, or one JSON response). The FastAPI app around it is
`api_server`; a request with `n` > 1 is driven by `parallel_sampling` through the methods its
`ChildHost` names. Times are monotonic seconds.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.engine.sampling_options import SamplingOptions
from backends.engine.text import ByteTokenizer, TextCodec
from backends.serve import sse
from backends.serve.api_error import ApiError, EngineDeadError
from backends.serve.engine_client import EngineClient, OutputQueue
from backends.serve.executor import ExecutorFactory
from backends.serve.flags import ServeFlags
from backends.serve.messages import EngineInfo, EngineOutputs, EngineRequest, RequestOutput
from backends.serve.metrics import ServeMetrics
from backends.serve.openai_protocol import Parsed, RequestParser
from backends.serve.request_state import RequestState, has_output, merge_queued
from backends.serve.responses import answer_id, choice_body, chunk_object, response_body
from backends.serve.stop_strings import StopStringText
from backends.serve.stream_path import EventStream, Last

logger = logging.getLogger("rt.serve")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """The server's own settings (the engine's come from its factory).

    Attributes:
        model_name: the name clients pass as `model` (and the `model_name` label).
        factory, factory_kwargs: the executor factory run in the engine process.
        tokenizer_dir: a model directory whose tokenizer to use; None: `ByteTokenizer`.
        max_num_queued_requests: 503 above this many requests awaiting a first token.
        engine_start_timeout_s: how long the engine may take to say "ready".
        api_key: required as `Authorization: Bearer KEY` on /v1/* (None: open).
        max_request_bytes: longer request bodies get 413.
        enable_mfu_metrics: the engine estimates each step's FLOPs and bytes per GPU
            (vLLM's `vllm:estimated_*_per_gpu` counters; without it they stay at 0).
        rt_version: what /version answers (cli.py's `analysis.rundir.rt_version`: the
            installed version, else the checkout's).
    """

    model_name: str
    factory: ExecutorFactory
    factory_kwargs: dict[str, Any] = field(default_factory=dict)
    tokenizer_dir: Path | None = None
    max_num_queued_requests: int | None = None
    engine_start_timeout_s: float = 300.0
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    enable_mfu_metrics: bool = False
    rt_version: str = "unknown"

    @classmethod
    def of(cls, flags: ServeFlags, factory: ExecutorFactory, factory_kwargs: dict[str, Any],
           model_name: str, tokenizer_dir: Path | None, *, rt_version: str) -> ServeConfig:
        """From `rt serve`'s flags and the engine's executor spec (--served-model-name, if
        given, names the model), and rt's version."""
        return cls(flags.served_model_name or model_name, factory, factory_kwargs,
                   tokenizer_dir, flags.max_num_queued_requests, api_key=flags.api_key,
                   max_request_bytes=flags.max_request_bytes,
                   enable_mfu_metrics=flags.enable_mfu_metrics, rt_version=rt_version)


class Server:
    """Handlers and the state they share."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.engine = EngineClient()
        self.codec: TextCodec | None = None
        self.parser: RequestParser | None = None
        self.metrics: ServeMetrics | None = None
        self.info: EngineInfo | None = None
        self.gens: dict[str, RequestState] = {}
        self.awaiting_first = 0  # requests sent without a first output yet
        self.request_exit: Callable[[], None] = lambda: None  # set by `run_server`
        self.start_error: str | None = None  # why the engine did not start (the lifespan's)

    async def start(self) -> None:
        cfg = self.config
        info = await self.engine.start(cfg.factory, cfg.factory_kwargs,
                                       cfg.engine_start_timeout_s, cfg.enable_mfu_metrics)
        self.info = info
        self.codec = self._codec(info)
        self.parser = RequestParser(self.codec, info)
        self.metrics = ServeMetrics(cfg.model_name, info.scheduler.max_model_len,
                                    info.cache.num_blocks, info.cache.block_size,
                                    info.cache.enable_prefix_caching)
        self.engine.on_outputs = self.on_outputs
        self.engine.on_dead = self.on_engine_dead
        # What exists now (modules, the app, the tokenizer) lives as long as the server: out
        # of the collector's way, a full collection no longer walks it (measured at 200
        # streams: 2 full collections of ~70 ms each in a 10 s run before, 1 of 6 ms after;
        # vLLM's API server does the same in its lifespan, launchers/utils/server_utils.py).
        gc.collect()
        gc.freeze()

    def on_engine_dead(self) -> None:
        """The engine process is gone: streams in flight already got their error event;
        stop serving so that the process exits non-zero and its supervisor restarts it."""
        logger.error("the engine process died (exit code %s): shutting down",
                     getattr(self.engine.process, "exitcode", None))
        self.request_exit()

    def _codec(self, info: EngineInfo) -> TextCodec:
        if self.config.tokenizer_dir is not None:
            from backends.engine.setup import load_tokenizer
            from backends.engine.text import HfCodec

            tokenizer = load_tokenizer(self.config.tokenizer_dir)
            if tokenizer is not None:
                return HfCodec(tokenizer)
        return ByteTokenizer(info.vocab_size)

    # ---- engine outputs -> metrics -------------------------------------------------------

    def on_outputs(self, batch: EngineOutputs) -> None:
        """One engine step's outputs into the metrics, in bulk (one generation-token
        increment and one ITL pass per step; a request's first output: its prompt counters
        and TTFT)."""
        metrics = self.metrics
        assert metrics is not None
        s = batch.stats
        metrics.on_stats(s.num_running, s.num_waiting, s.kv_cache_usage,
                         s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions)
        metrics.on_perf(s.perf)
        now, step_s = time.monotonic(), batch.timestamp
        new_tokens = prefill_tokens = 0
        itls: list[float] = []  # seconds, in output order
        gens = self.gens
        for out in batch.outputs:
            gen = gens.get(out.request_id)
            if gen is None or not out.new_token_ids:
                continue
            new_tokens += len(out.new_token_ids)
            if gen.last_output_s is None:
                self.awaiting_first -= 1
                prompt_len = len(gen.parsed.prompt_ids)
                prefill_tokens += prompt_len - out.num_cached_tokens
                metrics.on_first_output(prompt_len, out.num_cached_tokens, now - gen.arrival_s)
                gen.queued_s, gen.scheduled_s, gen.first_output_s = \
                    out.queued_s, out.scheduled_s, step_s
            else:
                itls.append(step_s - gen.last_output_s)
            gen.last_output_s = step_s
        metrics.on_tokens(new_tokens, itls)
        metrics.on_iteration(new_tokens + prefill_tokens)

    def _finished(self, gen: RequestState, out: RequestOutput, abort: bool = False) -> None:
        """Record a finished request's metrics and forget it; `abort`: the engine still
        runs it (a stop string found first: vLLM's output processor aborts it there)."""
        metrics = self.metrics
        assert metrics is not None
        self.gens.pop(gen.request_id, None)
        if abort:
            self.engine.abort(gen.request_id)
        else:
            self.engine.release(gen.request_id)
        if gen.last_output_s is None:
            self.awaiting_first -= 1
        phases = _phases(out)
        metrics.on_finished(out.finish_reason or "abort", prompt_len=len(gen.parsed.prompt_ids),
                            output_len=gen.output_len, max_tokens=gen.parsed.params.max_tokens,
                            cached=out.num_cached_tokens, e2e_s=time.monotonic() - gen.arrival_s,
                            num_preemptions=out.num_preemptions, **phases)
        parent = (1, gen.output_len) if gen.parent is None else \
            gen.parent.on_child_finished(gen)
        if parent is not None:
            metrics.on_parent_finished(*parent)

    def forget(self, gen: RequestState, abort: bool) -> None:
        """The handler gave up on a request (client gone, engine dead); `abort`: the engine
        may still run it. Nothing for a request already let go (finished or forgotten)."""
        if self.gens.pop(gen.request_id, None) is None:
            return
        if gen.last_output_s is None:
            self.awaiting_first -= 1
        if abort:
            self.engine.abort(gen.request_id)
            assert self.metrics is not None
            self.metrics.finished_reason("abort").inc()
        else:
            self.engine.release(gen.request_id)

    # ---- generation ---------------------------------------------------------------------

    def _check_admission(self, n: int) -> None:
        """EngineDeadError, or ApiError 503 if `n` more requests would pass the queue limit
        (a request with `n` > 1 counts as n, as vLLM's check_admission)."""
        limit = self.config.max_num_queued_requests
        assert self.metrics is not None
        if self.engine.dead:
            raise EngineDeadError()
        if limit is not None and self.awaiting_first + n > limit:
            self.metrics.on_rejected()
            raise ApiError(503, f"the server is at its queue limit ({limit} requests "
                           "waiting); retry later")

    def admit(self, parsed: Parsed, arrival_s: float) -> RequestState:
        self._check_admission(1)
        # 32 random hex digits, as uuid4().hex (vLLM's random_uuid) without building a UUID
        request_id = os.urandom(16).hex()
        queue = self.engine.submit(EngineRequest(request_id, parsed.prompt_ids, parsed.params,
                                                 parsed.sampling, arrival_s, parsed.priority,
                                                 parsed.cache_salt))
        return self._track(request_id, parsed, arrival_s, queue)

    # ---- children (`n` > 1): what `parallel_sampling.ChildHost` asks of the server ---------

    def hold_places(self, n: int) -> None:
        """Admit `n` requests at once (as `_check_admission`) and take their n places among
        those awaiting a first output, from now on (`add_child` fills them)."""
        self._check_admission(n)
        self.awaiting_first += n

    def free_places(self, n: int) -> None:
        """Give back `n` places `hold_places` took that no child filled."""
        self.awaiting_first -= n

    def add_child(self, request_id: str, parsed: Parsed, sampling: SamplingOptions,
                  arrival_s: float, queue: OutputQueue) -> RequestState:
        """Send a child request (its own id and sampling options) whose outputs go to its
        parent's `queue`, and track it in a place `hold_places` took."""
        self.engine.submit(EngineRequest(request_id, parsed.prompt_ids, parsed.params,
                                         sampling, arrival_s, parsed.priority,
                                         parsed.cache_salt), queue)
        return self._track(request_id, parsed, arrival_s, queue, held=True)

    def _track(self, request_id: str, parsed: Parsed, arrival_s: float, queue: OutputQueue,
               held: bool = False) -> RequestState:
        """A request sent to the engine, now in flight; `held`: its place among those
        awaiting a first output was taken beforehand (`hold_places`)."""
        assert self.codec is not None
        gen = RequestState(request_id, parsed, arrival_s, self.codec.decoder(), queue)
        if parsed.stop:
            gen.stops = StopStringText(gen.decoder, parsed.stop, parsed.include_stop_str,
                                       parsed.params.min_tokens)
        self.gens[request_id] = gen
        if not held:
            self.awaiting_first += 1
        return gen

    def _next(self, gen: RequestState) -> tuple[str, RequestOutput]:
        """The (text delta, output) of the outputs queued for `gen` (merged: `merge_queued`);
        the error that ended it raised. Only when `has_output(gen)`."""
        item = gen.deferred if gen.deferred is not None \
            else merge_queued(gen, gen.queue.get_nowait())
        if isinstance(item, Exception):
            self.forget(gen, abort=False)
            raise item
        return self.step(gen, item)

    def step(self, gen: RequestState, item: RequestOutput) -> tuple[str, RequestOutput]:
        """`item`'s text delta (stop strings checked) and the output as the client sees it;
        records the request's end if it ended."""
        gen.cached = item.num_cached_tokens or gen.cached
        # vLLM leaves the text of the token that stopped the request (EOS or a stop token)
        # out, unless include_stop_str_in_output
        skip_last = item.finish_reason == "stop" and not gen.parsed.include_stop_str
        engine_done = item.finish_reason is not None
        if gen.stops is None:
            ids = item.new_token_ids
            text = gen.decoder.step(ids[:-1] if skip_last else ids)
        else:
            text, item = gen.stops.take(item, skip_last, (gen.queued_s, gen.scheduled_s,
                                                          gen.first_output_s,
                                                          gen.last_output_s))
        gen.output_len += len(item.new_token_ids)
        if item.finish_reason is not None:
            gen.finish_reason, gen.stop_reason = item.finish_reason, item.stop_reason
            self._finished(gen, item, abort=not engine_done)
        return text, item

    async def outputs(self, gen: RequestState) -> AsyncIterator[tuple[str, RequestOutput]]:
        """(text delta, output) per engine output until the request finishes; the outputs
        that queued up while the stream was writing come merged into one (see `merge_queued`)."""
        while True:
            if not has_output(gen):
                await gen.queue.wait()
            text, item = self._next(gen)
            yield text, item
            if item.finish_reason is not None:
                return

    async def complete(self, gen: RequestState) -> str:
        """All of a request's text (non-streaming); aborts it if the handler is cancelled."""
        parts = []
        try:
            async for text, _ in self.outputs(gen):
                parts.append(text)
        finally:
            self.forget(gen, abort=True)
        return "".join(parts)

    def stream(self, gen: RequestState, model: str, chat: bool) -> EventStream:
        """SSE events as vLLM emits them (`sse`); a disconnect (cancellation), or closing
        the stream before it starts, aborts the request."""
        return EventStream(self._events(gen, model, chat),
                           functools.partial(self.forget, gen, abort=True))

    async def _events(self, gen: RequestState, model: str, chat: bool
                      ) -> AsyncGenerator[bytes, None]:
        encoder = sse.ChunkEncoder(answer_id(gen.request_id, chat), chunk_object(chat),
                                   int(time.time()), model, chat)
        parsed = gen.parsed
        first = chat  # the chat stream's role chunk goes out with the first output
        try:
            while True:  # `outputs` inlined: one async generator less per chunk
                if not has_output(gen):
                    await gen.queue.wait()
                text, out = self._next(gen)
                if first:
                    yield sse.event(gen.role_chunk(encoder.head))
                    first = False
                if out.finish_reason is None and out.stop_reason is None \
                        and not parsed.continuous_usage:
                    yield encoder.token(text)
                    continue
                last = encoder.chunk(text, out.finish_reason, out.stop_reason,
                                     gen.usage() if parsed.continuous_usage else None)
                if out.finish_reason is not None:
                    break
                yield last
            # The stream's end as one write: the last token's chunk, the usage chunk, [DONE]
            # and (`Last`) the chunked body's end (the same events and bytes; one socket
            # write, where it was two: the three events, then the end). At 200 streams
            # whose requests end in the same step, the API process wrote 200 x 3 chunks
            # before it read the closed loop's next 200 requests (docs/serve.md).
            usage = encoder.usage(len(parsed.prompt_ids), gen.output_len, gen.cached) \
                if parsed.include_usage else b""
            yield Last(last + usage + sse.DONE)
        except ApiError as err:  # as vLLM's stream generators: the error event, then [DONE]
            yield Last(sse.event(err.body()) + sse.DONE)
        finally:
            self.forget(gen, abort=True)

    def response(self, gen: RequestState, text: str, model: str, chat: bool) -> dict[str, Any]:
        choice = choice_body(0, text, gen.finish_reason, gen.stop_reason, chat)
        return response_body(gen.request_id, chat, int(time.time()), model, [choice],
                             gen.usage())


def _phases(out: RequestOutput) -> dict[str, float | None]:
    """vLLM's per-request phase times from the engine timestamps (None if not reached)."""
    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    return {"queue_s": diff(out.scheduled_s, out.queued_s),
            "prefill_s": diff(out.first_token_s, out.scheduled_s),
            "decode_s": diff(out.last_token_s, out.first_token_s),
            "inference_s": diff(out.last_token_s, out.scheduled_s)}
