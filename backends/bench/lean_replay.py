"""A trace replayed with the lean client (`sse_client`) or the capture client
(`capture_client`), into the records `rt replay --endpoint` writes (same bodies, same
columns, client-side times from the replay start): `rt bench serve --client lean|capture`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

from backends.bench.capture_client import (
    CaptureConnection,
    Captured,
    parse,
    realtime_offset_s,
    stamping_held,
)
from backends.bench.sse_client import Connection, Streamed, post_bytes, request_head, run_client
from backends.replay.endpoint import EndpointResult, request_body
from runtime.records import RequestRecord
from workloads import Trace, TraceRequest

_STATUS = {"length": "FINISHED_LENGTH_CAPPED", "stop": "FINISHED_STOPPED"}


def replay_lean(trace: Trace, host: str, port: int, model: str, concurrency: int,
                vocab_size: int, seed: int, timeout_s: float,
                headers: dict[str, str] | None = None) -> EndpointResult:
    """Release each request at its arrival time on at most `concurrency` keep-alive
    connections (a request waits for a free one, as under vLLM's --max-concurrency)."""
    bodies = {req.request_id: request_body(req, model, vocab_size, seed) for req in trace}
    return run_client(_replay(trace, host, port, bodies, concurrency, timeout_s, headers))


async def _replay(trace: Trace, host: str, port: int, bodies: dict[str, dict[str, object]],
                  concurrency: int, timeout_s: float, headers: dict[str, str] | None
                  ) -> EndpointResult:
    idle: asyncio.Queue[Connection] = asyncio.Queue()
    for _ in range(concurrency):
        idle.put_nowait(Connection(host, port, headers))
    seen: dict[str, Streamed] = {}

    async def send(req: TraceRequest) -> None:
        conn = await idle.get()
        try:
            async with asyncio.timeout(timeout_s):
                seen[req.request_id] = await conn.post_stream("/v1/completions",
                                                              bodies[req.request_id])
        except TimeoutError:
            seen[req.request_id] = Streamed(time.perf_counter(), error="timed out")
            await conn.close()
        finally:
            idle.put_nowait(conn)

    start = time.perf_counter()
    tasks = []
    for req in sorted(trace, key=lambda r: r.arrival_s):
        await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
        tasks.append(asyncio.create_task(send(req)))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    while not idle.empty():
        await idle.get_nowait().close()
    return _result(trace, seen, start, wall)


@dataclass(slots=True)
class CaptureRun:
    """What the capture client kept of a run (perf_counter seconds); `result()` parses it."""

    trace: Trace
    captured: dict[str, Captured]
    start_s: float
    wall_s: float

    def result(self) -> EndpointResult:
        """The records, as `replay_lean` returns them, parsed from the captured reads."""
        seen = {rid: parse(c) for rid, c in self.captured.items()}
        return _result(self.trace, seen, self.start_s, self.wall_s)


def _result(trace: Trace, seen: dict[str, Streamed], start: float, wall: float
            ) -> EndpointResult:
    records = [_record(req, seen[req.request_id], start) for req in trace]
    errors = {rid: s.error for rid, s in seen.items() if s.error is not None}
    return EndpointResult(records, errors, wall)


def capture_run(trace: Trace, host: str, port: int, model: str, concurrency: int,
                vocab_size: int, seed: int, timeout_s: float,
                headers: dict[str, str] | None = None) -> CaptureRun:
    """`replay_lean`'s load with the capture client: each request's bytes are built before
    the run, and during it `concurrency` connections each send the next request in arrival
    order (at its arrival time at the earliest) and keep its reads until its response is
    whole; nothing is parsed until `CaptureRun.result()`. Call it inside
    `backends.heap.frozen_heap()` (`rt bench serve` does, around its CPU readings too): in
    its process (the simulator loaded) a full collection 5 ms into a run stalled the client
    150 ms between two sends of the first 200. Memory: see `Captured`."""
    head = request_head(host, port, headers)
    requests = {req.request_id: post_bytes(head, "/v1/completions", json.dumps(
        request_body(req, model, vocab_size, seed), separators=(",", ":")).encode())
        for req in trace}
    with stamping_held():  # the run's first reads stamped by the kernel too
        captured, start, wall = run_client(_capture(trace, _Target(host, port, timeout_s),
                                                    requests, concurrency))
    return CaptureRun(trace, captured, start, wall)


@dataclass(frozen=True, slots=True)
class _Target:
    """The server the capture workers connect to, and the bound on one request (s)."""

    host: str
    port: int
    timeout_s: float


async def _capture(trace: Trace, target: _Target, requests: dict[str, bytes],
                   concurrency: int) -> tuple[dict[str, Captured], float, float]:
    order = iter(sorted(trace, key=lambda r: r.arrival_s))
    captured: dict[str, Captured] = {}
    start, offset = time.perf_counter(), realtime_offset_s()
    workers = [_capture_worker(order, target, offset, requests, captured, start)
               for _ in range(min(concurrency, len(trace)))]
    await asyncio.gather(*workers)
    return captured, start, time.perf_counter() - start


async def _capture_worker(order: Iterator[TraceRequest], target: _Target, offset_s: float,
                          requests: dict[str, bytes], captured: dict[str, Captured],
                          start: float) -> None:
    """One connection to `target`: the next request of `order` (shared by the workers)
    until none is left; a timeout or a socket error is that request's error, and a fresh
    connection. `offset_s`: `realtime_offset_s()` at the start. The connection is closed
    however the worker ends (Ctrl-C, an unexpected exception included)."""
    conn: CaptureConnection | None = None
    try:
        for req in order:
            if (delay := start + req.arrival_s - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter()
            try:
                async with asyncio.timeout(target.timeout_s):
                    if conn is None or conn.lost:
                        _closed(conn)
                        conn = await CaptureConnection.open(target.host, target.port,
                                                            offset_s)
                    await (await conn.send(requests[req.request_id], sent))
                captured[req.request_id] = conn.captured
            except (TimeoutError, OSError) as err:
                message = "timed out" if isinstance(err, TimeoutError) else \
                    f"{type(err).__name__}: {err}"
                captured[req.request_id] = Captured(sent, error=message)
                _closed(conn)
                conn = None
    finally:
        _closed(conn)


def _closed(conn: CaptureConnection | None) -> None:
    if conn is not None:
        conn.close()


def _record(req: TraceRequest, s: Streamed, start: float) -> RequestRecord:
    times = [t - start for t in s.event_times_s]
    failed = s.error is not None or not times
    reason = "abort" if failed else (s.finish_reason or "length")
    return RequestRecord(
        request_id=req.request_id, arrival_s=s.sent_s - start, prompt_len=req.prompt_len,
        max_tokens=req.output_len, first_token_s=times[0] if times else None,
        finish_s=(s.done_s or s.sent_s) - start if failed else times[-1],
        status="FINISHED_ABORTED" if failed else _STATUS.get(reason, "FINISHED_STOPPED"),
        finish_reason=reason,
        output_len=s.completion_tokens if s.completion_tokens is not None else len(times),
        cached_tokens=s.cached_tokens, token_times_s=times)
