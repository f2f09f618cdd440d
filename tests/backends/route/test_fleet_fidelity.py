"""Replica attribution of a real run through `rt route` (the x-rt-replica header, the
`replica` column of `rt replay --endpoint`, checked against the router's own /metrics), and
a small bounded `rt fidelity --fleet` on loopback that leaves no process behind. Every wait
is bounded."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.backends.route.procs import ROOT, SIMULATED, Rt

pytest.importorskip("prometheus_client")

from analysis.fleet import replica_table  # noqa: E402
from analysis.rundir import load_run, save_result  # noqa: E402
from backends.replay.endpoint import replay_endpoint  # noqa: E402
from backends.replay.endpoint_probe import EndpointConfig, probe  # noqa: E402
from backends.route.overheads import histogram_quantile, parse_router_metrics  # noqa: E402
from workloads import Trace, TraceRequest, write_rt_jsonl  # noqa: E402
from workloads.flags import WorkloadFlags, load_workload  # noqa: E402


def conversations(num_prompts: int, rate: float = 4.0, spacing_s: float | None = None
                  ) -> Trace:
    """Multi-turn conversations of 4 turns (0.5 s apart), short outputs; with `spacing_s`,
    the same requests in the same order `spacing_s` apart (so that no two can reach a real
    router in the other order, which would change which replica holds which prefix)."""
    flags = WorkloadFlags(dataset_name="multi_turn", num_prompts=num_prompts, input_len=96,
                          output_len=6, turns=4, turn_gap_s=0.5, request_rate=rate, seed=3)
    trace = load_workload(flags).trace
    if spacing_s is None:
        return trace
    return Trace(tuple(dataclasses.replace(req, arrival_s=i * spacing_s)
                       for i, req in enumerate(trace)), trace.name)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[list[Rt], Rt]]:
    backends: list[Rt] = []
    router: Rt | None = None
    try:
        backends = [Rt(SIMULATED), Rt(SIMULATED)]
        urls = [a for b in backends for a in ("--backend", b.url)]
        router = Rt(["route", *urls, "--router", "round-robin"], timeout_s=30)
        yield backends, router
    finally:
        if router is not None:
            router.stop()
        for backend in backends:
            backend.stop()


def test_every_forwarded_response_names_its_replica(fleet: tuple[list[Rt], Rt]) -> None:
    _, router = fleet
    body = {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}
    seen = []
    for stream in (False, True, False, True):
        response = httpx.post(f"{router.url}/v1/completions", json={**body, "stream": stream},
                              timeout=30)
        assert response.status_code == 200
        seen.append(response.headers["x-rt-replica"])
    chat = httpx.post(f"{router.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.headers["x-rt-replica"] in ("0", "1")
    assert seen in (["0", "1", "0", "1"], ["1", "0", "1", "0"])  # round-robin, both kinds


def test_a_replay_through_the_router_records_each_request_s_replica(
        fleet: tuple[list[Rt], Rt], tmp_path: Path) -> None:
    backends, router = fleet
    before = parse_router_metrics(httpx.get(f"{router.url}/metrics", timeout=5).text,
                                  [b.url for b in backends]).requests
    trace = conversations(12, rate=8.0)
    config = EndpointConfig(url=router.url, timeout_s=60.0)
    result = replay_endpoint(trace, config, probe(config))
    text = httpx.get(f"{router.url}/metrics", timeout=5).text
    after = parse_router_metrics(text, [b.url for b in backends]).requests
    assert result.num_failed == 0
    replicas = [r.replica for r in result.requests]  # type: ignore[attr-defined]
    assert sorted(set(replicas)) == [0, 1]
    counts = [replicas.count(0), replicas.count(1)]
    assert counts == [a - b for a, b in zip(after, before, strict=True)]  # the router's own
    # written and read back as a fleet run: shares and hit rates per replica
    run = save_result(tmp_path / "real", "endpoint", {"name": "t", "requests": 12,
                                                      "digest": "-"}, result,
                      {"timing": "client", "cached_tokens_reported": 12})
    table = replica_table(run.requests, run.steps)
    assert list(table["requests"]) == counts
    assert list(table["share"]) == [c / 12 for c in counts]
    assert table["prefix_hit_rate"].sum() > 0  # rt serve reports cached tokens


def test_a_replay_without_router_has_no_replica_column(fleet: tuple[list[Rt], Rt]) -> None:
    backends, _ = fleet
    config = EndpointConfig(url=backends[0].url, timeout_s=60.0)
    result = replay_endpoint(conversations(2, rate=20.0), config, probe(config))
    assert result.num_failed == 0
    assert all("replica" not in r.to_row() for r in result.requests)


ROUTER_METRICS = """\
# TYPE rt_router_requests_total counter
rt_router_requests_total{backend="http://a"} 3.0
rt_router_requests_total{backend="http://b"} 5.0
# TYPE rt_router_routing_latency_seconds histogram
rt_router_routing_latency_seconds_bucket{le="0.001"} 2.0
rt_router_routing_latency_seconds_bucket{le="0.002"} 6.0
rt_router_routing_latency_seconds_bucket{le="+Inf"} 8.0
rt_router_routing_latency_seconds_count 8.0
rt_router_routing_latency_seconds_sum 0.016
# TYPE rt_router_retries_total counter
rt_router_retries_total 1.0
"""


def test_router_overheads_are_read_from_its_metrics() -> None:
    o = parse_router_metrics(ROUTER_METRICS, ["http://b", "http://a", "http://c"])
    assert o.requests == (5.0, 3.0, 0.0)
    assert o.routing_latency_mean_s == pytest.approx(0.002)
    assert o.routing_latency_p50_s == pytest.approx(0.0015)  # rank 4: half-way in (1, 2] ms
    assert o.routing_latency_p99_s == pytest.approx(0.002)  # in +Inf: the last finite bound
    assert math.isnan(o.scrape_age_mean_s) and o.retries == 1.0
    assert math.isnan(histogram_quantile(0.5, [(math.inf, 0.0)]))


def _rt_processes(marker: str) -> list[int]:
    """Live processes whose command line has `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker.encode() in cmdline and state != "Z":
                found.append(int(entry))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_fidelity_fleet_compares_a_real_fleet_with_its_simulation(tmp_path: Path) -> None:
    trace = tmp_path / "conversations.jsonl"
    write_rt_jsonl(conversations(16, spacing_s=0.2), trace)
    seed = "4243"  # marks this test's processes
    done = subprocess.run(
        [sys.executable, "-m", "cli", "fidelity", str(trace), "--fleet", "--replicas", "2",
         "--router", "round-robin", "--max-model-len", "4096", "--seed", seed,
         "--result-dir", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert not _rt_processes(f"--seed {seed}")  # the replicas and the router are gone
    report = json.loads((tmp_path / "out" / "fleet_fidelity.json").read_text())
    assert report["replicas"] == 2 and report["failed"] == {"real": 0, "sim": 0}
    assert report["share"]["real"] == report["share"]["sim"] == [0.5, 0.5]
    assert report["router_overheads"]["real"]["requests"] == [8.0, 8.0]
    assert abs(report["prefix_hit_rate"]["points"]) <= 3.0
    assert report["prefix_hit_rate"]["real"] > 0.3
    real = load_run(tmp_path / "out" / "real")
    assert list(real.requests["replica"].value_counts().sort_index()) == [8, 8]
    sim = load_run(tmp_path / "out" / "sim")
    latency_ms = report["router_overheads"]["real"]["routing_latency_mean_s"] * 1e3
    assert sim.info["fleet"]["routing_latency_ms"] == pytest.approx(latency_ms)
    assert sim.info["fleet"]["router_refresh_ms"] == 50.0  # round-robin reads no gauge
    assert "fleet of 2 behind round-robin" in done.stdout
    # the serving stack: fitted on calibration windows of as many other requests, half
    # before the measured replay, half after (each its own router: the measured router
    # counted only the trace's)
    for name in ("calibration", "calibration-after"):
        calibration = load_run(tmp_path / "out" / name)
        assert len(calibration.requests) == 8 and calibration.info["failed"] == 0
    stack = report["serving_stack"]
    # but the cold ones: the first and those arriving before its first token (as timed)
    model = stack["model"]
    cold = model["cold_left_out"]
    assert model["fitted"] and cold >= 1 and model["requests"] == 16 - cold
    assert stack["model"]["per_request_ms"] > 0
    assert sim.info["fleet"]["serving_stack"]["per_request_ms"] == pytest.approx(
        stack["model"]["per_request_ms"])  # a delay after routing, not the API server's
    assert stack["model"]["spread"]["residuals"] == 16 - cold
    assert stack["model"]["drawn"]["requests"] == 16
    assert sim.info["api_server"]["per_request_s"] == 0.0
    split = stack["real_split"]
    parts = ("routing_mean_ms", "hops_mean_ms", "api_ipc_mean_ms", "engine_mean_ms")
    assert sum(split[p] for p in parts) == pytest.approx(split["client_ttft_mean_ms"])
    assert split["engine_mean_ms"] > 0 and split["api_ipc_mean_ms"] > 0
    assert (f"serving stack (fitted on 2 calibration windows (before and after the measured "
            f"replay, pooled) of {16 - cold} other requests, {cold} arriving before the first "
            "one's first token left out (cold))") in done.stdout
    floor = model["noise_floor"]  # windows of 8 or fewer: too short to fit alone (10)
    assert not floor["measured"] and floor["why"].startswith("the before window: ")
    assert "noise floor" in done.stdout


def test_the_calibration_windows_are_the_same_requests_around_the_measured_one() -> None:
    """Both windows replay the first ceil(n / 2) requests of the resampled calibration trace
    (ids, lengths, arrivals), the one before with token seed + 1, the one after with seed
    + 2, the measured trace with seed: other prompts in each replay."""
    from backends.route import fleet_fidelity as ff

    trace = conversations(9)
    whole = ff.calibration_trace(trace, 5)
    before, after = ff.calibration_windows(trace, 5)
    assert [r.request_id for r in before] == [str(i) for i in range(5)]
    assert before.requests == after.requests == whole.requests[:5]
    assert (before.name, after.name) == (f"{whole.name}:before", f"{whole.name}:after")
    replays = ff._replay_traces(trace, 5)
    assert list(replays) == list(ff.REPLAYS)
    assert [seed for _, seed in replays.values()] == [6, 5, 7]
    one = ff._replay_traces(Trace((TraceRequest("a", 0.0, 16, 4),)), 5)
    assert [len(t) for t, _ in one.values()] == [1, 1, 1]


@pytest.mark.parametrize(("args", "message"), [
    (("--repeats", "2"), "--fleet does not take --repeats"),
    (("--router", "nope"), "unknown router policy 'nope'"),
    (("--replicas", "0"), "--replicas must be >= 1, got 0"),
])
def test_fidelity_fleet_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...],
                                                          message: str) -> None:
    trace = tmp_path / "t.jsonl"
    write_rt_jsonl(conversations(4), trace)
    done = subprocess.run([sys.executable, "-m", "cli", "fidelity", str(trace), "--fleet", *args,
                           "--result-dir", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
