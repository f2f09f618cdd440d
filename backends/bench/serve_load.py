"""A bounded loopback load test of `rt serve` (`rt bench serve`).

`run_load` starts the server command it is given (`rt serve --simulate ...`, built by
`cli.py`) on a free port of 127.0.0.1, with its output in a log file, waits for `/health`,
replays a trace against it with `backends.replay.endpoint` (the `rt replay --endpoint`
machinery: streaming, client-side TTFT and per-chunk ITL) and always stops it (SIGTERM, then
SIGKILL). `compare` puts those records next to a simulation's on the same arrivals
(`cli.py` runs `rt simulate`'s core, since `backends` never imports `sim`) and reports
throughput and the latency the server path adds: HTTP, SSE, tokenization, the ZeroMQ hop
and the engine process's loop on the wall clock, minus the simulated engine.

Every wait is bounded: the start (`start_timeout_s`), each request (`request_timeout_s`),
the stop (`stop_timeout_s`).
"""

from __future__ import annotations

import contextlib
import math
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from backends.bench.lean_replay import capture_run, replay_lean
from backends.bench.process_cpu import cpu_seconds, renice, spent
from backends.heap import frozen_heap
from backends.replay.endpoint import EndpointResult, replay_endpoint
from backends.replay.endpoint_probe import EndpointConfig, EndpointInfo, own_get, probe
from runtime.records import RequestRecord
from workloads import Trace

