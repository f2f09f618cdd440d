"""A capture client for load tests: during the run it only sends each request and keeps what
it reads, each read's bytes with its time; the HTTP response, the SSE events and the token
counts are parsed after the run ends (`rt bench serve --client capture`).

Why: at 200 streams the lean client (`sse_client`) spends ~11 us of CPU per streamed token
(1.4 CPU s per 1000 requests of 128 tokens) on the 2 CPUs it shares with the server it
measures, and does it at the moments the server is busiest (each step's 200 chunks, a
wave's requests). Here a read costs one reader callback: a `recvmsg_into`, two appends and one
`endswith` to see the chunked body's end (5.6-7.9 us per token, the system calls included;
docs/serve.md, "The load client's share at 200 streams").

Each read is stamped with the kernel's receive time of the newest packet it took (Linux
`SO_TIMESTAMPNS`): on the loopback, when the server's write reached this socket, however
late the client then got a CPU to read it. The parse afterwards gives the lean client's
view: an event is stamped with the read that completed its HTTP chunk (the lean client
stamps a chunk once it has read it whole) and goes through the lean client's `take_event`.
Times are `time.perf_counter()` seconds, as the lean client's.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import socket
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from backends.bench.sse_client import Streamed, take_event

_END = b"\r\n0\r\n\r\n"  # a chunk's CRLF, the last-chunk line and the empty trailer
# Linux's SO_TIMESTAMPNS (35 on every Linux ABI but a few old ones), not named by Python 3.11
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35) if sys.platform == "linux" else None
_STAMP = struct.Struct("qq")  # struct timespec: seconds, nanoseconds (CLOCK_REALTIME)
_ANCILLARY_BYTES = socket.CMSG_SPACE(_STAMP.size)
# One reused receive buffer per connection (`recvmsg_into`): each read is then kept as a
# bytes object of its own length (a 256 KiB recvmsg buffer, shrunk, kept a whole page and an
# mmap per read outside `rt bench serve`'s raised malloc threshold)
_READ_BYTES = 1 << 16


@dataclass(slots=True)
class Captured:
    """One request's raw view: its send time, each read's time and bytes (the same length),
    and an error found during the run (a refused connection, a timeout, a response the
    reader could not follow) or None.

    Memory: every read is kept until the run's parse, ~440 B per read at 200 streams (one
    read per streamed chunk: ~300 B of bytes object, a float and two list slots): 56 MB for
    1000 requests of 128 tokens, ~5.6 GB for 100,000. Size --num-prompts x output length
    to the machine's memory."""

    sent_s: float
    read_times_s: list[float] = field(default_factory=list)
    reads: list[bytes] = field(default_factory=list)
    error: str | None = None


class CaptureConnection:
    """One keep-alive connection on a non-blocking socket read by the event loop's reader
    callback. `send(request, sent_s)` writes a request and returns a future done when its
    response is whole (a chunked body's last chunk read, a Content-Length body read to its
    length) or the connection is lost; the reads stay in `captured`.

    Each read is stamped with the kernel's receive time of the newest packet it took (Linux
    SO_TIMESTAMPNS, CLOCK_REALTIME, moved to perf_counter's clock by `realtime_offset_s`,
    and never later than the read's own time: a wall-clock step after the offset was taken
    cannot put a stamp after its read); where the kernel gives no stamp, with the read's own
    time (`stamping_held`, around a run, has the kernel stamp from its first read). An
    exception while following the response (a bad Content-Length, a malformed stamp) is the
    request's error at once and the connection is dropped."""

    def __init__(self, sock: socket.socket, realtime_offset_s: float) -> None:
        self.sock = sock
        self.realtime_offset_s = realtime_offset_s  # time.time() - time.perf_counter()
        self.captured = Captured(0.0)
        self.done: asyncio.Future[None] | None = None
        self.chunked: bool | None = None  # None until the response's head is read
        self.body_left = 0  # bytes of a Content-Length body not read yet
        self.lost = False
        self.buffer = bytearray(_READ_BYTES)  # recvmsg_into's, reused by every read

    @classmethod
    async def open(cls, host: str, port: int, realtime_offset_s: float) -> CaptureConnection:
        """Connect, ask for receive stamps, start reading. OSError when it cannot connect."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if _SO_TIMESTAMPNS is not None:
                with contextlib.suppress(OSError):  # no stamps: the read's own time
                    sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            await loop.sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        conn = cls(sock, realtime_offset_s)
        loop.add_reader(sock.fileno(), conn._readable)
        return conn

    async def send(self, request: bytes, sent_s: float) -> asyncio.Future[None]:
        assert not self.lost
        loop = asyncio.get_running_loop()
        self.captured = Captured(sent_s)
        self.chunked = None
        self.done = loop.create_future()
        await loop.sock_sendall(self.sock, request)
        return self.done

    def close(self) -> None:
        if not self.lost:
            self._lose()
        self.sock.close()

    def _readable(self) -> None:
        try:
            size, ancillary, _, _ = self.sock.recvmsg_into([self.buffer], _ANCILLARY_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            size = 0
        if not size:
            self._lose()
            return
        try:
            self._take(bytes(memoryview(self.buffer)[:size]), _stamp(ancillary))
        except Exception as err:  # a response the reader cannot follow: that request's error
            self.captured.error = f"{type(err).__name__}: {err}"
            self._lose()

    def _take(self, data: bytes, stamp: tuple[int, int] | None) -> None:
        captured = self.captured
        now = time.perf_counter()
        captured.read_times_s.append(now if stamp is None else  # never after the read
                                     min(stamp[0] + stamp[1] * 1e-9 - self.realtime_offset_s,
                                         now))
        captured.reads.append(data)
        if self.done is None or self.done.done():
            return  # bytes nobody asked for: kept, the parse reports them
        if self.chunked is None:
            self._read_head()
        elif self.chunked:
            if data.endswith(_END) or (len(data) < len(_END) and self._joined_tail()):
                self.done.set_result(None)
        else:
            self.body_left -= len(data)
            if self.body_left <= 0:
                self.done.set_result(None)

    def _joined_tail(self) -> bool:
        return b"".join(self.captured.reads[-len(_END):]).endswith(_END)

    def _read_head(self) -> None:
        """Once the head is in: the body's framing, and whether it is already whole."""
        data = b"".join(self.captured.reads)
        head_end = data.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = data[:head_end].lower()
        assert self.done is not None
        self.chunked = b"\r\ntransfer-encoding: chunked" in head
        if self.chunked:
            if data.endswith(_END):
                self.done.set_result(None)
            return
        self.body_left = _content_length(head) - (len(data) - head_end - 4)
        if self.body_left <= 0:
            self.done.set_result(None)

    def _lose(self) -> None:
        self.lost = True
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        if self.done is not None and not self.done.done():
            self.done.set_result(None)  # cut short: the parse finds the response incomplete


