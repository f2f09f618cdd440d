"""`rt replay TRACE --endpoint URL` against a fake OpenAI-compatible streaming server on the
loopback (FastAPI + uvicorn in a thread): token counts, client-side timing, the run directory
(`rt report` and `rt compare` with a simulation of the same trace), failures counted, and
one-line errors for a bad endpoint."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("httpx")
fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from typer.testing import CliRunner  # noqa: E402

from analysis.rundir import load_run  # noqa: E402
from backends.replay.endpoint import _sse_lines, replay_endpoint  # noqa: E402
from backends.replay.endpoint_probe import (  # noqa: E402
    EndpointConfig,
    EndpointError,
    completions_url,
    probe,
)
from cli import app  # noqa: E402
from runtime.records import PART_COLUMNS, RequestRecord  # noqa: E402
from tests.backends.replay.fake_endpoint import (  # noqa: E402
    CHUNK_GAP_S,
    FIRST_CHUNK_DELAY_S,
    MODEL,
    FakeServer,
    closed_port,
    config_for,
    endpoint_trace,
    running_fake_server,
)
from tests.backends.replay.fake_endpoint import rt_serve as _rt_serve  # noqa: E402, F401 (imported from here by other tests)
from workloads import Trace, TraceRequest, write_rt_jsonl  # noqa: E402

cli_runner = CliRunner()
fake_server = pytest.fixture(running_fake_server, name="fake_server")
trace = pytest.fixture(endpoint_trace, name="trace")


def test_completions_url_accepts_root_v1_and_full_urls() -> None:
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/",
                "http://h:8000/v1/completions"):
        assert completions_url(url) == "http://h:8000/v1/completions"
    for bad in ("h:8000", "ftp://h/v1", "not a url", "http://"):
        with pytest.raises(EndpointError):
            completions_url(bad)
    # badinput23: once "cannot reach ...: Connection refused", the port never named
    with pytest.raises(EndpointError, match=r"^--endpoint 'http://h:99999': port 99999 is "
                       r"not in \[1, 65535\]$"):
        completions_url("http://h:99999")


def test_replay_records_every_request_with_client_side_timing(
        fake_server: FakeServer, trace: Trace) -> None:
    fake_server.state.tokens_per_chunk = 2  # several tokens per chunk: one time per chunk
    config = config_for(fake_server, vocab_size=512, seed=3)
    info = probe(config)
    assert (info.model, info.max_model_len) == (MODEL, 4096)
    result = replay_endpoint(trace, config, info)
    assert not result.errors and result.num_failed == 0 and not result.interrupted
    by_id = {r.request_id: r for r in result.requests}
    assert list(by_id) == [req.request_id for req in trace]
    all_gaps: list[float] = []
    for req in trace:
        rec = by_id[req.request_id]
        assert rec.status == "FINISHED_LENGTH_CAPPED" and rec.finish_reason == "length"
        assert (rec.output_len, rec.max_tokens, rec.prompt_len) == (
            req.output_len, req.output_len, req.prompt_len)
        assert len(rec.token_times_s) == math.ceil(req.output_len / 2)
        # released at its arrival time (a little after, never before)
        assert req.arrival_s - 1e-3 <= rec.arrival_s <= req.arrival_s + 0.5
        assert rec.first_token_s is not None and rec.finish_s is not None
        ttft = rec.first_token_s - rec.arrival_s
        assert FIRST_CHUNK_DELAY_S * 0.9 <= ttft < 2.0
        gaps = [b - a for a, b in zip(rec.token_times_s, rec.token_times_s[1:], strict=False)]
        assert all(0.0 <= g < 1.0 for g in gaps), gaps
        all_gaps += gaps
        assert rec.first_token_s == rec.token_times_s[0]
        assert rec.finish_s == rec.token_times_s[-1]
        # server-side boundaries are unknown client-side: NaN, not 0
        for name in ("queued_s", "engine_queued_s", "first_scheduled_s", *PART_COLUMNS):
            assert math.isnan(getattr(rec, name)), name
    # per-chunk gaps follow the server's sleeps (two chunks read together give ~0: median)
    assert CHUNK_GAP_S * 0.5 <= sorted(all_gaps)[len(all_gaps) // 2] < 0.5
    body = fake_server.state.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert all(isinstance(t, int) and 10 <= t < 512 for t in body["prompt"])
    assert sorted(len(b["prompt"]) for b in fake_server.state.bodies) == sorted(
        req.prompt_len for req in trace)


def test_max_concurrency_caps_requests_in_flight(fake_server: FakeServer,
                                                 trace: Trace) -> None:
    config = config_for(fake_server, max_concurrency=2)
    result = replay_endpoint(trace, config, probe(config))
    assert result.num_failed == 0
    assert fake_server.state.peak_in_flight <= 2


def test_missing_usage_falls_back_to_the_chunk_count(fake_server: FakeServer,
                                                     trace: Trace) -> None:
    fake_server.state.usage = False
    config = config_for(fake_server)
    result = replay_endpoint(trace, config, probe(config))
    assert result.usage_missing == len(trace)
    assert [r.output_len for r in result.requests] == [req.output_len for req in trace]


def test_text_with_unicode_line_separators_stays_one_chunk(fake_server: FakeServer,
                                                           trace: Trace) -> None:
    fake_server.state.text = "a\u2028b\x85c\u2029"  # raw in JSON, no SSE line ends
    config = config_for(fake_server)
    result = replay_endpoint(trace, config, probe(config))
    assert result.errors == {}
    assert [len(r.token_times_s) for r in result.requests] == [req.output_len for req in trace]


def test_failures_and_timeouts_are_recorded_not_raised(fake_server: FakeServer,
                                                       trace: Trace) -> None:
    fake_server.state.fail_every = 4  # 3 of 12 get HTTP 500
    fake_server.state.hang_first_s = 2.0  # the first request times out
    config = config_for(fake_server, timeout_s=0.5)
    result = replay_endpoint(trace, config, probe(config))
    failed = [r for r in result.requests if r.status == "FINISHED_ABORTED"]
    assert len(result.requests) == len(trace) and len(failed) == 4 == result.num_failed
    assert all(r.finish_reason == "abort" and r.finish_s is not None for r in failed)
    messages = sorted(result.errors[r.request_id] for r in failed)
    assert sum("HTTP 500: injected failure" in m for m in messages) == 3
    assert sum("timed out after 0.5 s" in m for m in messages) == 1


def test_probe_errors_name_the_problem(fake_server: FakeServer) -> None:
    with pytest.raises(EndpointError, match="does not serve model 'other'"):
        probe(config_for(fake_server, model="other"))
    with pytest.raises(EndpointError, match="cannot reach"):
        probe(EndpointConfig(f"http://127.0.0.1:{closed_port()}"))


def test_cli_writes_the_run_directory_and_compares_with_a_simulation(
        fake_server: FakeServer, trace: Trace, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.jsonl"
    write_rt_jsonl(trace, trace_file)
    out = tmp_path / "endpoint"
    result = cli_runner.invoke(app, [
        "replay", str(trace_file), "--endpoint", f"{fake_server.url}/v1",
        "--served-model-name", MODEL, "--result-dir", str(out), "--vocab-size", "512"])
    assert result.exit_code == 0, result.output
    assert "Serving Benchmark Result" in result.stdout
    assert "Successful requests:                     12" in result.stdout
    run = load_run(out)
    assert run.info["kind"] == "endpoint" and run.info["timing"] == "client"
    assert run.info["model"] == {"name": MODEL}
    assert run.info["endpoint"]["url"] == f"{fake_server.url}/v1/completions"
    assert run.steps.empty and len(run.requests) == len(trace)
    assert set(run.requests.columns) >= {f.name for f in RequestRecord.__dataclass_fields__
                                         .values()}
    assert list(run.requests["output_len"]) == [req.output_len for req in trace]
    report = cli_runner.invoke(app, ["report", str(out), "--no-plots"])
    assert report.exit_code == 0, report.output

    sim = tmp_path / "sim"
    simulated = cli_runner.invoke(app, ["simulate", "--trace", str(trace_file),
                                        "--result-dir", str(sim)])
    assert simulated.exit_code == 0, simulated.output
    table_csv = tmp_path / "compare.csv"
    compared = cli_runner.invoke(app, ["compare", str(sim), str(out), "--no-plots",
                                       "--csv", str(table_csv)])
    assert compared.exit_code == 0, compared.output
    table = pd.read_csv(table_csv, index_col="metric")
    assert list(table.loc["completed"].iloc[:2]) == [12, 12]
    assert list(table.loc["failed"].iloc[:2]) == [0, 0]
    assert "mean_ttft_ms" in table.index and "p99_itl_ms" in table.index


def test_cli_counts_failures_and_exits_zero(fake_server: FakeServer, trace: Trace,
                                            tmp_path: Path) -> None:
    fake_server.state.fail_every = 3
    trace_file = tmp_path / "trace.jsonl"
    write_rt_jsonl(trace, trace_file)
    out = tmp_path / "run"
    result = cli_runner.invoke(app, ["replay", str(trace_file), "--endpoint",
                                     fake_server.url, "--result-dir", str(out)])
    assert result.exit_code == 0, result.output
    assert "Failed requests:                         4" in result.stdout
    assert "rt: note: 4 of 12 requests failed" in result.stderr
    info = load_run(out).info
    assert info["failed"] == 4 and len(info["errors"]) == 4


def test_cli_every_request_failing_exits_one(fake_server: FakeServer, trace: Trace,
                                             tmp_path: Path) -> None:
    fake_server.state.fail_every = 1
    trace_file = tmp_path / "trace.jsonl"
    write_rt_jsonl(trace, trace_file)
    result = cli_runner.invoke(app, ["replay", str(trace_file), "--endpoint",
                                     fake_server.url, "--result-dir", str(tmp_path / "run")])
    assert result.exit_code == 1
    assert "every request failed" in result.stderr


@pytest.mark.parametrize("url", ["not-a-url", "ftp://127.0.0.1/v1", None])
def test_cli_bad_endpoint_is_one_line_exit_2(url: str | None, tmp_path: Path) -> None:
    url = url or f"http://127.0.0.1:{closed_port()}"
    result = cli_runner.invoke(app, ["replay", "--first-n", "2", "--endpoint", url,
                                     "--result-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rt: error: "), result.stderr
    assert not (tmp_path / "run").exists()


def test_cli_negative_warm_up_is_one_line_exit_2(tmp_path: Path) -> None:
    """`rt fidelity --endpoint --warmup-requests -1`: refused before any request is sent."""
    url, trace_file = f"http://127.0.0.1:{closed_port()}", tmp_path / "t.jsonl"
    write_rt_jsonl(Trace((TraceRequest("a", 0.0, 10, 2),)), trace_file)
    result = cli_runner.invoke(app, ["fidelity", str(trace_file), "--endpoint", url,
                                     "--warmup-requests", "-1",
                                     "--result-dir", str(tmp_path / "fid")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "rt: error: --warmup-requests must be >= 0, got -1"]
    assert not (tmp_path / "fid").exists()


def test_sse_lines_split_at_sse_line_ends_only() -> None:
    """`\\r\\n` split across reads is one line end; a bare `\\r` ends a line; U+2028 (its
    UTF-8 bytes split across reads) stays inside its line; the last line needs no end."""
    parts = [b"data: a\r", b"\ndata: b\rdata: c\n", b"data: \xe2\x80", b"\xa8x\r\n\r\n",
             b"data: end"]

    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    async def lines() -> list[str]:
        return [line async for line in _sse_lines(body())]

    assert asyncio.run(lines()) == ["data: a", "data: b", "data: c", "data: \u2028x", "",
                                    "data: end"]
