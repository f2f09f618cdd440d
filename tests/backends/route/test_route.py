"""`rt route` on loopback in front of two `rt serve --simulate` backends: the official
openai client through the router, the policy's choices, bad input, a backend killed and
brought back, and `rt fleet up` leaving no process behind. Every wait is bounded."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.backends.route.procs import ROOT, SIMULATED, Rt, free_port

openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

MODEL = "llama-3.1-8b"


@pytest.fixture(scope="module")
def backends() -> Iterator[list[Rt]]:
    started: list[Rt] = []
    try:
        started = [Rt(SIMULATED), Rt(SIMULATED)]
        yield started
    finally:
        for backend in started:
            backend.stop()


def route(backends: list[Rt], *args: str) -> Rt:
    urls = [a for b in backends for a in ("--backend", b.url)]
    return Rt(["route", *urls, *args], timeout_s=30)


def client(router: Rt) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=30)


def samples(router: Rt) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{router.url}/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in prometheus_parser.text_string_to_metric_families(text)
            for s in family.samples}


def per_backend(router: Rt, backends: list[Rt]) -> list[float]:
    values = samples(router)
    return [values[("rt_router_requests_total", (("backend", b.url),))] for b in backends]


def which_backend(router: Rt, backends: list[Rt], send: object) -> int:
    """Index of the backend that got the request `send()` makes."""
    before = per_backend(router, backends)
    send()  # type: ignore[operator]
    after = per_backend(router, backends)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b != a]
    assert len(changed) == 1, (before, after)
    return changed[0]


def test_openai_client_streams_through_round_robin_which_alternates(backends: list[Rt]
                                                                    ) -> None:
    router = route(backends, "--router", "round-robin")
    try:
        api = client(router)
        assert api.models.list().data[0].id == MODEL
        chosen = []
        for i in range(6):
            def send(i: int = i) -> None:
                if i % 2:
                    chunks = list(api.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                        max_tokens=5, stream=True, stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True}))
                    assert chunks[-1].usage.completion_tokens == 5
                else:
                    out = api.completions.create(model=MODEL, prompt=f"hello {i}",
                                                 max_tokens=4, extra_body={"ignore_eos": True})
                    assert out.usage.completion_tokens == 4
            chosen.append(which_backend(router, backends, send))
        assert chosen in ([0, 1, 0, 1, 0, 1], [1, 0, 1, 0, 1, 0])
        values = samples(router)
        assert values[("rt_router_routing_decisions_total",
                       (("policy", "round-robin"), ("reason", "next in turn")))] == 6
        assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200
    finally:
        assert router.stop() == 0


def _stream_content(text: str) -> tuple[str, list[str | None], list[str], int]:
    """An SSE completion stream's text, finish reasons, keys of every event, [DONE] count."""
    events = [line.removeprefix("data: ") for line in text.splitlines()
              if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    joined = "".join(c["choices"][0]["text"] for c in chunks)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks
               if c["choices"][0]["finish_reason"] is not None]
    keys = sorted({k for c in chunks for k in c} | {k for c in chunks for k in c["choices"][0]})
    return joined, reasons, keys, events.count("[DONE]")


def test_a_stream_is_forwarded_byte_for_byte(backends: list[Rt]) -> None:
    router = route(backends[:1])
    try:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "stream": True,
                "ignore_eos": True, "seed": 3}
        direct = httpx.post(f"{backends[0].url}/v1/completions", json=body, timeout=30)
        routed = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30)
        assert routed.headers["content-type"] == direct.headers["content-type"]
        # The same tokens and the same event shape; chunk boundaries may differ between the
        # two requests (a server merges outputs that queue up behind a slow write).
        assert _stream_content(routed.text) == _stream_content(direct.text)
        bad = httpx.post(f"{router.url}/v1/completions", content=b"{nope", timeout=10,
                         headers={"content-type": "application/json"})  # the body is bad
        assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
        assert "malformed JSON" in bad.json()["error"]["message"]
        unknown = httpx.post(f"{router.url}/v1/completions",
                             json={"model": "other", "prompt": "x"}, timeout=10)
        assert unknown.status_code == 404  # the backend's answer, passed through
    finally:
        router.stop()


