"""Trace replay against any OpenAI-compatible server (`rt replay TRACE --endpoint URL`).

An asyncio + httpx streaming client, measuring as `vllm bench serve` does
(`vllm/benchmarks/lib/endpoint_request_func.py`). Each trace request is released at its
arrival time on the wall clock (the trace's times, already scaled by `--time-scale`) and sent
as `POST /v1/completions` with `stream: true`, `stream_options: {include_usage: true}`,
`max_tokens` = the trace's output length, `ignore_eos: true` (vLLM's extension, in the body)
and `prompt` = the trace's token ids (`workloads.prompt_token_ids(req, vocab_size, seed)`,
a list of ints, valid for OpenAI completions and vLLM), so prompt lengths and prefix sharing
are the trace's exactly. `vocab_size` must not exceed the served model's vocabulary (ids are
drawn from [10, vocab_size); default 32000, which fits Llama, Mistral and Qwen models).

The stream is split into lines at SSE's line ends only (`\r\n`, `\r`, `\n`), as vLLM's client
reads it (`_sse_lines`), not at Unicode line separators.

Timing boundaries. Every time is seconds on the client's `perf_counter`, from the start of
the replay; run.json says `"timing": "client"`. The records' columns mean:

    arrival_s       client: just before the POST is sent (after any --max-concurrency wait,
                    which vLLM also excludes from TTFT and E2EL)
    first_token_s   client: the first SSE chunk carrying `choices` was read (its text may be
                    empty, as vLLM counts it)
    token_times_s   client: one time per chunk carrying `choices`, NOT per token: a chunk may
                    carry several tokens, so ITL is the per-chunk gap (vLLM's ITL too)
    finish_s        client: the last chunk carrying `choices`; for a failed request, when the
                    failure was seen
    output_len      server: `usage.completion_tokens` of the final usage chunk (when the server
                    sends none: the number of chunks carrying choices)
    cached_tokens   server: `usage.prompt_tokens_details.cached_tokens` when sent, else 0
    replica         router: the response's `x-rt-replica` header (`rt route`: the index of
                    the backend that answered), a column only when some response had it,
                    null for a request whose response did not (so `analysis.fleet` reads a
                    real fleet run as it reads a simulated one)

Server-side boundaries are not observable from a client, so they are NaN (unknown), never 0:
`queued_s`, `engine_queued_s`, `first_scheduled_s` and the attribution parts (`api_server_s`
... `decode_s`), which therefore do not sum to E2E in these runs. `num_preemptions` is 0.
`steps.parquet` is empty (no engine steps are seen client-side).

Status: FINISHED_LENGTH_CAPPED (finish_reason "length") or FINISHED_STOPPED ("stop") for a
request that streamed at least one chunk carrying choices; FINISHED_ABORTED (finish_reason
"abort") for a failure: an HTTP error status, an `error` event in the stream, a transport
error, a timeout (`timeout_s`, the whole request), or a stream without any chunk carrying
choices. Failed requests keep the chunk times they got; their messages are in
`EndpointResult.errors` (run.json `errors`). Failures never stop the replay (as vLLM bench).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from backends.replay.endpoint_probe import (
    EndpointConfig,
    EndpointInfo,
    describe_error,
    redacted,
)
from backends.route.flags import REPLICA_HEADER
from runtime.records import PART_COLUMNS, RequestRecord
from workloads import Trace, TraceRequest, prompt_token_ids

Progress = Callable[[int, int], None]  # (requests done, requests in the trace)
NAN = float("nan")
# Server-side columns a client cannot observe (NaN: unknown).
UNKNOWN_COLUMNS = ("queued_s", "engine_queued_s", "first_scheduled_s", *PART_COLUMNS)
_STATUS = {"length": "FINISHED_LENGTH_CAPPED", "stop": "FINISHED_STOPPED"}


@dataclass(slots=True)
class RoutedRequestRecord(RequestRecord):
    """A request row of a replay through a router: which replica answered (None: unknown)."""

    replica: int | None = None

    def to_row(self) -> dict[str, object]:
        row = RequestRecord.to_row(self)
        row["replica"] = self.replica
        return row


@dataclass(slots=True)
class EndpointResult:
    """Records of one endpoint replay, with `ReplayResult`'s shape (no steps), the failures'
    messages by request id, and whether Ctrl-C cut it short (then in-flight requests are
    recorded as aborted, and requests not yet sent are left out)."""

    requests: list[RequestRecord]
    errors: dict[str, str]
    wall_s: float
    usage_missing: int = 0  # completed requests whose server sent no usage chunk
    interrupted: bool = False
    step_columns: dict[str, list[object]] = field(default_factory=dict)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_tokens_reported: int = 0  # requests whose usage had cached_tokens (vLLM: only
    # with --enable-prompt-tokens-details; else the prefix hit rate is unknown, not 0)

    @property
    def num_steps(self) -> int:
        return 0

    @property
    def num_failed(self) -> int:
        return sum(r.status == "FINISHED_ABORTED" for r in self.requests)


def request_body(req: TraceRequest, model: str, vocab_size: int, seed: int) -> dict[str, Any]:
    """The `/v1/completions` body of one trace request (token-id prompt, exact lengths)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_token_ids(req, vocab_size, seed),
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    return body


