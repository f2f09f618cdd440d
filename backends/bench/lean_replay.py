"""A trace replayed with the lean client (`sse_client`), into the records `rt replay
--endpoint` writes (same bodies, same columns, client-side times from the replay start):
`rt bench serve --client lean`."""

from __future__ import annotations

import asyncio
import time

from backends.bench.sse_client import Connection, Streamed, run_client
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
    records = [_record(req, seen[req.request_id], start) for req in trace]
    errors = {rid: s.error for rid, s in seen.items() if s.error is not None}
    return EndpointResult(records, errors, wall)


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
