"""`rt route` and `rt fleet up` on issue 18's input rules, as `rt serve` meets them: the
listening socket bound first (port 0's real port printed; a bad --host, or a port in use, one
line and exit 2), bodies parsed by rt serve's parser (a body nested 100,000 deep is a 400),
the router's own errors in vLLM's shape and rt serve's bytes, --api-key (401 on /v1/*, the
client's header forwarded to a backend that shares the key) and --max-request-bytes (413,
declared or chunked). Loopback only, every wait bounded, every process stopped."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.backends.route.procs import ROOT, SIMULATED, Rt, free_port

KEY = "route18a-test-key"  # on the fixture's command lines
FLEET_KEY = "route18a-fleet-key"  # on none
MODEL = "llama-3.1-8b"
LIMIT = 300_000  # the router's --max-request-bytes here (over the 100,000-deep body)
AUTH = {"authorization": f"Bearer {KEY}"}
JSON_AUTH = {**AUTH, "content-type": "application/json"}
UNAUTHORIZED = b'{"error":"Unauthorized"}'  # vLLM's body
_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[Rt, Rt]]:
    """A backend with the key and a router with the same key (and a small body limit)."""
    backend = Rt([*SIMULATED, "--api-key", KEY])
    router: Rt | None = None
    try:
        router = Rt(["route", "--backend", backend.url, "--api-key", KEY,
                     "--max-request-bytes", str(LIMIT)], timeout_s=30)
        yield backend, router
    finally:
        if router is not None:
            router.stop()
        backend.stop()


class _Started:
    """`rt ARGS` with stdout and stderr in files, every wait bounded, its group stopped."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self._out = tempfile.TemporaryFile()  # noqa: SIM115
        self._err = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=ROOT,
                                     env={**_ENV, **(env or {})}, stdin=subprocess.DEVNULL,
                                     stdout=self._out, stderr=self._err,
                                     start_new_session=True)

    def text(self, which: str) -> str:
        file = self._out if which == "out" else self._err
        file.seek(0)
        return file.read().decode(errors="replace")

    def wait_for(self, pattern: str, which: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text(which))
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r}: {self.text('out')} {self.text('err')}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._out.close()
        self._err.close()
        return self.proc.returncode


def rt_error(*args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=_ENV)
    return done.returncode, done.stderr


# ---- the listening socket ------------------------------------------------------------------


def test_port_0_prints_the_port_the_router_listens_on(keyed: tuple[Rt, Rt]) -> None:
    backend, _ = keyed
    router = _Started(["route", "--backend", backend.url, "--api-key", KEY, "--port", "0"])
    try:
        url = router.wait_for(r"on (http://127\.0\.0\.1:(\d+))/v1\n", "err", 30)
        assert url.group(2) != "0"
        assert httpx.get(f"{url.group(1)}/health", timeout=5).status_code == 200
    finally:
        assert router.stop() == 0


def test_a_bad_host_or_a_port_in_use_is_one_line_before_anything_starts() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        dead = f"http://127.0.0.1:{free_port()}"  # never asked: the port is refused first
        for args in (["route", "--backend", dead],
                     ["fleet", "up", "--replicas", "1", "--simulate"]):
            code, err = rt_error(*args, "--port", str(port))
            assert code == 2 and err == (f"rt: error: --host '127.0.0.1' --port {port}: cannot "
                                         "listen there (Address already in use)\n"), err
    code, err = rt_error("route", "--backend", dead, "--host", "192.0.2.1")  # not this machine's
    assert code == 2 and err.startswith("rt: error: --host '192.0.2.1' --port 8080: cannot "
                                        "listen there (") and err.count("\n") == 1, err


# ---- bodies and the router's own errors ----------------------------------------------------


def test_a_body_nested_100000_deep_is_a_400() -> None:
    from backends.serve.api_error import ApiError
    from backends.serve.guard import parse_body

    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ApiError) as err:
        parse_body(body)
    assert (err.value.status, err.value.message) == (400, "malformed JSON body: nested too "
                                                          "deeply")


