"""`rt route` under faults, one test each (issue #18's, as `tests/backends/serve/test_faults.py`
for `rt serve`): a client that never reads its stream, a backend SIGKILLed mid-stream (and
one whose connection breaks after its `[DONE]`), the drain cut at shutdown, and a short
soak. The router and `rt serve --simulate` backends are
subprocesses on 127.0.0.1 (`procs.Rt`); every wait is bounded and every process stopped."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.bench.soak import process_stats
from tests.backends.route.procs import ROOT, SIMULATED, Rt
from tests.backends.serve.test_faults import (
    BODY,
    _itl_ms,
    _wait_for,
    assert_cut_answered,
    stream_and_whole,
)

STREAM_BYTES = 256 * 1024 * 1024  # what the fast stub offers one stream
PIECE = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"  # one SSE event of 64 KiB


def route(*backends: str, args: tuple[str, ...] = ()) -> Rt:
    urls = [a for url in backends for a in ("--backend", url)]
    return Rt(["route", *urls, *args], timeout_s=30)


def stalled_reader(url: str, max_tokens: int = 3000) -> socket.socket:
    """A raw client that asks for a long stream and never reads a byte of it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps({**BODY, "max_tokens": max_tokens}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


class _Firehose(http.server.BaseHTTPRequestHandler):
    """An OpenAI-looking backend whose one stream is STREAM_BYTES of SSE, written as fast as
    its socket takes them; `server.sent` counts the bytes the kernel accepted and
    `server.broken` is set when the router closes the connection."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        body = b'{"object":"list","data":[{"id":"m"}]}' if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def start_stream(self) -> None:
        """Read the request; answer 200 with a chunked SSE body to come."""
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        self.start_stream()
        framed = b"%x\r\n%s\r\n" % (len(PIECE), PIECE)
        try:
            for _ in range(STREAM_BYTES // len(PIECE)):
                self.wfile.write(framed)
                self.server.sent += len(framed)  # type: ignore[attr-defined]
        except OSError:
            self.server.broken.set()  # type: ignore[attr-defined]
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def firehose() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Firehose)
    server.sent, server.broken = 0, threading.Event()  # type: ignore[attr-defined]
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


class _CutAfter(_Firehose):
    """A backend whose stream sends `EVENTS` in one chunk, then drops the connection without
    the chunked body's end."""

    EVENTS = b""

    def do_POST(self) -> None:  # noqa: N802
        self.start_stream()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(self.EVENTS), self.EVENTS))
        self.wfile.flush()
        self.close_connection = True


def _lines_through_the_router(events: bytes) -> list[str]:
    """The `data:` lines a client of the router reads of a stream whose backend sent
    `events`, then broke the connection."""
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), type("_Cut", (_CutAfter,), {"EVENTS": events}))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    router = route(f"http://127.0.0.1:{server.server_port}")
    try:
        with httpx.stream("POST", f"{router.url}/v1/completions", timeout=10,
                          json={**BODY, "max_tokens": 5}) as response:
            return [line for line in response.iter_lines() if line.startswith("data:")]
    finally:
        router.stop()
        server.shutdown()
        server.server_close()


def test_a_stream_cut_after_the_backends_done_gets_no_error_event() -> None:
    """The backend's `[DONE]` came, then its connection broke: the client's stream ends
    there, without an error event or a second `[DONE]`."""
    lines = _lines_through_the_router(b'data: {"choices": []}\n\ndata: [DONE]\n\n')
    assert lines == ['data: {"choices": []}', "data: [DONE]"]


@pytest.mark.parametrize("blank", [b"\n\n", b"\r\n\r\n"])
def test_a_stream_cut_inside_an_event_drops_its_half_before_the_error_event(
        blank: bytes) -> None:
    """The backend broke its connection in the middle of an event: the client never gets
    that half (the router holds the bytes after the last blank line until their event is
    whole), so the error event after the whole ones parses."""
    lines = _lines_through_the_router(b'data: {"choices": [{"text": "a"}]}' + blank
                                      + b'data: {"choices": [{"te')
    assert lines[0] == 'data: {"choices": [{"text": "a"}]}' and lines[2] == "data: [DONE]"
    error = json.loads(lines[1].removeprefix("data: "))["error"]
    assert error["code"] == 502 and "failed mid-stream" in error["message"]
    assert len(lines) == 3


def test_a_reader_that_never_drains_stops_the_router_reading_its_backend(
        firehose: http.server.ThreadingHTTPServer) -> None:
    """Flow control end to end: a backend that could send 256 MiB at once to a client that
    reads nothing gets to send only what the sockets and the router's bounded buffer hold
    (the router stops reading it while the client's transport is paused), and the router's
    memory stays flat; when the client leaves, the router closes the backend's connection."""
    router = route(f"http://127.0.0.1:{firehose.server_port}")
    try:
        idle = process_stats(router.proc.pid)["rss_mib"]
        sock = stalled_reader(router.url)
        _wait_for(lambda: firehose.sent > 0, 10, "the stream did not start")  # type: ignore[attr-defined]
        time.sleep(3.0)  # time enough to relay all 256 MiB, were nothing paused
        sent = firehose.sent  # type: ignore[attr-defined]
        grown = process_stats(router.proc.pid)["rss_mib"] - idle
        print(f"sent {sent / 2**20:.1f} MiB of {STREAM_BYTES / 2**20:.0f}; router RSS "
              f"+{grown:.1f} MiB")
        sock.close()
        assert firehose.broken.wait(10), "the backend's connection was not closed"  # type: ignore[attr-defined]
        assert sent < 32 * 2**20
        assert grown < 32
    finally:
        router.stop()


def _running(backend: Rt) -> float:
    text = httpx.get(f"{backend.url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def _aborted(backend: Rt) -> float:
    text = httpx.get(f"{backend.url}/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total")
               and 'finished_reason="abort"' in line)


