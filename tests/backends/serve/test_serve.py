"""`rt serve`: the official openai client against the tiny model and --simulate, concurrency,
disconnects, errors, /metrics, SIGTERM and a dead engine. Servers run as subprocesses on
127.0.0.1 (free ports); every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import os
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

openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Served:
    """`rt serve` in a subprocess; its output goes to a log file (an unread pipe could fill
    and block the server)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 new_session: bool = False) -> None:
        """`new_session`: the server leads its own process group (with its engine process,
        for a test to signal the whole group, as a supervisor does)."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.log = tempfile.NamedTemporaryFile(prefix="rt-serve-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--port", str(self.port), *args],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=subprocess.STDOUT, start_new_session=new_session)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rt serve exited: {self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("rt serve did not come up")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0,
                             timeout=30)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        values: dict[str, float] = {}
        for family in prometheus_parser.text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.labels.get("le"):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode


def _first_data(lines: Iterator[str]) -> str:
    """Read up to the first `data:` line. The caller keeps `lines` (a response's
    `iter_lines()`) referenced: httpx closes the connection (a client disconnect) as soon
    as that iterator is finalized, e.g. after `break` out of `for line in r.iter_lines()`."""
    return next(line for line in lines if line.startswith("data:"))


@pytest.fixture(scope="module")
def tiny() -> Iterator[Served]:
    server = Served(["--max-model-len", "256", "--num-gpu-blocks-override", "64"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def simulated() -> Iterator[Served]:
    server = Served(["--simulate", "--gpu", "h200", "--max-model-len", "4096"])
    yield server
    server.stop()


def test_openai_client_streams_from_the_tiny_model(tiny: Served) -> None:
    client = tiny.client()
    assert client.models.list().data[0].id == "tiny-llama"
    stream = client.completions.create(
        model="tiny-llama", prompt="hello there", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == len("hello there")
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    again = client.completions.create(model="tiny-llama", prompt="hello there", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == text  # greedy: deterministic
    assert again.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        seed=7, temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    chunks = list(chat)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_repeats_and_stop_token_ids_stop(tiny: Served) -> None:
    client = tiny.client()

    def run(**kw: object) -> object:
        return client.completions.create(model="tiny-llama", prompt=[5, 6, 7, 8],
                                         max_tokens=12, temperature=1.0, seed=3,
                                         extra_body={"ignore_eos": True, **kw})

    first, second = run(), run()
    assert first.choices[0].text == second.choices[0].text
    assert httpx.post(f"{tiny.url}/tokenize", json={"prompt": "abc"},
                      timeout=5).json()["tokens"] == [3 + 97, 3 + 98, 3 + 99]
    every_id = list(range(512))
    stopped = client.completions.create(
        model="tiny-llama", prompt=[5, 6, 7, 8], max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": every_id})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1
    # min_tokens masks the stop tokens (all but 0-2 here) for the first 3 outputs.
    held = client.completions.create(
        model="tiny-llama", prompt=[5, 6, 7, 8], max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": every_id[3:], "min_tokens": 3})
    assert held.usage.completion_tokens >= 4


def _greedy_by_hand(prompt: list[int], steps: int, presence: float, frequency: float,
                    repetition: float) -> list[int]:
    """The tiny model's greedy tokens with vLLM's penalties, worked out here in plain
    Python from transformers' logits (a full forward per token, no KV cache)."""
    import torch
    from transformers import LlamaForCausalLM

    from backends.engine.tiny_model import build_tiny_llama

    model = LlamaForCausalLM.from_pretrained(build_tiny_llama(), torch_dtype=torch.float32)
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1].tolist()
        output = ids[len(prompt):]
        for token in set(ids):  # repetition: the prompt's tokens and the output's
            row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
        for token in set(output):
            row[token] -= frequency * output.count(token) + presence
        ids.append(max(range(len(row)), key=row.__getitem__))
    return ids[len(prompt):]


