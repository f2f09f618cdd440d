"""A `vllm bench serve --save-result --save-detailed` JSON read as a run: `rt report` gives
vLLM's own numbers back, `rt compare` puts it beside an rt run of the same requests, and a
file without the per-request arrays is one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from analysis.report import result_dict
from analysis.rundir import load_run, run_info, write_run
from cli import app

from .conftest import HAND_STEPS, request

runner = CliRunner()

# Three requests as vLLM 0.32 records them (seconds; perf_counter start times): two
# successes with chunk gaps, one failure (output 0, error text, no chunks).
START = [100.0, 100.4, 101.0]
TTFT = [0.1, 0.2, 0.0]
ITLS = [[0.05, 0.1], [0.02], []]
LATENCY = [0.25, 0.22, 0.0]


def vllm_result(**extra: Any) -> dict[str, Any]:
    result = {
        "date": "20260101-000000", "endpoint_type": "openai", "backend": "openai",
        "label": None, "model_id": "tiny", "tokenizer_id": "tiny", "num_prompts": 3,
        "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None, "duration": 1.3,
        "completed": 2, "failed": 1, "total_input_tokens": 20, "total_output_tokens": 5,
        "request_throughput": 1.5, "request_goodput": None, "output_throughput": 3.8,
        "total_token_throughput": 19.0, "input_lens": [10, 10, 10], "output_lens": [3, 2, 0],
        "ttfts": TTFT, "itls": ITLS, "latencies": LATENCY, "start_times": START,
        "queue_times": [0.0, 0.0, 0.0], "generated_texts": ["abc", "de", ""],
        "errors": ["", "", "HTTP 500"], "max_output_tokens_per_s": 5.0,
        "max_concurrent_requests": 2, "mean_ttft_ms": 150.0, "median_ttft_ms": 150.0,
        "std_ttft_ms": 50.0, "p99_ttft_ms": 199.0,
    }
    return result | extra


@pytest.fixture
def bench_file(tmp_path: Path) -> Path:
    path = tmp_path / "openai-infqps-tiny-20260101-000000.json"
    path.write_text(json.dumps(vllm_result()))
    return path


def test_report_of_a_vllm_file_gives_vllms_numbers(bench_file: Path) -> None:
    run = load_run(bench_file)
    assert run.info["timing"] == "client" and run.steps.empty
    result = result_dict(run)
    assert (result["completed"], result["failed"]) == (2, 1)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (20, 5)
    assert result["mean_ttft_ms"] == pytest.approx(150.0)
    assert result["p99_ttft_ms"] == pytest.approx(199.0)
    itls = np.array([0.05, 0.1, 0.02]) * 1e3  # vLLM pools every gap
    assert result["mean_itl_ms"] == pytest.approx(itls.mean())
    # TPOT = (latency - ttft) / (output - 1): (0.25 - 0.1) / 2 and (0.22 - 0.2) / 1
    assert result["mean_tpot_ms"] == pytest.approx((75.0 + 20.0) / 2)
    assert result["max_concurrent_requests"] == 2  # vLLM's value for these requests
    assert result["request_rate"] == "inf"
    for key in ("mean_request_queue_time_ms", "num_engine_steps", "mean_kv_cache_usage",
                "prefix_cache_hit_rate"):
        assert result[key] is None, key


def test_rt_report_and_compare_take_the_file(bench_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = runner.invoke(app, ["report", str(bench_file), "--result-filename", str(out),
                               "--no-plots"])
    assert done.exit_code == 0, done.output
    assert "Serving Benchmark Result" in done.stdout and "timing: client" in done.stdout
    assert json.loads(out.read_text())["completed"] == 2
    rt_run = tmp_path / "rt"
    write_run(rt_run, [request("0", 0.0, [0.1, 0.15, 0.25]), request("1", 0.4, [0.6, 0.62]),
                       request("2", 1.0, [1.2])], HAND_STEPS,
              run_info("simulate", "sim", {"name": "t", "requests": 3, "digest": "d"}))
    done = runner.invoke(app, ["compare", str(rt_run), str(bench_file), "--no-plots"])
    assert done.exit_code == 0, done.output
    header = done.stdout.splitlines()[0]
    assert "vllm bench openai" in header and "simulate" in header
    steps = next(line for line in done.stdout.splitlines()
                 if line.startswith("num_engine_steps"))
    assert steps.split()[2:] == ["n/a", "n/a"]


def test_a_file_without_save_detailed_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "plain.json"
    data = vllm_result()
    for key in ("ttfts", "itls", "start_times", "input_lens", "output_lens", "latencies",
                "errors", "generated_texts", "queue_times"):
        del data[key]
    path.write_text(json.dumps(data))
    done = runner.invoke(app, ["report", str(path), "--no-plots"])
    assert done.exit_code == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'start_times'" in lines[0] and "--save-detailed" in lines[0]


def test_bad_entries_name_field_and_value(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(vllm_result(ttfts=[0.1, "x", 0.0])))
    with pytest.raises(ValueError, match=r"field 'ttfts' entry 1 must be a number.*'x'"):
        load_run(path)
    path.write_text(json.dumps(vllm_result(itls=[[0.1]])))
    with pytest.raises(ValueError, match=r"field 'itls' has 1 entries"):
        load_run(path)


@pytest.mark.parametrize(("extra", "expected"), [
    ({"errors": [""]}, r"field 'errors' has 1 entries, 'start_times' 3"),
    ({"latencies": [0.25, 0.22]}, r"field 'latencies' has 2 entries, 'start_times' 3"),
    ({"input_lens": [10, None, 10]}, r"field 'input_lens' entry 1 must be a count.*None"),
    ({"output_lens": [3, [1], 0]}, r"field 'output_lens' entry 1 must be a count.*\[1\]"),
    ({"output_lens": [3, -2, 0]}, r"field 'output_lens' entry 1 must be a count.*-2"),
    ({"input_lens": [10, 10.5, 10]}, r"field 'input_lens' entry 1 must be a count.*10.5"),
    ({"itls": [[0.05, 0.1], ["x"], []]}, r"field 'itls' entry 1 must be a number.*'x'"),
])
def test_short_optional_arrays_and_bad_counts_are_one_line(
        tmp_path: Path, extra: dict[str, Any], expected: str) -> None:
    """An `errors` or `latencies` array shorter than `start_times`, or a token count that is
    no count, is one line naming the field (was an IndexError or TypeError traceback)."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(vllm_result(**extra)))
    with pytest.raises(ValueError, match=expected):
        load_run(path)
    done = runner.invoke(app, ["report", str(path), "--no-plots"])
    assert done.exit_code == 2, done.output
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_failed_requests_output_len_may_be_null(tmp_path: Path) -> None:
    """vLLM's failed request may carry no output length: read as 0, as before."""
    path = tmp_path / "null.json"
    path.write_text(json.dumps(vllm_result(output_lens=[3, 2, None])))
    run = load_run(path)
    assert run.requests["output_len"].tolist() == [3, 2, 0]
    assert run.requests["max_tokens"].tolist() == [3, 2, 0]