def _running(backend: Rt) -> float:
    text = httpx.get(f"{backend.url}/metrics", timeout=5).text
    return sum(s.value for family in prometheus_parser.text_string_to_metric_families(text)
               for s in family.samples if s.name == "vllm:num_requests_running")


def test_a_client_that_leaves_mid_stream_aborts_its_backend_request(backends: list[Rt]
                                                                    ) -> None:
    router = route(backends[:1])
    try:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 3000, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=30) as http_client, \
                http_client.stream("POST", f"{router.url}/v1/completions", json=body) as out:
            chunks = out.iter_raw()  # (kept: a dropped iterator closes the response)
            next(chunks)  # streaming: the backend runs it
            in_flight = ("rt_router_in_flight_requests", (("backend", backends[0].url),))
            assert (samples(router)[in_flight], _running(backends[0])) == (1, 1)
        deadline = time.monotonic() + 20  # the client is gone: so is the backend's request
        while samples(router)[in_flight] != 0 or _running(backends[0]) != 0:
            assert time.monotonic() < deadline, (samples(router)[in_flight],
                                                 _running(backends[0]))
            time.sleep(0.05)
    finally:
        router.stop()


def _aborted(backend: Rt) -> float:
    """The backend's requests finished by an abort (rt serve's vLLM counter)."""
    return sum(value for (name, labels), value in samples(backend).items()
               if name == "vllm:request_success_total"
               and ("finished_reason", "abort") in labels)


def test_a_client_that_leaves_before_a_non_streaming_answer_aborts_its_backend_request(
        backends: list[Rt]) -> None:
    """rt serve sends a non-streaming answer's head with its body, at the end: the router,
    waiting for that head, must watch its client too. A raw client asks for 3000 tokens
    (~20 s on the simulated H200) and closes its socket once the backend runs the request:
    the backend aborts it (its abort counter +1, nothing running) and the router forgets it
    (in flight 0) within 10 s; before, the request ran to its end and was never aborted."""
    router = route(backends[:1])
    backend = backends[0]
    in_flight = ("rt_router_in_flight_requests", (("backend", backend.url),))
    try:
        aborted = _aborted(backend)
        body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 3000,
                           "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 10
            while (samples(router)[in_flight], _running(backend)) != (1, 1):
                assert time.monotonic() < deadline, "the request never ran"
                time.sleep(0.05)
        deadline = time.monotonic() + 10  # the socket is closed: the client is gone
        while (_aborted(backend), _running(backend), samples(router)[in_flight]) != \
                (aborted + 1, 0, 0):
            assert time.monotonic() < deadline, (_aborted(backend) - aborted,
                                                 _running(backend), samples(router)[in_flight])
            time.sleep(0.05)
        assert router.proc.poll() is None
    finally:
        assert router.stop() == 0


@pytest.mark.parametrize("policy", ["prefix-aware", "sglang-cache-aware"])
def test_a_prefix_aware_policy_keeps_a_conversation_on_one_backend(
        backends: list[Rt], policy: str) -> None:
    router = route(backends, "--router", policy)
    try:
        api = client(router)
        history: dict[str, list[dict[str, str]]] = {"a": [], "b": []}
        chosen: dict[str, list[int]] = {"a": [], "b": []}
        for turn in range(4):
            for conv in ("a", "b"):
                messages = history[conv]
                messages.append({"role": "user", "content": f"conversation {conv} turn {turn} "
                                 + "lorem ipsum dolor sit amet " * 8})

                def send(messages: list[dict[str, str]] = messages) -> None:
                    out = api.chat.completions.create(model=MODEL, messages=messages,
                                                      max_tokens=4)
                    messages.append({"role": "assistant",
                                     "content": out.choices[0].message.content or ""})
                chosen[conv].append(which_backend(router, backends, send))
        assert len(set(chosen["a"])) == 1 and len(set(chosen["b"])) == 1, chosen
    finally:
        router.stop()