def _stamp(ancillary: list[tuple[int, int, bytes]]) -> tuple[int, int] | None:
    """The receive stamp (seconds, nanoseconds) among a read's ancillary data; None when
    there is none. ValueError for an SO_TIMESTAMPNS item not a struct timespec long."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
            if len(data) != _STAMP.size:
                raise ValueError(f"a receive stamp of {len(data)} bytes, not {_STAMP.size}")
            seconds, nanoseconds = _STAMP.unpack(data)
            return seconds, nanoseconds
    return None


@contextlib.contextmanager
def stamping_held(wait_s: float = 0.5) -> Iterator[bool]:
    """Hold one loopback connection that asks for receive stamps, once the kernel stamps its
    reads (waiting at most `wait_s` seconds); yields whether it does (False off Linux).

    Linux turns SO_TIMESTAMPNS on system-wide from deferred work after the first socket asks
    for it (net_enable_timestamp), and off when the last one closes; until then a read has
    no stamp, and its own time stands in. Held around a run, the run's first reads are
    stamped too (without it, 150 of 300 fresh sockets' first reads were not, here)."""
    if _SO_TIMESTAMPNS is None:
        yield False
        return
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as reader:
        reader.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        writer, _ = listener.accept()
        with writer:
            deadline = time.monotonic() + wait_s
            while True:
                writer.sendall(b"x")
                _, ancillary, _, _ = reader.recvmsg(1, _ANCILLARY_BYTES)
                stamped = _stamp(ancillary) is not None
                if stamped or time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            yield stamped


def realtime_offset_s(samples: int = 16) -> float:
    """CLOCK_REALTIME minus perf_counter's clock (CLOCK_MONOTONIC on Linux), seconds: the
    kernel's receive stamps are on the first; the run's times on the second. Of `samples`
    readings of the wall clock between two of perf_counter, the most tightly bracketed one
    (a reading the process was preempted in moves the offset by the preemption: ~1 ms was
    seen on this 2-core machine under load, which put stamps after their reads)."""
    readings = []
    for _ in range(samples):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        readings.append((after - before, wall - (before + after) / 2))
    return min(readings)[1]


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip() == b"content-length":
            return int(value)
    return 0


def parse(captured: Captured) -> Streamed:
    """The lean client's view of one captured request: event times, finish reason, usage,
    error (an HTTP status, an error event, a response cut short or unparsable)."""
    out = Streamed(captured.sent_s, error=captured.error)
    out.done_s = captured.read_times_s[-1] if captured.read_times_s else captured.sent_s
    if out.error is None:
        try:
            _parse_response(captured, out)
        except (ValueError, IndexError) as err:
            out.error = f"{type(err).__name__}: {err}"
    return out


def _parse_response(captured: Captured, out: Streamed) -> None:
    data = b"".join(captured.reads)
    ends = _read_ends(captured.reads)  # ends[i]: offset just past read i's last byte
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        raise ValueError(f"no complete response head in {len(data)} bytes")
    head = data[:head_end]
    status = int(head.split(b" ", 2)[1])
    if b"\r\ntransfer-encoding: chunked" not in head.lower():
        body = data[head_end + 4:head_end + 4 + _content_length(head.lower())]
        out.error = f"HTTP {status}: {body[:200].decode(errors='replace')}"
        return
    pos, pending = head_end + 4, b""
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            raise ValueError(f"the chunked body ends without its last chunk at byte {pos}")
        size = int(data[pos:line_end].strip(), 16)
        start, stop = line_end + 2, line_end + 2 + size + 2  # the data and its CRLF
        if size == 0:
            break
        if stop > len(data):
            raise ValueError(f"a chunk of {size} bytes cut short at byte {len(data)}")
        now = captured.read_times_s[bisect.bisect_left(ends, stop)]
        *events, pending = (pending + data[start:stop - 2]).split(b"\n\n")
        for event in events:
            take_event(event, out, now)
        pos = stop
    if status != 200 and out.error is None:
        out.error = f"HTTP {status}"


def _read_ends(reads: list[bytes]) -> list[int]:
    ends, total = [], 0
    for piece in reads:
        total += len(piece)
        ends.append(total)
    return ends