@pytest.mark.parametrize("body", [
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # was the router's 500
    b"[1, 2]", b"{not json", b'{"prompt": "\xff"}', b"", b'{"prompt": NaN}',
    b'{"user": ' + b"9" * 5000 + b"}",
])
def test_a_bad_body_gets_the_answer_rt_serve_gives_byte_for_byte(keyed: tuple[Rt, Rt],
                                                                  body: bytes) -> None:
    _same_answer(keyed, body, JSON_AUTH)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_gets_the_answer_rt_serve_gives(keyed: tuple[Rt, Rt],
                                                                 content_type: str | None
                                                                 ) -> None:
    """As vLLM: only application/json is taken (tests/backends/serve/test_api_diff.py)."""
    headers = AUTH if content_type is None else {**AUTH, "content-type": content_type}
    _same_answer(keyed, b'{"prompt": "hi", "max_tokens": 1}', headers)


def _same_answer(keyed: tuple[Rt, Rt], body: bytes, headers: dict[str, str]) -> None:
    backend, router = keyed
    direct = httpx.post(f"{backend.url}/v1/completions", content=body, headers=headers,
                        timeout=30)
    routed = httpx.post(f"{router.url}/v1/completions", content=body, headers=headers,
                        timeout=30)
    assert direct.status_code == 400
    assert (routed.status_code, routed.content) == (direct.status_code, direct.content)
    assert routed.headers["content-type"] == "application/json"
    assert "x-rt-replica" not in routed.headers  # the router's own answer


def test_the_routers_own_errors_are_rt_serves_json() -> None:
    from backends.serve.api_error import ApiError

    err = ApiError(404, "no route /v1/nothing — here")  # a non-ASCII byte, as Starlette sends
    assert err.encoded() == bytes(err.response().body) == (
        '{"error":{"message":"no route /v1/nothing — here","type":"NotFoundError",'
        '"param":null,"code":404}}').encode()


# ---- the API key ---------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"},
                                     {"authorization": f"Basic {KEY}"},
                                     {"authorization": f"Bearer {KEY}x"}])
@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/completions"),
                                              ("POST", "/v1/chat/completions"),
                                              ("GET", "/v1/models"), ("GET", "/v1/nothing")])