_HOST = "127.0.0.1"
CLIENTS = ("httpx", "lean", "capture")  # `rt bench serve --client`


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How to run the server and the client.

    Attributes:
        server_command: the server's command line without `--host`/`--port` (appended).
        concurrency: client streams in flight at most (`--max-concurrency`).
        vocab_size: prompt token ids are drawn from [10, vocab_size).
        seed: seed of the prompts' token ids.
        start_timeout_s, request_timeout_s, stop_timeout_s: the bounds of every wait.
        client: "httpx" (`rt replay --endpoint`'s client), "lean" (`sse_client`) or
            "capture" (`capture_client`: reads kept during the run, parsed after it).
        engine_nice: the engine process's nice value once it is up (None: inherited).
    """

    server_command: tuple[str, ...]
    concurrency: int = 200
    vocab_size: int = 32000
    seed: int = 0
    start_timeout_s: float = 120.0
    request_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    client: str = "httpx"
    engine_nice: int | None = None

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ValueError(f"--client must be httpx, lean or capture, got {self.client!r}")


@dataclass(slots=True)
class LoadResult:
    """The endpoint replay's records, the server's own counters (from /metrics) and the CPU
    seconds each process ran and waited for a CPU during the replay (`cpu_s`, see
    `cpu_seconds`)."""

    endpoint: EndpointResult
    server_counters: dict[str, float]
    server_exit_code: int | None
    log_tail: str
    cpu_s: dict[str, float] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """A server subprocess on 127.0.0.1: started, waited for, always stopped."""

    def __init__(self, command: Sequence[str], start_timeout_s: float,
                 stop_timeout_s: float) -> None:
        self.port = free_port()
        self.url = f"http://{_HOST}:{self.port}"
        self.stop_timeout_s = stop_timeout_s
        self.log = tempfile.NamedTemporaryFile(prefix="rt-bench-serve-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen([*command, "--host", _HOST, "--port", str(self.port)],
                                     stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): "
                                   f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the server did not answer /health within {timeout_s:g} s")

    def counters(self) -> dict[str, float]:
        """The server's /metrics samples summed over labels (histogram buckets left out)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = own_get(f"{self.url}/metrics").text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if "le" not in sample.labels and not sample.name.endswith("_created"):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def engine_pid(self) -> int:
        return int(own_get(f"{self.url}/health").headers["x-engine-pid"])

    def log_tail(self, chars: int = 2000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def stop(self) -> int | None:
        """SIGTERM (the server drains), SIGKILL after `stop_timeout_s`; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@contextlib.contextmanager
def serving(config: LoadConfig) -> Iterator[ServerProcess]:
    server = ServerProcess(config.server_command, config.start_timeout_s,
                           config.stop_timeout_s)
    try:
        yield server
    finally:
        server.stop()
        server.log.close()


def run_load(trace: Trace, config: LoadConfig) -> LoadResult:
    """Start the server, replay `trace` against it (at most `concurrency` streams at once)
    with the configured client, read its counters, stop it."""
    with serving(config) as server:
        endpoint = EndpointConfig(server.url, None, None, config.concurrency,
                                  config.request_timeout_s, config.vocab_size, config.seed)
        info = probe(endpoint)
        result, spent = _replay(trace, config, server.port, endpoint, info,
                                server_pids(server, config))
        counters = server.counters()
        tail = server.log_tail()
    return LoadResult(result, counters, server.proc.returncode, tail, spent)


def _replay(trace: Trace, config: LoadConfig, port: int, endpoint: EndpointConfig,
            info: EndpointInfo, pids: dict[str, int]
            ) -> tuple[EndpointResult, dict[str, float]]:
    """The replay with the configured client, and the CPU seconds spent during it (for the
    capture client: its run, not its heap's collection before; the parse after it apart, as
    "client_parse", this thread's CPU seconds)."""
    if config.client == "capture":
        with frozen_heap():
            before = cpu_seconds(pids)
            run = capture_run(trace, _HOST, port, info.model, config.concurrency,
                              config.vocab_size, config.seed, config.request_timeout_s)
            after = cpu_seconds(pids)
        parse_start = time.thread_time()
        result = run.result()
        return result, {**spent(before, after),
                        "client_parse": round(time.thread_time() - parse_start, 3)}
    before = cpu_seconds(pids)
    if config.client == "lean":
        result = replay_lean(trace, _HOST, port, info.model, config.concurrency,
                             config.vocab_size, config.seed, config.request_timeout_s)
    else:
        result = replay_endpoint(trace, endpoint, info)
    return result, spent(before, cpu_seconds(pids))


def server_pids(server: ServerProcess, config: LoadConfig) -> dict[str, int]:
    """The server's two processes ("api_server", "engine"), the engine's nice value set to
    `config.engine_nice` if given, on every thread it has (RuntimeError when the OS refuses
    it). On 2 shared CPUs the engine's steps, each a sleep to the cost model's end time,
    woke late by 0.4-1.2 s in total per 10-s run at 200 streams, 0.09-0.25 s at nice -10
    (docs/serve.md, "Added TTFT at 200 streams, stage by stage")."""
    pids = {"api_server": server.proc.pid, "engine": server.engine_pid()}
    if config.engine_nice is not None:
        renice(pids["engine"], config.engine_nice)
    return pids


def sent_arrivals(trace: Trace, records: Sequence[RequestRecord]) -> Trace:
    """`trace` with each request's arrival at the time the client sent it (the same
    arrivals for the simulation, including any wait for a concurrency slot)."""
    sent = {r.request_id: r.arrival_s for r in records}
    start = min(sent.values(), default=0.0)
    moved = [replace(req, arrival_s=max(0.0, sent.get(req.request_id, req.arrival_s) - start))
             for req in trace]
    return Trace(tuple(sorted(moved, key=lambda r: r.arrival_s)), name=trace.name)


# ---- statistics ------------------------------------------------------------------------------


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    data = np.asarray(values, dtype=float) * 1000.0
    return {"mean": round(float(data.mean()), 3),
            "p50": round(float(np.percentile(data, 50)), 3),
            "p99": round(float(np.percentile(data, 99)), 3)}


def _completed(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The records of requests that finished with a first token (not aborted)."""
    return [r for r in records if r.status != "FINISHED_ABORTED" and r.first_token_s is not None
            and r.finish_s is not None]


def latency_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Throughput and TTFT / ITL / E2EL (ms) of the completed requests."""
    done = _completed(records)
    if not done:
        return {"completed": 0}
    start = min(r.arrival_s for r in done)
    duration = max(r.finish_s for r in done) - start  # type: ignore[type-var,operator]
    output = sum(r.output_len for r in done)
    itl = [b - a for r in done for a, b in zip(r.token_times_s, r.token_times_s[1:],
                                                  strict=False)]
    return {
        "completed": len(done),
        "output_tokens": output,
        "chunks": sum(len(r.token_times_s) for r in done),  # events with text (tokens: sim)
        "duration_s": round(duration, 3),
        "requests_per_s": round(len(done) / duration, 2) if duration > 0 else math.inf,
        "output_tokens_per_s": round(output / duration, 1) if duration > 0 else math.inf,
        "ttft_ms": _percentiles([r.first_token_s - r.arrival_s for r in done]),  # type: ignore[operator]
        "itl_ms": _percentiles(itl),
        "e2el_ms": _percentiles([r.finish_s - r.arrival_s for r in done]),  # type: ignore[operator]
    }


def added_latency(server: dict[str, Any], simulated: dict[str, Any]) -> dict[str, Any]:
    """Server path minus simulation, per metric and statistic (ms)."""
    added: dict[str, Any] = {}
    for metric in ("ttft_ms", "itl_ms", "e2el_ms"):
        if metric in server and metric in simulated:
            added[metric] = {k: round(server[metric][k] - simulated[metric][k], 3)
                             for k in server[metric]}
    return added


def added_ttft_per_request(server: Sequence[RequestRecord],
                           simulated: Sequence[RequestRecord]) -> dict[str, Any]:
    """Server TTFT minus simulated TTFT of the same request (both from its send time: the
    simulation replays the sent arrivals), ms, over requests completed on both sides: the
    time the serving path added to each request. Unlike `added_latency`'s difference of two
    percentiles, it does not jump when a closed loop's TTFTs come in waves and a run's median
    lands in a different wave than the twin's."""
    def ttfts(records: Sequence[RequestRecord]) -> dict[str, float]:
        return {r.request_id: r.first_token_s - r.arrival_s  # type: ignore[operator]
                for r in _completed(records)}

    sim = ttfts(simulated)
    return _percentiles([ttft - sim[rid] for rid, ttft in ttfts(server).items() if rid in sim])


def cpu_per_output(cpu_s: dict[str, float], server: dict[str, Any]) -> dict[str, float]:
    """Each process's CPU microseconds per output token and per streamed chunk (a chunk may
    carry several tokens): a load-tolerant measure of the serving path's cost, unlike the
    wall-clock latencies. Empty when the CPU times or the completions are missing."""
    tokens, chunks = server.get("output_tokens"), server.get("chunks")
    if not tokens or not chunks:
        return {}
    out = {}
    for name in ("api_server", "engine", "client", "client_parse"):
        if name in cpu_s:
            out[f"{name}_per_token"] = round(1e6 * cpu_s[name] / tokens, 2)
            out[f"{name}_per_chunk"] = round(1e6 * cpu_s[name] / chunks, 2)
    return out


def compare(trace: Trace, load: LoadResult, simulated: Sequence[RequestRecord]
            ) -> dict[str, Any]:
    """The report: errors, token counts, throughput and added latency."""
    records = load.endpoint.requests
    wanted = {req.request_id: req.output_len for req in trace}
    mismatched = sum(r.status != "FINISHED_ABORTED" and r.output_len != wanted[r.request_id]
                     for r in records)
    server = latency_summary(records)
    sim = latency_summary(simulated)
    return {
        "requests": len(trace),
        "sent": len(records),
        "errors": load.endpoint.num_failed,
        "error_messages": dict(list(load.endpoint.errors.items())[:5]),
        "token_count_mismatches": mismatched,
        "server_exit_code": load.server_exit_code,
        "cpu_s": load.cpu_s,
        "cpu_us": cpu_per_output(load.cpu_s, server),
        "server_counters": {k: load.server_counters[k] for k in sorted(load.server_counters)
                            if k.startswith(("vllm:request_success", "vllm:generation_tokens",
                                             "vllm:prompt_tokens", "vllm:admission"))},
        "server_path": server,
        "simulated": sim,
        "added_latency_ms": added_latency(server, sim),
        "added_ttft_per_request_ms": added_ttft_per_request(records, simulated),
    }


def simulated_server(python: str, model: str, gpu: str, profile: str | None, seed: int,
                     max_model_len: int | None, max_num_seqs: int | None) -> tuple[str, ...]:
    """The `rt serve --simulate` command line the load test starts (its host and port are
    appended by `run_load`)."""
    command = [python, "-m", "cli", "serve", "--simulate", "--sim-model", model, "--gpu", gpu,
               "--seed", str(seed)]
    command += ["--max-model-len", str(max_model_len)] if max_model_len else []
    command += ["--profile", profile] if profile else []
    command += ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []
    return tuple(command)


def run_soak_load(config: LoadConfig, seconds: float, input_len: int, output_len: int
                  ) -> dict[str, Any]:
    """`rt bench serve --soak`: start the server, hold `config.concurrency` streams for
    `seconds` (`backends.bench.soak`), stop it; the soak report plus the server's exit code."""
    from backends.bench.soak import SoakConfig, run_soak

    soak = SoakConfig(seconds, config.concurrency, input_len, output_len, config.vocab_size,
                      config.seed, request_timeout_s=config.request_timeout_s)
    with serving(config) as server:
        pids = server_pids(server, config)
        report = run_soak(server.url, pids, soak)
    return {**report, "server_exit_code": server.proc.returncode}
