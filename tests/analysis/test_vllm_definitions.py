"""Issue 19: rt's numbers under vLLM's names mean what vLLM's mean. Peak concurrency is vLLM
0.32's one-second-bucket count; a client-timed run's server-only figures are unknown (None in
the JSON, "n/a" in `rt compare`), never 0, and `rt report` draws no empty attribution plot."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from analysis.attribution import attribution_buckets
from analysis.compare import compare_table, render_table
from analysis.console import rt_block
from analysis.metrics import benchmark_metrics
from analysis.plots import report_figures
from analysis.report import result_dict
from analysis.rundir import Run

from .conftest import PARTS, request


def _run(rows: list[dict[str, Any]], info: dict[str, Any] | None = None,
         steps: pd.DataFrame | None = None) -> Run:
    return Run(Path("r"), pd.DataFrame(rows), pd.DataFrame() if steps is None else steps,
               info or {"kind": "simulate", "name": "r"})


def _interval(rid: str, start: float, end: float) -> dict[str, Any]:
    return request(rid, start, [start + (end - start) / 2, end])


def test_peak_concurrency_counts_one_second_buckets_worked_by_hand() -> None:
    # Relative to t0 = 0.2: A [0, 0.5] and B [0.6, 0.9] fill bucket 0; C [1.1, 1.2],
    # D [1.3, 3.0] and E [1.85, 2.3] all touch bucket 1 -> 3. D counts in buckets 1, 2 and 3
    # (int(3.0) = 3, included). At no instant are more than 2 (D and E) in flight.
    rows = [_interval("A", 0.2, 0.7), _interval("B", 0.8, 1.1), _interval("C", 1.3, 1.4),
            _interval("D", 1.5, 3.2), _interval("E", 2.05, 2.5)]
    assert benchmark_metrics(pd.DataFrame(rows)).max_concurrent_requests == 3


def _vllm_032_peak(outputs: list[tuple[float, float]]) -> int:
    """vLLM 0.32 `calculate_metrics` (vllm/benchmarks/serve.py), its loop as written, over
    (start_time, latency) of the successful outputs."""
    min_start_time = min(start for start, _ in outputs)
    max_end_time = max(start + latency for start, latency in outputs)
    duration_seconds = int(np.ceil(max_end_time - min_start_time)) + 1
    concurrent_requests_per_second = np.zeros(duration_seconds)
    for start_time, latency in outputs:
        request_start_second = int(start_time - min_start_time)
        request_end_second = int((start_time + latency) - min_start_time)
        for second in range(request_start_second, request_end_second + 1):
            concurrent_requests_per_second[second] += 1
    return int(np.max(concurrent_requests_per_second))


def test_peak_concurrency_equals_vllms_formula() -> None:
    rng = random.Random(7)
    for _ in range(30):
        spans = []
        for i in range(rng.randint(1, 40)):
            start = rng.uniform(0, 20)
            spans.append((f"r{i}", start, start + rng.uniform(0.01, 4)))
        rows = [_interval(rid, a, b) for rid, a, b in spans]
        expected = _vllm_032_peak([(a, b - a) for _, a, b in spans])
        assert benchmark_metrics(pd.DataFrame(rows)).max_concurrent_requests == expected


def test_many_short_requests_in_one_second_count_as_concurrent() -> None:
    """The issue's gap (vLLM 22, rt 10): sequential requests within a second all count."""
    rows = [_interval(f"r{i}", i * 0.1, i * 0.1 + 0.09) for i in range(10)]
    assert benchmark_metrics(pd.DataFrame(rows)).max_concurrent_requests == 10


CLIENT_INFO = {"kind": "endpoint", "name": "ep", "timing": "client",
               "endpoint": {"url": "http://127.0.0.1:8000/v1/completions"}}
SERVER_ONLY = ("mean_request_queue_time_ms", "p99_request_prefill_time_ms",
               "median_request_inference_time_ms", "num_preemptions",
               "num_preempted_requests", "mean_kv_cache_usage", "max_kv_cache_usage",
               "num_engine_steps", "prefix_cache_hit_rate")


def _client_rows() -> list[dict[str, Any]]:
    """As `rt replay --endpoint` records them: server-side columns NaN."""
    rows = [request("A", 0.0, [0.1, 0.15, 0.25]), request("B", 0.5, [0.6, 0.7])]
    for row in rows:
        row.update({c: math.nan for c in (*PARTS, "queued_s", "engine_queued_s",
                                          "first_scheduled_s")})
    return rows


def test_client_timed_report_leaves_server_only_keys_unknown() -> None:
    result = result_dict(_run(_client_rows(), CLIENT_INFO))
    for key in SERVER_ONLY:
        assert result[key] is None, key
    assert result["mean_ttft_ms"] == pytest.approx(100.0)  # what the client measured
    assert "null" in json.dumps(result) and "NaN" not in json.dumps(result)


def test_client_timed_prefix_hit_rate_when_the_server_reported_cached_tokens() -> None:
    rows = _client_rows()
    rows[1]["cached_tokens"] = 5  # of 20 prompt tokens
    info = {**CLIENT_INFO, "cached_tokens_reported": 2}
    assert result_dict(_run(rows, info))["prefix_cache_hit_rate"] == 0.25
    assert "n/a" in rt_block(pd.DataFrame(rows), pd.DataFrame(), math.nan, True)


def test_compare_shows_n_a_not_zero_ratios_for_client_timed_runs() -> None:
    sim_rows = [request("A", 0.0, [0.1, 0.15, 0.25], queued=0.01, scheduled=0.02,
                        parts={"prefill_s": 0.08, "decode_s": 0.15}, preemptions=1),
                request("B", 0.5, [0.6, 0.7], queued=0.5, scheduled=0.55)]
    steps = pd.DataFrame({"step": [0, 1], "start_s": [0.0, 0.1], "end_s": [0.1, 0.2],
                          "num_prefill_tokens": [10, 0], "num_decode_tokens": [0, 2],
                          "kv_usage": [0.2, 0.4], "num_running": [1, 2],
                          "num_waiting": [0, 0]})
    results = [result_dict(_run(sim_rows, steps=steps)),
               result_dict(_run(_client_rows(), CLIENT_INFO))]
    table = compare_table(results, ["sim", "ep"])
    for key in ("num_engine_steps", "mean_kv_cache_usage", "mean_request_queue_time_ms"):
        assert math.isnan(table.loc[key, "ep"]) and math.isnan(table.loc[key, "ep / sim"])
    text = render_table(table)
    assert "0.000x" not in text
    engine_steps = next(line for line in text.splitlines()
                        if line.startswith("num_engine_steps"))
    assert engine_steps.split()[1:] == ["2", "n/a", "n/a"]


def test_report_draws_no_attribution_plot_for_a_client_timed_run() -> None:
    requests = pd.DataFrame(_client_rows())
    figures = report_figures(requests, pd.DataFrame(), "ep",
                             attribution_buckets(requests, "ttft"),
                             attribution_buckets(requests, "e2el"))
    assert "attribution" not in figures and "percentiles" in figures
