"""Ground truth on the loopback: `rt serve --simulate --profile P` (known step costs, on the
wall clock) replayed with `rt replay --endpoint`, then `rt calibrate --from-run` on the
client's chunk times alone gives P's step coefficients back.

A long request keeps the engine busy through the replay: `rt serve`'s engine loop starts the
first step after an idle wait at the previous step's end (`backends/serve/engine_process.py`
`step`: `busy` is still True after the blocking receive), so that step's sleep is cut short
and the server is faster than P after every idle period."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from typer.testing import CliRunner  # noqa: E402

from cli import app  # noqa: E402
from tests.backends.replay.test_endpoint_replay import _rt_serve  # noqa: E402
from workloads import ArrivalProcess, Trace, TraceRequest, write_rt_jsonl  # noqa: E402
from workloads.synthetic import RandomLengths, random_trace  # noqa: E402

P = {"constant_s": 4e-3, "per_prefill_token_s": 20e-6, "per_decode_token_s": 150e-6,
     "per_seq_s": 0.0, "per_prefill_attention_pair_s": 0.0, "per_decode_kv_token_s": 0.5e-6}
ENGINE = ["--max-model-len", "4096", "--max-num-batched-tokens", "512", "--max-num-seqs", "64",
          "--num-gpu-blocks-override", "4000"]


BUSY_LOAD = 3.0  # 1-minute load average above which a wall-clock fit is not meaningful here


@pytest.mark.slow  # wall-clock: on a 2-core VM at load 6 the prefill term was lost (open)
def test_calibrate_from_run_recovers_the_served_profile(tmp_path: Path) -> None:
    if os.getloadavg()[0] > BUSY_LOAD:  # checked when the test runs: collection is minutes
        # earlier in a full suite (in CI, just after pip's install), at another load
        pytest.skip(f"the machine is busy (load average > {BUSY_LOAD}): a wall-clock "
                    "calibration would measure the other work; "
                    "tests/sim/test_client_calibrate.py checks the estimator deterministically")
    profile = tmp_path / "P.json"
    profile.write_text(json.dumps({
        "format": "rt-profile", "version": 1, "device": "test", "model": "test",
        "dtype": "float32", "versions": {}, "date": "2026-01-01", "coefficients": P,
        "api_server": {"per_request_s": 0.0, "per_prompt_token_s": 0.0}}))
    trace = random_trace(40, RandomLengths(300, 32, 0.8), ArrivalProcess(10.0, 1.0, 2))
    keeper = TraceRequest("keep", 0.0, 16, 1000)  # busy through the replay (see above)
    trace_file = tmp_path / "trace.jsonl"
    write_rt_jsonl(Trace((keeper, *trace.requests)), trace_file)
    run = tmp_path / "run"
    runner = CliRunner()
    with _rt_serve(["--simulate", "--profile", str(profile), *ENGINE]) as url:
        replay = runner.invoke(app, ["replay", str(trace_file), "--endpoint", url,
                                     "--result-dir", str(run), "--timeout", "60"])
    assert replay.exit_code == 0, replay.output
    fitted = tmp_path / "fit.json"
    result = runner.invoke(app, ["calibrate", "--from-run", str(run), *ENGINE[2:],
                                 "-o", str(fitted)])
    assert result.exit_code == 0, result.output
    fit = json.loads(fitted.read_text())
    c = fit["coefficients"]
    # The live executor sleeps at least P's time, and the server's own loop (HTTP, IPC,
    # streaming each token; the client shares the 2 loaded cores) adds to it: ~0.5 ms a step
    # idle, and up to ~2x P's per-decode cost when the machine is busy (measured). So the
    # fit is P or slower, the prefill term (9 ms of a 450-token step) P's.
    assert 0.85 * P["constant_s"] <= c["constant_s"] <= 1.5 * P["constant_s"]
    # The prefill term: within 35% (a quiet fresh-clone CI run on 2026-12-01 fitted -30% once,
    # the step splits of a client that shares the two cores moving its few prefill steps).
    assert c["per_prefill_token_s"] == pytest.approx(P["per_prefill_token_s"], rel=0.35)
    decode = c["per_decode_token_s"] + c["per_seq_s"]  # barely separable: their sum
    assert decode >= 0.8 * P["per_decode_token_s"]
    for key in ("p50_ttft", "p50_itl"):
        assert abs(fit["fit"]["in_sample"][key]["error"]) < 0.15, fit["fit"]["in_sample"]
