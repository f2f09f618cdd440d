"""Ground truth for `rt fidelity TRACE --endpoint URL` on the loopback: `rt serve --simulate
--profile P --step-noise` (known step costs and scatter, on the wall clock) is replayed,
fitted from its client timings alone and simulated; the simulated p50/p90 TTFT and ITL
must be within 15% of the real ones (or twice the real runs' own spread), out of sample.
Also: the server's KV pool is read from its /metrics (not given as flags), and the sources
are recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from typer.testing import CliRunner  # noqa: E402

from cli import app  # noqa: E402
from sim.endpoint_config import METRICS  # noqa: E402
from tests.backends.replay.test_endpoint_replay import _rt_serve  # noqa: E402
from workloads import ArrivalProcess, write_rt_jsonl  # noqa: E402
from workloads.synthetic import RandomLengths, random_trace  # noqa: E402

# Steps of 18-40 ms: the client's and the server's jitter (0.3-1 ms on an idle 2-core VM, a
# few ms at load 8) stays small beside them (with 4 ms + 20 us/token steps at load 7: p50
# TTFT -11%). Scatter: step factors uniform in [0.7, 1.3].
P = {"constant_s": 16e-3, "per_prefill_token_s": 80e-6, "per_decode_token_s": 600e-6,
     "per_seq_s": 0.0, "per_prefill_attention_pair_s": 0.0, "per_decode_kv_token_s": 2e-6}
SCATTER = [0.7 + 0.6 * i / 20 for i in range(21)]
KV = ["--max-model-len", "4096", "--num-gpu-blocks-override", "4000"]  # exported, not given
BATCH = ["--max-num-batched-tokens", "512", "--max-num-seqs", "64"]
BUSY_LOAD = 3.0  # 1-minute load average above which the wall-clock truth is not one


@pytest.mark.slow  # ~60 s: a warm-up and four 12-s replays of 30 requests, 8 simulations
def test_fidelity_against_a_served_profile_is_within_15_percent(tmp_path: Path) -> None:
    if os.getloadavg()[0] > BUSY_LOAD:  # checked when the test runs, not at collection
        pytest.skip(f"the machine is busy (load average > {BUSY_LOAD}): the served steps "
                    "would take what the other work leaves them, not P's time; "
                    "tests/sim/test_endpoint_fidelity.py checks the loop deterministically")
    profile = tmp_path / "P.json"
    profile.write_text(json.dumps({
        "format": "rt-profile", "version": 1, "device": "test", "model": "test",
        "dtype": "float32", "versions": {}, "date": "2026-01-01", "coefficients": P,
        "api_server": {"per_request_s": 0.0, "per_prompt_token_s": 0.0},
        "step_time_quantiles": SCATTER}))
    trace_file = tmp_path / "trace.jsonl"
    write_rt_jsonl(random_trace(30, RandomLengths(200, 24, 0.5), ArrivalProcess(2.5, 1.0, 4)),
                   trace_file)
    root = tmp_path / "fidelity"
    with _rt_serve(["--simulate", "--profile", str(profile), "--step-noise", *KV, *BATCH]) \
            as url:
        result = CliRunner().invoke(app, [
            "fidelity", str(trace_file), "--endpoint", url, *BATCH, "--repeats", "2",
            "--timeout", "60", "--result-dir", str(root), "--no-plots",
            "--warmup-requests", "10"])  # a simulating server has no slow start
    report = json.loads((root / "fidelity.json").read_text())
    errors = {k: report["metrics"][k] for k in ("p50_ttft_ms", "p90_ttft_ms", "p50_itl_ms",
                                                "p90_itl_ms")}
    assert result.exit_code == 0, (errors, result.output[-3000:])
    # 15%, or twice the real runs' own spread where that is wider: on the quiet 2-core CI
    # machine two replays of these 30 requests differ by 0.4-8% at p50/p90 TTFT (the server,
    # the client and pytest share the cores), and the worst of the four metrics in six runs
    # of 2026-12-01 was -9.2%, -13.3% (noise 8%), -7.2%, +10.9% (noise 2.5%), -7.6%, -7.0%:
    # the p50 TTFT of 30 requests, fitted from two replays of 30 others, scatters by ~8%
    # (one sigma) around the truth. The 5% of the issue holds on longer runs
    # (docs/calibration.md), not on 30 requests; a fit that is off by a term fails here.
    for row in errors.values():
        assert abs(row["error"]) <= max(0.15, 2 * row["noise"]), errors
    endpoint = json.loads((root / "real" / "run.json").read_text())["endpoint"]
    assert endpoint["cache_config"] == {"block_size": 16, "num_gpu_blocks": 4000,
                                        "enable_prefix_caching": True}
    assert endpoint["max_model_len"] == 4096
    sim = json.loads((root / "sim" / "run.json").read_text())
    assert sim["server_config_from"]["num_blocks"] == METRICS
    assert sim["server_config_from"]["max_num_batched_tokens"] == "flag"
    assert report["steps"] is None  # a client sees no steps
    assert report["warmup"]["requests"] == 10 and len(report["warmup"]["windows"]) == 1
    assert report["calibration_runs"] == 2 and "drift" in report["metrics"]["p50_itl_ms"]
