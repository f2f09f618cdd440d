"""A lean streaming client for load tests: HTTP/1.1 on asyncio streams, no HTTP library.

Why: at 200 streams on a 2-core machine the httpx client of `rt replay --endpoint` needs
more CPU than the server it measures, reads several SSE events per wake-up and stamps them
together, so its ITL reads near 0 (docs/serve.md, "Under load"). This client does the least
per event: it reads the chunked body as it arrives, stamps each read once, splits it into
`data:` events and parses JSON only for the events that need it (a finish reason, the usage
chunk, an error). Each connection is kept alive and reused, as vLLM's aiohttp client does.

`stream_completion` returns the client's view of one request (perf_counter seconds); every
failure is a message in `Streamed.error`, never an exception, except cancellation.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def run_client(main: Coroutine[Any, Any, T]) -> T:
    """Run the load client's `main` on uvloop's event loop when it imports (the serve extra
    installs it for the server), else on asyncio's. The client shares the 2 CPUs with the
    server it measures: at 200 streams it needed 1.54-1.82 CPU s per 1000 requests on
    asyncio's loop, 1.43 and 1.62 in two runs on uvloop, not shown to differ
    (docs/serve.md, "Added TTFT at 200 streams, stage by stage")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


@dataclass(slots=True)
class Streamed:
    """One request as the client saw it. `event_times_s`: one per event carrying choices."""

    sent_s: float
    event_times_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0
    error: str | None = None
    done_s: float | None = None


def request_head(host: str, port: int, headers: dict[str, str] | None) -> str:
    """The header lines every request to `host:port` carries (each ending in CRLF)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return f"Host: {host}:{port}\r\nContent-Type: application/json\r\n{extra}"


def post_bytes(head: str, path: str, data: bytes) -> bytes:
    """An HTTP/1.1 POST of the JSON `data` with the header lines `head`, as sent."""
    return (f"POST {path} HTTP/1.1\r\n{head}Content-Length: {len(data)}\r\n\r\n".encode()
            + data)


class Connection:
    """One keep-alive HTTP/1.1 connection to `host:port` (reopened when the server closes)."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None) -> None:
        self.host, self.port = host, port
        self.head = request_head(host, port, headers)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def post_stream(self, path: str, body: dict[str, Any]) -> Streamed:
        """POST `body` and read its SSE stream to `data: [DONE]`."""
        out = Streamed(time.perf_counter())
        data = json.dumps(body, separators=(",", ":")).encode()
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.write(post_bytes(self.head, path, data))
            await self._read_response(out)
        except (OSError, asyncio.IncompleteReadError, ValueError) as err:
            out.error = out.error or f"{type(err).__name__}: {err}"
        if out.error is not None:
            await self.close()  # the connection's state is unknown
        out.done_s = time.perf_counter()
        return out

    async def _read_response(self, out: Streamed) -> None:
        reader = self.reader
        assert reader is not None
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") != "chunked":
            text = await reader.readexactly(int(headers.get("content-length", "0")))
            out.error = f"HTTP {status}: {text[:200].decode(errors='replace')}"
            return
        pending = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            now = time.perf_counter()
            *events, pending = (pending + chunk[:-2]).split(b"\n\n")
            for event in events:
                take_event(event, out, now)
        if status != 200 and out.error is None:
            out.error = f"HTTP {status}"


def take_event(event: bytes, out: Streamed, now: float) -> None:
    """Take one SSE event (`data: ...` without its blank line) read at `now` into `out`."""
    if not event.startswith(b"data: {"):
        return
    if b'"error"' in event[:20]:
        out.error = "error event: " + event[6:206].decode(errors="replace")
        return
    if b'"choices":[]' in event:  # the usage chunk
        usage = json.loads(event[6:])["usage"]
        out.completion_tokens = usage["completion_tokens"]
        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return
    out.event_times_s.append(now)
    if b'"finish_reason":null' not in event:
        choice = json.loads(event[6:])["choices"][0]
        out.finish_reason = choice.get("finish_reason")