@dataclass(slots=True)
class _Stream:
    """What the client saw of one request (seconds from the replay start)."""

    sent_s: float
    chunk_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # None: usage had no prompt_tokens_details.cached_tokens
    replica: int | None = None  # the router's x-rt-replica header, when sent
    error: str | None = None
    failed_s: float | None = None


def replay_endpoint(trace: Trace, config: EndpointConfig, info: EndpointInfo,
                    progress: Progress | None = None) -> EndpointResult:
    """Replay `trace` against the endpoint `info` describes (see `probe`), in real time.

    Returns every sent request's record (in trace order). Ctrl-C ends it early with the
    records so far (`interrupted`)."""
    bodies = {req.request_id: request_body(req, info.model, config.vocab_size, config.seed)
              for req in trace}  # built before the clock starts
    return asyncio.run(_replay(trace, config, info.completions_url, bodies, progress))


async def _replay(trace: Trace, config: EndpointConfig, url: str,
                  bodies: dict[str, dict[str, Any]], progress: Progress | None
                  ) -> EndpointResult:
    streams: dict[str, _Stream] = {}
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.timeout_s)
    semaphore = asyncio.Semaphore(config.max_concurrency or len(trace) or 1)
    done = 0
    interrupted = False
    tasks: list[asyncio.Task[None]] = []

    def finished(_task: asyncio.Task[None]) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(trace))

    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=config.headers) as client:
        start = time.perf_counter()
        try:
            for req in sorted(trace, key=lambda r: r.arrival_s):
                await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
                task = asyncio.create_task(_send(client, url, bodies[req.request_id],
                                                 req.request_id, streams, semaphore, start,
                                                 config.timeout_s))
                task.add_done_callback(finished)
                tasks.append(task)
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels this task)
            interrupted = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - start
    routed = any(s.replica is not None for s in streams.values())
    records = [_record(req, streams[req.request_id], routed) for req in trace
               if req.request_id in streams]
    errors = {rid: s.error for rid, s in streams.items() if s.error is not None}
    missing = sum(s.completion_tokens is None and s.error is None for s in streams.values())
    reported = sum(s.cached_tokens is not None for s in streams.values())
    return EndpointResult(records, errors, wall, missing, interrupted,
                          cached_tokens_reported=reported)


async def _send(client: httpx.AsyncClient, url: str, body: dict[str, Any], request_id: str,
                streams: dict[str, _Stream], semaphore: asyncio.Semaphore, start: float,
                timeout_s: float) -> None:
    """Send one request under the concurrency semaphore and record what streams back;
    every failure is recorded in its `_Stream`, none is raised."""
    async with semaphore:
        stream = streams[request_id] = _Stream(time.perf_counter() - start)
        try:
            async with asyncio.timeout(timeout_s):
                await _stream(client, url, body, stream, start)
        except TimeoutError:
            stream.error = f"timed out after {timeout_s:g} s"
        except httpx.HTTPError as exc:
            stream.error = describe_error(exc)
        except asyncio.CancelledError:
            stream.error = "interrupted"
            raise
        finally:
            if stream.error is None and not stream.chunk_times:
                stream.error = "the stream carried no chunk with choices"
            if stream.error is not None:
                stream.failed_s = time.perf_counter() - start


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], stream: _Stream,
                  start: float) -> None:
    """POST `body` and read its SSE stream into `stream` (errors set `stream.error`)."""
    async with client.stream("POST", url, json=body) as response:
        stream.replica = _replica(response.headers.get(REPLICA_HEADER))
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            stream.error = f"HTTP {response.status_code}: {_error_message(text)}"
            return
        async for line in _sse_lines(response.aiter_bytes()):
            data = _sse_data(line)
            if data is None:
                continue
            if data == "[DONE]":  # read on to the end of the body, as vLLM's client does:
                continue  # leaving it unread makes httpx close the connection (+~1.5 ms TTFT)
            try:
                chunk = json.loads(data)
            except ValueError:
                stream.error = f"not JSON: {data[:120]!r}"
                return
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                stream.error = f"error event: {_error_message(json.dumps(chunk))}"
                return
            _take_chunk(chunk, stream, time.perf_counter() - start)


_LINE_END = re.compile(rb"\r\n|\r|\n")  # an SSE stream's line ends


