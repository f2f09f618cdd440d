"""`rt replay TRACE --endpoint URL` against `rt serve` subprocesses (the tiny Llama on the CPU,
and --simulate) on a free loopback port, and Ctrl-C during a replay against the fake server:
the records so far are written, exit 130."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")
fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from typer.testing import CliRunner  # noqa: E402

from analysis.rundir import load_run  # noqa: E402
from cli import app  # noqa: E402
from tests.backends.replay.fake_endpoint import (  # noqa: E402
    ROOT,
    FakeServer,
    endpoint_trace,
    rt_serve,
    running_fake_server,
)
from workloads import Trace, write_rt_jsonl  # noqa: E402

cli_runner = CliRunner()
fake_server = pytest.fixture(running_fake_server, name="fake_server")
trace = pytest.fixture(endpoint_trace, name="trace")


# ---- against `rt serve` (a subprocess on a free loopback port) ---------------------------


@pytest.mark.parametrize("serve_args, vocab", [
    (["--max-model-len", "256", "--num-gpu-blocks-override", "64"], 512),  # tiny Llama, CPU
    (["--simulate", "--gpu", "h200", "--max-model-len", "4096"], 32000),
], ids=["tiny", "simulate"])
def test_replay_against_rt_serve_gives_the_trace_token_counts(
        serve_args: list[str], vocab: int, trace: Trace, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.jsonl"
    write_rt_jsonl(trace, trace_file)
    out = tmp_path / "run"
    with rt_serve(serve_args) as url:
        result = cli_runner.invoke(app, ["replay", str(trace_file), "--endpoint", url,
                                         "--vocab-size", str(vocab), "--result-dir", str(out),
                                         "--timeout", "60"])
    assert result.exit_code == 0, result.output
    run = load_run(out)
    assert run.info["failed"] == 0, run.info["errors"]
    assert list(run.requests["output_len"]) == [req.output_len for req in trace]
    assert set(run.requests["status"]) == {"FINISHED_LENGTH_CAPPED"}
    assert all(len(t) >= 1 for t in run.requests["token_times_s"])


def test_ctrl_c_writes_the_records_so_far_and_exits_130(
        fake_server: FakeServer, trace: Trace, tmp_path: Path) -> None:
    fake_server.state.hang_first_s = 30.0  # r0 is still in flight at the interrupt
    trace_file = tmp_path / "trace.jsonl"
    write_rt_jsonl(trace, trace_file)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "replay", str(trace_file), "--endpoint", fake_server.url,
         "--result-dir", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    state = fake_server.state
    # every request sent and every one but r0 (hanging) answered in full by the server;
    # then 0.3 s for the client to read the last answers (not a whole answer's time)
    while state.seen < len(trace) or state.in_flight > 1:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "rt: interrupted" in stderr
    run = load_run(out)
    assert run.info["interrupted"] is True and run.info["errors"] == {"r0": "interrupted"}
    assert (run.requests["status"] == "FINISHED_ABORTED").sum() == 1