def test_penalties_change_greedy_output_as_worked_out_by_hand(tiny: Served) -> None:
    prompt, steps = [5, 6, 7, 8], 32  # the plain greedy run repeats a token at the 12th
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    body = {"prompt": prompt, "max_tokens": steps, "temperature": 0, "ignore_eos": True}
    url = tiny.url

    def text_of(ids: list[int]) -> str:
        return str(httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=5)
                   .json()["prompt"])

    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
    penalized = httpx.post(f"{url}/v1/completions", json={**body, **penalties},
                           timeout=30).json()
    expected = _greedy_by_hand(prompt, steps, 1.5, 0.5, 1.3)
    assert penalized["choices"][0]["text"] == text_of(expected)
    assert plain["choices"][0]["text"] == text_of(_greedy_by_hand(prompt, steps, 0, 0, 1))
    assert penalized["choices"][0]["text"] != plain["choices"][0]["text"]
    # logit_bias: -100 on each token the penalized run chose first makes it pick another
    biased = httpx.post(f"{url}/v1/completions", timeout=30, json={
        **body, **penalties, "max_tokens": 1, "logit_bias": {str(expected[0]): -100}}).json()
    assert biased["choices"][0]["text"] != text_of(expected[:1])


@pytest.mark.parametrize("which", ["tiny", "simulated"])
def test_stop_strings_cut_the_text_as_vllm_on_both_engines(
        which: str, request: pytest.FixtureRequest) -> None:
    """The real engine (greedy) and --simulate (a seeded synthetic stream) both make a
    fixed text; a stop string taken from its middle cuts it before its first occurrence
    (after it with include_stop_str_in_output), finish_reason "stop", stop_reason the
    string, and the usage counts the tokens up to the one that completed it: the fewest
    max_tokens whose text holds it."""
    server: Served = request.getfixturevalue(which)
    url = f"{server.url}/v1/completions"
    body = {"prompt": [5, 6, 7, 8], "temperature": 0, "seed": 11, "ignore_eos": True}

    def complete(**kw: object) -> dict:
        return dict(httpx.post(url, json={**body, **kw}, timeout=30).json())

    texts = [complete(max_tokens=k)["choices"][0]["text"] for k in range(1, 13)]
    stop = texts[-1][5:7]
    cut = texts[-1].find(stop)
    needed = next(k for k, text in enumerate(texts, 1) if stop in text)
    answer = complete(max_tokens=12, stop=[stop, "never-made"])
    assert answer["choices"][0] | {"text": texts[-1][:cut], "finish_reason": "stop",
                                   "stop_reason": stop} == answer["choices"][0]
    assert answer["usage"]["completion_tokens"] == needed
    kept = complete(max_tokens=12, stop=stop, include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == texts[-1][:cut + len(stop)]
    assert kept["usage"]["completion_tokens"] == needed
    chunks = list(server.client().completions.create(
        model=httpx.get(f"{server.url}/v1/models", timeout=5).json()["data"][0]["id"],
        prompt=[5, 6, 7, 8], max_tokens=12, temperature=0, seed=11, stop=stop, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[-1][:cut]
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == needed


def test_a_stop_string_aborts_the_request_in_the_engine(simulated: Served) -> None:
    """The API server finds the stop string; the engine, which would run to max_tokens
    (its steps take the cost model's time: ~20 s), is told to abort: nothing stays running
    and the KV blocks return to 0 within seconds, a few tokens past the stop at most."""
    server = simulated
    url = f"{server.url}/v1/completions"
    body = {"prompt": [5, 6, 7, 8], "temperature": 0, "seed": 11, "ignore_eos": True}
    text = httpx.post(url, json={**body, "max_tokens": 12}, timeout=30).json()[
        "choices"][0]["text"]
    before = server.metrics()["vllm:generation_tokens_total"]
    answer = httpx.post(url, json={**body, "max_tokens": 3000, "stop": text[5:7]},
                        timeout=30).json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    deadline = time.monotonic() + 5
    while (m := server.metrics())["vllm:kv_cache_usage_perc"] > 0 \
            or m["vllm:num_requests_running"] > 0:
        assert time.monotonic() < deadline, "the stopped request still runs in the engine"
        time.sleep(0.02)
    assert m["vllm:generation_tokens_total"] - before < 100


def test_openai_client_streams_from_the_simulated_server(simulated: Served) -> None:
    client = simulated.client()
    stream = client.chat.completions.create(
        model="llama-3.1-8b", messages=[{"role": "user", "content": "tell me"}],
        max_completion_tokens=20, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 20
    # One chunk per token unless the stream fell behind the engine (then merged, as vLLM)
    assert 1 <= sum(1 for c in chunks if c.choices and c.choices[0].delta.content) <= 20


def test_32_concurrent_streams_get_their_token_counts(simulated: Served) -> None:
    client = openai.AsyncOpenAI(base_url=f"{simulated.url}/v1", api_key="x", max_retries=0,
                                timeout=30)

    async def one(i: int) -> tuple[int, int]:
        stream = await client.completions.create(
            model="llama-3.1-8b", prompt="x" * (10 + i), max_tokens=5 + i, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "min_tokens": 2})
        count, usage = 0, 0
        async for chunk in stream:
            if chunk.choices:
                count += 1
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return count, usage

    async def run_all() -> list[tuple[int, int]]:
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(asyncio.wait_for(run_all(), 60))
    assert [usage for _, usage in results] == [5 + i for i in range(32)]
    assert all(1 <= count <= usage for count, usage in results)  # merged chunks, if behind


def test_disconnect_aborts_and_frees_the_kv_blocks(simulated: Served) -> None:
    server = simulated  # its steps take the cost model's time: the request is still running
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30, json={
            "prompt": "a" * 100, "max_tokens": 3000, "ignore_eos": True, "stream": True,
            "temperature": 0}) as response:
        lines = response.iter_lines()  # kept: the connection stays open
        _first_data(lines)
        deadline = time.monotonic() + 10
        while server.metrics()["vllm:num_requests_running"] == 0:  # a later step's stats
            assert time.monotonic() < deadline
            time.sleep(0.02)
        before = server.metrics()
        assert before["vllm:kv_cache_usage_perc"] > 0
        _first_data(lines)  # still streaming
    disconnected = time.monotonic()  # leaving the block closed the connection
    while server.metrics()["vllm:kv_cache_usage_perc"] > 0:
        assert time.monotonic() < disconnected + 10, "blocks not freed after the disconnect"
        time.sleep(0.02)
    freed_after = time.monotonic() - disconnected
    after = server.metrics()
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:generation_tokens_total"] < before["vllm:generation_tokens_total"] + 2900
    assert freed_after < 2.0, f"blocks freed only {freed_after:.2f} s after the disconnect"


def test_bad_input_gets_openai_errors(tiny: Served) -> None:
    url = f"{tiny.url}/v1/completions"
    # sent as JSON, so that the malformed body (not the Content-Type) is what is refused
    bad = httpx.post(url, content=b"{not json", timeout=5,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400
    assert set(bad.json()["error"]) == {"message", "type", "param", "code"}
    assert "malformed JSON" in bad.json()["error"]["message"]
    for body, param in [({"prompt": "hi", "max_tokens": "x"}, "body.max_tokens"),
                        ({"prompt": "hi", "temperature": -1}, "temperature"),
                        ({"prompt": 5}, "body.prompt"),
                        ({"prompt": "z" * 300}, "prompt"),
                        ({"prompt": "hi", "max_tokens": 400}, "max_tokens"),
                        ({"prompt": "hi", "min_tokens": 50, "max_tokens": 4}, "min_tokens")]:
        response = httpx.post(url, json=body, timeout=5)
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param
    assert httpx.post(url, json={"prompt": "hi", "model": "nope"}, timeout=5).status_code == 404
    with pytest.raises(openai.BadRequestError):
        tiny.client().completions.create(model="tiny-llama", prompt="q" * 300)


def test_the_real_engine_runs_past_the_prompts_room_to_max_model_len(tiny: Served) -> None:
    """A max_tokens within max_model_len (256) but past what the prompt leaves runs until
    max_model_len, as vLLM 0.32 (the fixture of test_api_diff checks it on --simulate):
    the real engine stops exactly there, and the usage counts say so, streamed or not."""
    prompt = list(range(3, 243))  # 240 token ids: 16 left
    body = {"prompt": prompt, "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    answer = httpx.post(f"{tiny.url}/v1/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {**answer["usage"], "prompt_tokens": 240,
                               "completion_tokens": 16, "total_tokens": 256}
    chunks = tiny.client().completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=100, stream=True, temperature=0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = [c.usage for c in chunks if c.usage is not None]
    assert [(u.prompt_tokens, u.completion_tokens) for u in usage] == [(240, 16)]


def test_metrics_parse_and_carry_vllm_names(tiny: Served) -> None:
    tiny.client().completions.create(model="tiny-llama", prompt="metrics", max_tokens=3,
                                     extra_body={"ignore_eos": True})
    text = httpx.get(f"{tiny.url}/metrics", timeout=5).text
    families = {f.name: f for f in prometheus_parser.text_string_to_metric_families(text)}
    for name, kind in [("vllm:num_requests_running", "gauge"),
                       ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"),
                       ("vllm:prompt_tokens", "counter"),
                       ("vllm:generation_tokens", "counter"),
                       ("vllm:request_success", "counter"),
                       ("vllm:prefix_cache_queries", "counter"),
                       ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"),
                       ("vllm:iteration_tokens_total", "histogram")]:
        assert families[name].type == kind, name
    ttft = families["vllm:time_to_first_token_seconds"]
    bounds = [s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket")]
    assert bounds[:3] == ["0.001", "0.005", "0.01"] and bounds[-1] == "+Inf"
    sample = next(s for s in families["vllm:generation_tokens"].samples)
    assert sample.labels == {"model_name": "tiny-llama", "engine": "0"}
    assert sample.value >= 3


def test_queue_limit_answers_503() -> None:
    server = Served(["--simulate", "--max-num-seqs", "1", "--max-num-queued-requests", "1"])
    url = f"{server.url}/v1/completions"
    body = {"prompt": "x" * 20, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url, json=body, timeout=30) as running:
            lines = running.iter_lines()  # kept: the connection stays open
            _first_data(lines)
            with httpx.stream("POST", url, json=body, timeout=30) as waiting:
                # Headers come at once, before the queued request's first token.
                assert waiting.status_code == 200
                rejected = httpx.post(url, json=body, timeout=5)
                assert rejected.status_code == 503
                assert rejected.json()["error"]["code"] == 503
            # The queued stream hung up before writing anything: its slot is free again.
            deadline = time.monotonic() + 10
            while server.metrics()["vllm:request_success_total"] < 1:  # the abort counted
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with httpx.stream("POST", url, json=body, timeout=30) as admitted:
                assert admitted.status_code == 200
            _first_data(lines)  # the running stream was never disturbed
        assert server.metrics()["vllm:admission_rejections_total"] == 1
    finally:
        assert server.stop() == 0  # SIGTERM with requests just aborted: a clean exit


def test_bench_serve_32_streams_hold_without_errors(tmp_path: Path) -> None:
    """`rt bench serve` (the CI size of the 200-stream load test): no error, every stream's
    token count, throughput and the added latency reported; its server is stopped."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "serve", "--concurrency", "32",
         "--random-input-len", "64", "--random-output-len", "32", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["errors"] == 0 and report["sent"] == 32
    assert report["token_count_mismatches"] == 0
    assert report["server_exit_code"] == 0
    assert report["server_counters"]["vllm:generation_tokens_total"] == 32 * 32
    for side in ("server_path", "simulated"):
        assert report[side]["completed"] == 32
        assert report[side]["output_tokens_per_s"] > 0
    for metric in ("ttft_ms", "itl_ms", "e2el_ms"):
        assert set(report["added_latency_ms"][metric]) == {"mean", "p50", "p99"}
    # The simulated engine runs on the wall clock: the server path cannot be faster.
    assert report["server_path"]["e2el_ms"]["p50"] >= report["simulated"]["e2el_ms"]["p50"]


def test_bench_serve_soak_holds_streams_and_leaves_nothing(tmp_path: Path) -> None:
    """`rt bench serve --soak` (CI size: 16 streams for 6 s): no error, every answer's token
    count, descriptors back to idle, no KV block left; the server exits 0."""
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "serve", "--soak", "6", "--concurrency", "16",
         "--random-input-len", "32", "--random-output-len", "16", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["completed"] > 16 and report["errors"] == 0
    assert report["token_count_mismatches"] == 0
    assert report["kv_blocks_in_use_after"] == 0 and report["requests_running_after"] == 0
    assert report["server_exit_code"] == 0
    for process in report["processes"].values():
        assert process["fds_growth"] <= 2
        assert process["rss_growth_pct"] < 25  # the 500-stream, minutes-long bound: 10%
