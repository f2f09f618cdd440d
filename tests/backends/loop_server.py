"""An HTTP/1.1 keep-alive test server on the loopback, its event loop in a thread of its
own: a subclass answers requests in `_handle`; `with` starts it (port 0: any free port)
and stops it, closing every connection it kept, so that no task or thread is left."""

from __future__ import annotations

import asyncio
import threading
from typing import Self


class LoopbackServer:
    def __init__(self) -> None:
        self.connections = 0  # TCP connections accepted
        self.port = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def _accepted(self, writer: asyncio.StreamWriter) -> None:
        """Count a connection and keep its writer (closed at the end)."""
        self.connections += 1
        self._writers.append(writer)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _close(self) -> None:
        self._server.close()
        for writer in self._writers:  # kept-alive connections: their handlers then end
            writer.close()
        await asyncio.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """The body of the next request on a keep-alive connection (its content-length's
    bytes; none without one)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return await reader.readexactly(length)