def test_readers_that_never_drain_stall_no_other_stream_through_the_router() -> None:
    """4 clients that never read their 3000-token streams, through the router: another
    stream keeps its ITL (the bound of rt serve's own test), the router's memory stays flat,
    and the 4 are aborted at the backend once their sockets close."""
    backend = Rt(SIMULATED)
    router = route(backend.url)
    try:
        alone = statistics.median(_itl_ms(router.url, 60))
        idle = process_stats(router.proc.pid)["rss_mib"]
        stalled = [stalled_reader(router.url) for _ in range(4)]
        _wait_for(lambda: _running(backend) >= 4, 20,
                  "the 4 stalled readers' requests never all ran")
        time.sleep(1.0)  # their socket buffers fill; the router stops reading their backend
        beside = statistics.median(_itl_ms(router.url, 60))
        running = _running(backend)
        grown = process_stats(router.proc.pid)["rss_mib"] - idle
        print(f"ITL p50 alone {alone:.2f} ms, beside 4 stalled readers {beside:.2f} ms; "
              f"router RSS +{grown:.1f} MiB")
        for sock in stalled:
            sock.close()
        assert running >= 4
        assert beside < 3 * alone + 5, (alone, beside)
        assert grown < 16
        _wait_for(lambda: _running(backend) == 0, 10,
                  "the stalled streams were not aborted once their sockets closed")
    finally:
        router.stop()
        backend.stop()


def _samples(router: Rt) -> dict[str, float]:
    """The router's /metrics samples by line head (name and labels)."""
    text = httpx.get(f"{router.url}/metrics", timeout=5).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


@pytest.mark.parametrize("num_backends", [1, 2])
def test_a_backend_sigkilled_mid_stream_ends_the_stream_and_is_taken_out(
        num_backends: int) -> None:
    """The stream ends at once with an OpenAI-style error event, then `data: [DONE]`; the
    router stays up, takes the backend out (after --max-failures failed scrapes), and
    /health answers 200 while another backend is up, else 503 (docs/route.md)."""
    backends = [Rt(SIMULATED) for _ in range(num_backends)]
    router = route(*(b.url for b in backends))
    try:
        with httpx.stream("POST", f"{router.url}/v1/completions", timeout=30,
                          json={**BODY, "max_tokens": 3000}) as response:
            victim = backends[int(response.headers["x-rt-replica"])]
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            victim.kill()
            killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
            ended_s = time.monotonic() - killed
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["code"] == 502 and "failed mid-stream" in error["message"], error
        assert ended_s < 5.0  # at once, in fact: the connection closes
        up = f'rt_router_backend_up{{backend="{victim.url}"}}'
        _wait_for(lambda: _samples(router)[up] == 0, 10, "the backend was not taken out")
        assert router.proc.poll() is None
        health = httpx.get(f"{router.url}/health", timeout=5).status_code
        after = httpx.post(f"{router.url}/v1/completions", timeout=30,
                           json={**BODY, "stream": False, "max_tokens": 3})
        if num_backends == 1:
            assert (health, after.status_code) == (503, 503)
        else:
            assert (health, after.status_code) == (200, 200)
            assert after.headers["x-rt-replica"] != str(backends.index(victim))
    finally:
        assert router.stop() == 0
        for backend in backends:
            backend.stop()


def test_a_request_cut_at_shutdown_is_answered_and_aborted_at_its_backend() -> None:
    """SIGTERM with a stream and a non-streaming request in flight, --shutdown-timeout 1:
    the drain runs out; the stream ends with rt serve's 503 error event and `[DONE]`, the
    other request gets that 503, both are aborted at the backend; exit 0, one line."""
    backend = Rt(SIMULATED)
    router = route(backend.url, args=("--shutdown-timeout", "1"))
    assert _aborted(backend) == 0
    try:
        threads, got = stream_and_whole(router.url, 3000)
        _wait_for(lambda: _running(backend) == 2, 10, "not started")
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(20) == 0, router.output()
        assert_cut_answered(threads, got)
        # both are aborted at the backend: the router closes both exchanges, and rt serve
        # watches a non-streaming request's client too (`unless_client_leaves`)
        _wait_for(lambda: _aborted(backend) == 2, 10, "the requests were not aborted")
        assert _running(backend) == 0
        assert router.output().splitlines()[1:] == [
            "rt: router stopped; --shutdown-timeout (1 s) cut 2 request(s) in flight"]
    finally:
        router.stop()
        backend.stop()


def _rt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_short_soak_through_the_router_holds(tmp_path: Path) -> None:
    """`rt bench route --soak`: 8 streams for 6 s through the router in front of two
    backends: no error, no token-count mismatch, the router's descriptors back to idle,
    no KV block left in use, the router drained (exit 0)."""
    out = tmp_path / "soak.json"
    done = _rt("bench", "route", "--soak", "6", "--concurrency", "8", "--max-tokens", "16",
               "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    router = report["processes"]["router"]
    print({k: report[k] for k in ("completed", "errors", "token_count_mismatches")}, router)
    assert report["completed"] > 0 and report["backends"] == 2
    assert (report["errors"], report["token_count_mismatches"]) == (0, 0)
    assert (report["kv_blocks_in_use_after"], report["requests_running_after"]) == (0, 0)
    assert router["settled"]["fds"] <= router["idle"]["fds"]  # no descriptor leaked
    assert router["rss_growth_pct"] < 10
    assert report["router_exit_code"] == 0


def test_a_soak_holds_one_concurrency() -> None:
    done = _rt("bench", "route", "--soak", "5", "--concurrency", "1", "--concurrency", "2")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--soak holds one --concurrency" in done.stderr