async def _sse_lines(body: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The body's lines, split at the SSE line ends b"\\r\\n", b"\\r" and b"\\n" only, as
    vLLM's client reads them: httpx's `aiter_lines` also splits at U+0085, U+2028 and
    U+2029, which JSON leaves unescaped in a chunk's text (a byte-level tokenizer's output
    can hold them: 1 of 100 requests against vLLM serving the tiny Llama failed so), and
    then read the chunk's two halves as broken JSON. A read ending in b"\\r" waits for the
    next (it may be the first half of b"\\r\\n"); lines are decoded whole, so a character
    split across reads is read whole."""
    pending = b""
    async for part in body:
        data = pending + part
        held = data.endswith(b"\r")
        *lines, pending = _LINE_END.split(data[:-1] if held else data)
        if held:
            pending += b"\r"
        for line in lines:
            yield line.decode(errors="replace")
    if pending:
        yield pending.removesuffix(b"\r").decode(errors="replace")


def _sse_data(line: str) -> str | None:
    """The payload of a `data:` line (with or without the space), None for anything else
    (blank lines, `:` keep-alive comments, `event:`/`id:` fields)."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def _take_chunk(chunk: dict[str, Any], stream: _Stream, now_s: float) -> None:
    """One parsed chunk: a choices chunk adds a chunk time (and maybe the finish reason);
    a usage chunk gives the token counts."""
    choices = chunk.get("choices")
    if choices:
        stream.chunk_times.append(now_s)
        choice = choices[0] if isinstance(choices[0], dict) else {}
        if choice.get("finish_reason") is not None:
            stream.finish_reason = str(choice["finish_reason"])
            reason = choice.get("stop_reason")
            stream.stop_reason = None if reason is None else str(reason)
    usage = chunk.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        stream.completion_tokens = int(usage["completion_tokens"])
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            stream.cached_tokens = int(details["cached_tokens"])


def _replica(value: str | None) -> int | None:
    """The replica index of an `x-rt-replica` header (None: absent or not an index >= 0)."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


def _record(req: TraceRequest, s: _Stream, routed: bool) -> RequestRecord:
    """The record of one sent request (see the module docstring for the columns): a
    `RoutedRequestRecord` when `routed` (some response of the replay named its replica)."""
    output_len = s.completion_tokens if s.completion_tokens is not None else len(s.chunk_times)
    failed = s.error is not None
    if failed:
        status, finish_reason, stop_reason = "FINISHED_ABORTED", "abort", None
        finish = s.failed_s
    else:
        reason = s.finish_reason or ("length" if output_len >= req.output_len else "stop")
        status = _STATUS.get(reason, "FINISHED_STOPPED")
        finish_reason, stop_reason, finish = reason, s.stop_reason, s.chunk_times[-1]
    kind = RoutedRequestRecord if routed else RequestRecord
    record = kind(
        request_id=req.request_id, arrival_s=s.sent_s, prompt_len=req.prompt_len,
        max_tokens=req.output_len,
        first_token_s=s.chunk_times[0] if s.chunk_times else None, finish_s=finish,
        status=status, finish_reason=finish_reason, stop_reason=stop_reason,
        output_len=output_len, cached_tokens=s.cached_tokens or 0,
        token_times_s=list(s.chunk_times))
    if isinstance(record, RoutedRequestRecord):
        record.replica = s.replica
    for name in UNKNOWN_COLUMNS:
        setattr(record, name, NAN)
    return record


def _error_message(text: str) -> str:
    """The `message` of an OpenAI error body (`{"error": {"message": ...}}` or
    `{"message": ...}`, as vLLM), else the text; at most 200 characters."""
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        inner = obj.get("error", obj)
        if isinstance(inner, dict) and inner.get("message"):
            text = str(inner["message"])
        elif isinstance(inner, str):
            text = inner
        elif obj.get("detail"):
            text = str(obj["detail"])
    text = " ".join(text.split())
    return text[:200] + ("..." if len(text) > 200 else "")


def run_info(result: EndpointResult, config: EndpointConfig, info: EndpointInfo
             ) -> dict[str, Any]:
    """The endpoint part of run.json: where and what was sent, the timing boundaries, and the
    failures (the caller adds kind, name, trace and version)."""
    return {
        "timing": "client",
        "timing_boundaries": {
            "arrival_s": "client: just before the POST was sent",
            "first_token_s": "client: first SSE chunk carrying choices read",
            "token_times_s": "client: one time per chunk carrying choices (a chunk may "
                             "carry several tokens)",
            "finish_s": "client: last chunk carrying choices (failed: failure seen)",
            "output_len": "server: usage.completion_tokens",
            "unknown": "server-side times are NaN: queued_s, engine_queued_s, "
                       "first_scheduled_s and the attribution parts",
        },
        "endpoint": {"url": redacted(info.completions_url),
                     "max_concurrency": config.max_concurrency,
                     "timeout_s": config.timeout_s, "vocab_size": config.vocab_size,
                     "max_model_len": info.max_model_len,
                     "cache_config": dict(info.cache_config)},  # as its /metrics exported
        "model": {"name": info.model},
        "max_concurrency": config.max_concurrency,
        "seed": config.seed,
        "wall_s": round(result.wall_s, 3),
        "interrupted": result.interrupted,
        "failed": result.num_failed,
        "usage_missing": result.usage_missing,
        "cached_tokens_reported": result.cached_tokens_reported,
        "replica_attributed": sum(getattr(r, "replica", None) is not None
                              for r in result.requests),
        "errors": dict(result.errors),
    }