class _NotOpenAI(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b'{"object":"list","data":[{"id":"m"}]}' if self.path == "/v1/models" \
            and self.server.models else b"nope"  # type: ignore[attr-defined]
        self.send_response(200 if body != b"nope" else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def stub() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _NotOpenAI)
    server.models = False  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def rt_error(*args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done.returncode, done.stderr


def test_bad_input_is_one_line_and_exit_2(stub: http.server.HTTPServer) -> None:
    url = f"http://127.0.0.1:{stub.server_port}"
    dead = f"http://127.0.0.1:{free_port()}"
    cases = {
        ("route", "--backend", dead): "is unreachable",
        ("route", "--backend", url): "is not OpenAI-compatible",
        ("route", "--backend", url, "--router", "nope"): "unknown router policy 'nope'",
        ("route", "--backend", url, "--router", "dynamo-kv"): "needs the engines' KV events",
    }
    for args, message in cases.items():
        code, err = rt_error(*args)
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)
    stub.models = True  # type: ignore[attr-defined]
    code, err = rt_error("route", "--backend", url, "--router", "vllm-dp")
    assert code == 2 and "needs vllm:num_requests_waiting" in err, err


def test_a_killed_backend_loses_no_unsent_request_and_comes_back() -> None:
    first, second = Rt(SIMULATED), Rt(SIMULATED)
    router = route([first, second], "--max-failures", "1", "--health-check-ms", "200",
                   "--router-refresh-ms", "50")
    try:
        api = client(router)
        results: dict[int, str] = {}
        streaming = threading.Semaphore(0)  # released at each stream's first chunk

        def stream(i: int) -> None:
            chunks = []
            try:
                for chunk in api.completions.create(
                        model=MODEL, prompt=f"long {i}", max_tokens=400, stream=True,
                        extra_body={"ignore_eos": True}):
                    if not chunks:
                        streaming.release()
                    chunks.append(chunk)
                results[i] = f"ok {len(chunks)}"
            except openai.APIError as err:
                results[i] = f"error {err}"
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        # all 4 mid-stream (400 tokens: ~3 s), not a guessed second for it
        assert all(streaming.acquire(timeout=20) for _ in threads)
        second.kill()
        killed_at = time.monotonic()
        # requests sent after the kill all succeed (a refused connection is re-routed)
        for i in range(6):
            out = api.completions.create(model=MODEL, prompt=f"after {i}", max_tokens=3)
            assert out.choices[0].finish_reason == "length"
        for thread in threads:
            thread.join(30)
        assert time.monotonic() - killed_at < 30
        outcomes = sorted(r.split()[0] for r in results.values())
        assert outcomes == ["error", "error", "ok", "ok"], results  # 2 were on the dead one
        assert all("failed mid-stream" in r for r in results.values() if r.startswith("error"))
        values = samples(router)
        assert values[("rt_router_backend_up", (("backend", second.url),))] == 0
        # the backend returns on the same port: the router puts it back
        revived = Rt(SIMULATED[:], port=second.port)
        try:
            deadline = time.monotonic() + 20
            while samples(router)[("rt_router_backend_up", (("backend", second.url),))] != 1:
                assert time.monotonic() < deadline, "the backend was not put back"
                time.sleep(0.2)
            chosen = {which_backend(router, [first, second], lambda: api.completions.create(
                model=MODEL, prompt="back", max_tokens=2)) for _ in range(4)}
            assert chosen == {0, 1}
        finally:
            revived.stop()
    finally:
        router.stop()
        first.stop()
        second.stop()


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]  # noqa: SIM115
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_fleet_up_serves_and_leaves_no_process() -> None:
    fleet = Rt(["fleet", "up", "--replicas", "2", "--simulate", "--gpu", "h200",
                "--max-model-len", "2048", "--router", "least-outstanding"], timeout_s=120)
    try:
        api = client(fleet)
        out = api.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert out.usage.completion_tokens == 3
        family = _descendants(fleet.proc.pid)
        assert len(family) >= 4  # two rt serve, each with its engine process
    finally:
        fleet.proc.send_signal(signal.SIGTERM)
        code = fleet.proc.wait(60)
        fleet.stop()
    assert code == 0, fleet.output()
    left = [pid for pid in family if _alive(pid)]
    assert not left, left


def test_bench_route_reports_both_paths(tmp_path: object) -> None:
    import json
    from pathlib import Path

    out = Path(str(tmp_path)) / "route.json"
    code, err = rt_error("bench", "route", "--concurrency", "2", "--num-requests", "6",
                         "--rounds", "1", "--out", str(out))
    assert code == 0, err
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["direct"]["requests"] == result["routed"]["requests"] == 6
    assert result["direct"]["errors"] == result["routed"]["errors"] == 0
    assert set(result["added_ms"]) == {"ttft_ms", "e2e_ms"}