def test_v1_without_the_key_is_vllms_401(keyed: tuple[Rt, Rt], headers: dict[str, str],
                                         method: str, path: str) -> None:
    _, router = keyed
    answer = httpx.request(method, f"{router.url}{path}", headers=headers,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert (answer.status_code, answer.content) == (401, UNAUTHORIZED)


@pytest.mark.parametrize("head", [
    b"content-length: 10000000\r\n",  # over the limit: the 401 still comes first
    b"content-length: 1000\r\nexpect: 100-continue\r\n",  # no 100 Continue: the 401
])
def test_without_the_key_the_401_comes_before_the_body_is_read(keyed: tuple[Rt, Rt],
                                                               head: bytes) -> None:
    _, router = keyed
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: h\r\n" + head + b"\r\n")
        answer = b""
        while chunk := client.recv(65536):  # the router closes after its answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401 Unauthorized\r\n")
    assert answer.endswith(b"\r\n\r\n" + UNAUTHORIZED)


def test_with_the_key_the_request_reaches_the_backend_which_shares_it(keyed: tuple[Rt, Rt]
                                                                      ) -> None:
    backend, router = keyed
    assert httpx.get(f"{router.url}/health", timeout=5).status_code == 200  # open
    assert httpx.get(f"{router.url}/metrics", timeout=5).status_code == 200  # open
    models = httpx.get(f"{router.url}/v1/models", headers=AUTH, timeout=30)
    assert models.json()["data"][0]["id"] == MODEL
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    for headers in (AUTH, {"authorization": f"bearer {KEY}"}):  # the scheme: any case
        answer = httpx.post(f"{router.url}/v1/completions", json=body, headers=headers,
                            timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
    # the backend refuses a request without the key: the router forwarded the client's
    assert httpx.post(f"{backend.url}/v1/completions", json=body, timeout=30).status_code == 401


def test_a_router_without_the_backends_key_is_one_line(keyed: tuple[Rt, Rt]) -> None:
    backend, _ = keyed
    code, err = rt_error("route", "--backend", backend.url, "--port", str(free_port()))
    assert code == 2 and err == (f"rt: error: backend {backend.url} refuses the router's API "
                                 "key (GET /v1/models answered 401): give rt route the "
                                 "backends' --api-key\n"), err


# ---- the body limit ------------------------------------------------------------------------


def _body_of(size: int) -> bytes:
    """A valid completion body of exactly `size` bytes (padded by an unknown field)."""
    head = b'{"model": "llama-3.1-8b", "max_tokens": 1, "prompt": "hi", "pad": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def test_a_body_over_max_request_bytes_is_a_413_declared_or_chunked(keyed: tuple[Rt, Rt]
                                                                      ) -> None:
    _, router = keyed
    url = f"{router.url}/v1/completions"
    expected = (b'{"error":{"message":"the request body is longer than 300000 bytes",'
                b'"type":"RequestTooLargeError","param":null,"code":413}}')
    declared = httpx.post(url, content=_body_of(LIMIT + 1), headers=JSON_AUTH, timeout=30)
    chunked = httpx.post(url, content=iter([_body_of(LIMIT + 1)[:100_000],
                                            _body_of(LIMIT + 1)[100_000:]]),
                         headers=JSON_AUTH, timeout=30)
    assert chunked.request.headers["transfer-encoding"] == "chunked"
    for answer in (declared, chunked):
        assert (answer.status_code, answer.content) == (413, expected)
    for content in (_body_of(LIMIT), iter([_body_of(LIMIT)])):  # at the limit: served
        answer = httpx.post(url, content=content, headers=JSON_AUTH, timeout=30)
        assert answer.status_code == 200, answer.text


# ---- rt fleet up ---------------------------------------------------------------------------


def _command_lines() -> list[bytes]:
    lines = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                lines.append(Path(f"/proc/{entry}/cmdline").read_bytes())
    return lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_fleet_up_gives_the_key_to_the_router_and_each_replica_by_environment() -> None:
    fleet = _Started(["fleet", "up", "--replicas", "1", "--simulate", "--gpu", "h200",
                      "--max-model-len", "2048", "--port", "0"], env={"VLLM_API_KEY": FLEET_KEY})
    try:
        url = fleet.wait_for(r"(http://127\.0\.0\.1:(\d+))/v1\n", "out", 120)
        replica = fleet.wait_for(r"1 replicas up: (http://\S+)", "err", 5).group(1)
        assert url.group(2) != "0"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        auth = {"authorization": f"Bearer {FLEET_KEY}"}
        for base in (url.group(1), replica):
            assert httpx.post(f"{base}/v1/completions", json=body, timeout=30
                              ).status_code == 401
            assert httpx.post(f"{base}/v1/completions", json=body, headers=auth, timeout=30
                              ).status_code == 200
        assert not [line for line in _command_lines() if FLEET_KEY.encode() in line]
    finally:
        assert fleet.stop() == 0, fleet.text("err")


def test_fleet_up_passes_the_simulated_engines_sizing_to_each_replica(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`rt fleet up --simulate --gpu-memory-utilization 0.5 -tp 2`: each replica's `rt serve`
    gets both (they were no options of fleet up); -tp without --simulate is refused."""
    from typer.testing import CliRunner

    import cli
    from backends.route import fleet

    plans: list[fleet.FleetPlan] = []
    monkeypatch.setattr(fleet, "run_fleet", lambda plan, *_: plans.append(plan))
    runner = CliRunner()
    result = runner.invoke(cli.app, ["fleet", "up", "--simulate", "--replicas", "1", "--port",
                                     "0", "--gpu-memory-utilization", "0.5", "-tp", "2"])
    assert result.exit_code == 0, result.output
    command = plans[0].serve_command
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.5"
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    refused = runner.invoke(cli.app, ["fleet", "up", "--replicas", "1", "--port", "0",
                                      "-tp", "2"])
    assert refused.exit_code == 2 and len(plans) == 1
    assert refused.stderr == "rt: error: --tensor-parallel-size 2 needs --simulate (the real " \
        "engine runs on one device)\n"
