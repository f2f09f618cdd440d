"""`rt bench serve --client capture`: reads kept during the run, parsed after it into the lean
client's view (the same events, token counts and errors; each event stamped with the read
that completed its HTTP chunk), on the loopback and bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.bench.capture_client import (
    _ANCILLARY_BYTES,
    CaptureConnection,
    Captured,
    _stamp,
    parse,
    realtime_offset_s,
    stamping_held,
)
from backends.bench.lean_replay import _capture, _Target, capture_run
from backends.bench.sse_client import Connection, Streamed
from tests.backends.loop_server import LoopbackServer, read_request
from workloads import Trace, TraceRequest

ROOT = Path(__file__).resolve().parents[3]


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _token(text: str, finish: str | None = None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return (b'data: {"id":"c","choices":[{"index":0,"text":"%s","finish_reason":%s}]}\n\n'
            % (text.encode(), reason.encode()))


_USAGE = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3,'
          b'"prompt_tokens_details":{"cached_tokens":2}}}\n\n')
_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
         b"transfer-encoding: chunked\r\n\r\n")
# Three token events in two HTTP chunks (the second carries two events), then the end in one.
_STREAM = (_HEAD + _chunk(_token("a")) + _chunk(_token("b") + _token("c", "length"))
           + _chunk(_USAGE + b"data: [DONE]\n\n") + b"0\r\n\r\n")


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _lean_view(data: bytes) -> Streamed:
    """The lean client's reading of `data` (its times are its own clock's, not compared)."""
    async def read() -> Streamed:
        conn, out = Connection("127.0.0.1", 1), Streamed(0.0)
        conn.reader = asyncio.StreamReader()
        conn.reader.feed_data(data)
        conn.reader.feed_eof()
        with contextlib.suppress(asyncio.IncompleteReadError, ValueError):
            await conn._read_response(out)
        return out

    return asyncio.run(read())


def test_each_event_gets_the_time_of_the_read_that_completed_its_chunk() -> None:
    first, second = len(_HEAD) + len(_chunk(_token("a"))), len(_STREAM) - 5
    # Cut inside the head, right after the first chunk's data (before its CRLF), inside the
    # second chunk's size line and inside the last-chunk line.
    reads = _split(_STREAM, [20, first - 2, first + 1, second + 2])
    out = parse(Captured(0.5, [1.0, 2.0, 3.0, 4.0, 5.0], reads))
    assert out.event_times_s == [3.0, 4.0, 4.0]  # chunk 1 whole at read 3, chunk 2 at read 4
    assert (out.finish_reason, out.completion_tokens, out.cached_tokens) == ("length", 3, 2)
    assert (out.error, out.sent_s, out.done_s) == (None, 0.5, 5.0)
    lean = _lean_view(_STREAM)
    assert (lean.finish_reason, lean.completion_tokens, lean.cached_tokens, lean.error,
            len(lean.event_times_s)) == ("length", 3, 2, None, 3)


@pytest.mark.parametrize(("data", "error"), [
    (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 15\r\n"
     b"\r\n" + b'{"error":"bad"}', 'HTTP 400: {"error":"bad"}'),
    (_STREAM[:-30], "ValueError: a chunk of 139 bytes cut short at byte 438"),
    (_STREAM[:-5], "ValueError: the chunked body ends without its last chunk at byte 463"),
    (b"HTTP/1.1 200 OK\r\ncontent-", "ValueError: no complete response head in 25 bytes"),
    (_HEAD + _chunk(b'data: {"error":{"message":"engine died"}}\n\n') + b"0\r\n\r\n",
     'error event: {"error":{"message":"engine died"}}'),
])
def test_errors_are_one_message_as_the_lean_client_reads_them(data: bytes, error: str) -> None:
    out = parse(Captured(0.0, [1.0], [data]))
    assert out.error == error
    if not error.startswith("ValueError"):
        assert _lean_view(data).error == error
    assert parse(Captured(0.0, error="timed out")).error == "timed out"


def _fed(pieces: list[bytes]) -> list[bool]:
    """Whether the response is whole after each of `pieces`, fed as reads."""
    async def feed() -> list[bool]:
        mine, other = socket.socketpair()
        conn = CaptureConnection(mine, 0.0)
        conn.done = asyncio.get_running_loop().create_future()
        whole = []
        for piece in pieces:
            conn._take(piece, None)
            whole.append(conn.done.done())
        mine.close()
        other.close()
        return whole

    return asyncio.run(feed())


def test_the_end_of_a_response_is_seen_however_the_reads_split_it() -> None:
    end = len(_STREAM) - 7
    assert _fed(_split(_STREAM, [10, end, *range(end + 1, len(_STREAM))])) == [False] * 8 + [True]
    assert _fed([_STREAM]) == [True]
    error = b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nnot found"
    assert _fed(_split(error, [5, 30, 45])) == [False, False, False, True]
    assert _fed([error]) == [True]


_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


class _OneRead:
    """A socket stand-in whose next `recvmsg_into` gives `data` and `ancillary` (its file
    descriptor is a real socket's, for the loop's reader bookkeeping)."""

    def __init__(self, data: bytes, ancillary: list[tuple[int, int, bytes]]) -> None:
        self.data, self.ancillary = data, ancillary
        self.real = socket.socket()

    def recvmsg_into(self, buffers: list[bytearray], ancbufsize: int
                     ) -> tuple[int, list[tuple[int, int, bytes]], int, None]:
        buffers[0][:len(self.data)] = self.data
        return len(self.data), self.ancillary, 0, None

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()


def _one_read(data: bytes, ancillary: list[tuple[int, int, bytes]]) -> CaptureConnection:
    """A connection after one reader callback that read `data` with `ancillary`."""
    async def read() -> CaptureConnection:
        sock = _OneRead(data, ancillary)
        conn = CaptureConnection(sock, 0.0)  # type: ignore[arg-type]
        conn.done = asyncio.get_running_loop().create_future()
        conn._readable()
        sock.close()
        return conn

    return asyncio.run(read())


def test_a_response_the_reader_cannot_follow_is_the_requests_error_at_once() -> None:
    """A bad Content-Length, a receive stamp of the wrong size: the request is done, with
    the error, the connection dropped (not a traceback, then a hang until --timeout)."""
    bad_length = _one_read(b"HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\n", [])
    assert bad_length.done is not None and bad_length.done.done() and bad_length.lost
    assert bad_length.captured.error == \
        "ValueError: invalid literal for int() with base 10: b' abc'"
    short_stamp = _one_read(_STREAM, [(socket.SOL_SOCKET, _SO_TIMESTAMPNS, b"\0" * 8)])
    assert short_stamp.done is not None and short_stamp.done.done() and short_stamp.lost
    assert short_stamp.captured.error == "ValueError: a receive stamp of 8 bytes, not 16"
    whole = _one_read(_STREAM, [(socket.SOL_SOCKET, _SO_TIMESTAMPNS, struct.pack("qq", 0, 0))])
    assert (whole.captured.error, whole.lost, whole.captured.reads) == (None, False, [_STREAM])


def test_the_receive_stamp_is_read_by_its_type_and_length() -> None:
    stamp = struct.pack("qq", 5, 250_000_000)
    assert _stamp([(socket.SOL_SOCKET, _SO_TIMESTAMPNS, stamp)]) == (5, 250_000_000)
    assert _stamp([(socket.SOL_SOCKET, _SO_TIMESTAMPNS + 1, b"x"),
                   (socket.SOL_SOCKET, _SO_TIMESTAMPNS, stamp)]) == (5, 250_000_000)
    assert _stamp([(socket.IPPROTO_IP, _SO_TIMESTAMPNS, b"x")]) is None
    assert _stamp([]) is None


def _stamped_read(offset_shift_s: float) -> tuple[float, float, float, float]:
    """(write time, the read's stamp, perf_counter before and after the reader callback) of
    one loopback write read 1 ms later, the clocks' offset moved by `offset_shift_s`."""
    async def read() -> tuple[float, float, float, float]:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            conn = await CaptureConnection.open("127.0.0.1", listener.getsockname()[1],
                                                realtime_offset_s() + offset_shift_s)
            peer, _ = listener.accept()
            asyncio.get_running_loop().remove_reader(conn.sock.fileno())  # read by hand
            conn.done = asyncio.get_running_loop().create_future()
            with peer:
                written = time.perf_counter()
                peer.sendall(_HEAD)
                time.sleep(0.001)  # the bytes wait in the socket: stamp and read apart
                before = time.perf_counter()
                conn._readable()
                after = time.perf_counter()
            conn.sock.close()
            return written, conn.captured.read_times_s[-1], before, after

    return asyncio.run(read())


@pytest.mark.skipif(sys.platform != "linux", reason="SO_TIMESTAMPNS is Linux's")
def test_a_read_is_stamped_with_the_kernels_receive_time() -> None:
    """The stamp is when the write reached the socket, before the client's read began (the
    read's own time would be after it); a stamp the clocks' offset puts after the read (a
    wall-clock step) is the read's time."""
    with stamping_held(2.0) as stamped:  # else a fresh socket's read may carry no stamp
        if not stamped:
            pytest.skip("the kernel gives no receive stamps on the loopback here")
        written, stamp, before, _ = _stamped_read(0.0)
        # the read came >= 1 ms after the write: a stamp before it is the kernel's, not the
        # read's. Below, the clocks' offset is good to tens of us under load (a full suite
        # run at load ~5 put the stamp 31 us before the write), so the write bounds it
        # that loosely.
        assert written - 2e-4 <= stamp < before
        _, late, before, after = _stamped_read(-100.0)  # the stamp would be 100 s ahead
        assert before <= late <= after


class _ScriptedServer(LoopbackServer):
    """An HTTP/1.1 keep-alive server on the loopback answering each POST with `_STREAM`, one
    write per HTTP chunk `gap_s` apart, noting `perf_counter()` before each write (the same
    clock as the client's), or never answering (`answer=False`)."""

    def __init__(self, gap_s: float = 0.005, answer: bool = True) -> None:
        super().__init__()
        self.gap_s, self.answer = gap_s, answer
        self.closed = 0  # connections whose client closed them
        self.writes_s: list[list[float]] = []  # per response

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._accepted(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                body = json.loads(await read_request(reader))
                assert body["stream"] is True and body["max_tokens"] == 3
                if not self.answer:
                    continue
                times: list[float] = []
                self.writes_s.append(times)
                pieces = [_HEAD + _chunk(_token("a")), _chunk(_token("b") + _token("c", "length")),
                          _chunk(_USAGE + b"data: [DONE]\n\n") + b"0\r\n\r\n"]
                for piece in pieces:
                    await asyncio.sleep(self.gap_s)
                    times.append(time.perf_counter())
                    writer.write(piece)
                    await writer.drain()
        self.closed += 1


def _trace(n: int) -> Trace:
    return Trace(tuple(TraceRequest(f"r{i}", arrival_s=0.0, prompt_len=4, output_len=3)
                       for i in range(n)), name="capture")


@pytest.fixture
def scripted() -> Iterator[_ScriptedServer]:
    with _ScriptedServer() as running:
        yield running


def test_a_loopback_run_keeps_exact_counts_and_stamps_after_each_write(
        scripted: _ScriptedServer) -> None:
    """5 requests on 2 keep-alive connections: 3 events and 3 tokens each; every event's
    time is after the server began the write that carried it (kernel receive stamps moved
    to perf_counter's clock) and before the client's run ended."""
    run = capture_run(_trace(5), "127.0.0.1", scripted.port, "m", 2, 100, 0, 10.0)
    result = run.result()
    assert scripted.connections == 2 and result.errors == {}
    assert [(r.output_len, len(r.token_times_s), r.status, r.cached_tokens)
            for r in result.requests] == [(3, 3, "FINISHED_LENGTH_CAPPED", 2)] * 5
    end = run.start_s + run.wall_s
    responses = sorted(scripted.writes_s)
    for record, writes in zip(sorted(result.requests, key=lambda r: r.first_token_s or 0),
                              responses, strict=True):
        times = [run.start_s + t for t in record.token_times_s]
        assert writes[0] <= times[0] and writes[1] <= times[1] == times[2] <= end
        assert run.start_s + record.arrival_s <= writes[0]
    deadline = time.monotonic() + 10
    while scripted.closed < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scripted.closed == 2  # the client closed both connections when it was done


def test_a_request_never_answered_times_out_and_the_run_ends() -> None:
    with _ScriptedServer(answer=False) as silent:
        result = capture_run(_trace(2), "127.0.0.1", silent.port, "m", 2, 100, 0, 0.3).result()
    assert result.errors == {"r0": "timed out", "r1": "timed out"}
    assert [r.status for r in result.requests] == ["FINISHED_ABORTED"] * 2
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # bound, not listening: refused
        refused = capture_run(_trace(1), "127.0.0.1", port, "m", 1, 100, 0, 5.0).result()
    assert refused.errors["r0"].startswith("ConnectionRefusedError: ")


def test_a_cancelled_run_closes_its_connections() -> None:
    """Ctrl-C (the run's task cancelled) with 2 requests in flight: both connections are
    closed before the event loop ends (the loop's reader would keep them open)."""
    async def cancel(silent: _ScriptedServer) -> int:
        trace = _trace(2)
        run = asyncio.create_task(_capture(trace, _Target("127.0.0.1", silent.port, 30.0),
                                           {req.request_id: b"x" for req in trace}, 2))
        deadline = time.monotonic() + 10
        while silent.connections < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        while silent.closed < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return silent.closed

    with _ScriptedServer(answer=False) as silent:
        assert asyncio.run(cancel(silent)) == 2


def test_rt_bench_serve_with_the_capture_client(tmp_path: Path) -> None:
    """The CI size: every stream's token count, no error, the server stopped (exit 0)."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "serve", "--client", "capture",
         "--concurrency", "16", "--num-prompts", "32", "--random-input-len", "32",
         "--random-output-len", "16", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["errors"], report["sent"], report["token_count_mismatches"]) == (0, 32, 0)
    assert report["server_exit_code"] == 0 and "client_parse" in report["cpu_s"]
    assert report["server_path"]["output_tokens"] == 32 * 16
    assert report["server_counters"]["vllm:generation_tokens_total"] == 32 * 16


def test_stamping_held_has_the_kernel_stamp_a_fresh_sockets_first_read() -> None:
    """Linux enables receive stamps from deferred work after a socket first asks: without a
    stamping socket held, a fresh socket's first read went unstamped 150 times in 300 here."""
    if sys.platform != "linux":
        with stamping_held() as stamped:
            assert not stamped
        return
    with stamping_held(2.0) as stamped:
        assert stamped
        for _ in range(20):
            with socket.create_server(("127.0.0.1", 0)) as listener, \
                    socket.create_connection(listener.getsockname()) as client:
                client.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
                peer, _ = listener.accept()
                with peer:
                    peer.sendall(b"x")
                    _, ancillary, _, _ = client.recvmsg(1, _ANCILLARY_BYTES)
            assert _stamp(ancillary) is not None
