"""Metric arithmetic pinned on the hand-made run of conftest.py (values worked out by hand)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analysis.attribution import attribution_buckets, attribution_summary
from analysis.metrics import (
    benchmark_metrics,
    goodput_mask,
    parse_goodput,
    parse_percentile_metrics,
    phase_times,
    request_goodput,
)
from analysis.report import ReportOptions, result_dict
from analysis.rundir import load_run


def test_counts_duration_and_throughputs(hand_run: Path) -> None:
    m = benchmark_metrics(load_run(hand_run).requests)
    assert (m.completed, m.failed) == (3, 1)
    assert m.duration_s == pytest.approx(1.5)  # first arrival 0 to the last finish 1.5
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 6)
    assert m.request_throughput == pytest.approx(2.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(24.0)


def test_ttft_e2el_and_tpot_skips_one_token_outputs(hand_run: Path) -> None:
    m = benchmark_metrics(load_run(hand_run).requests, (50, 99))
    assert m.stats["ttft"]["mean"] == pytest.approx(500 / 3)
    assert m.stats["ttft"]["median"] == pytest.approx(100)
    assert m.stats["e2el"]["mean"] == pytest.approx(670 / 3)
    # TPOT over A (75) and C (20) only: B's single token has no TPOT
    assert m.stats["tpot"]["mean"] == pytest.approx(47.5)
    assert m.stats["tpot"]["std"] == pytest.approx(27.5)
    assert m.stats["tpot"]["p99"] == pytest.approx(20 + 0.99 * 55)


def test_itl_is_pooled_over_every_gap(hand_run: Path) -> None:
    m = benchmark_metrics(load_run(hand_run).requests, (50,))
    # gaps 50, 100 (A) and 20 (C): pooled mean 56.67, not the mean of per-request means 47.5
    assert m.stats["itl"]["mean"] == pytest.approx(170 / 3)
    assert m.stats["itl"]["median"] == pytest.approx(50)
    assert m.stats["itl"]["std"] == pytest.approx(np.std([50, 100, 20]))


@pytest.mark.parametrize(
    ("spec", "good", "goodput"),
    [
        (["ttft:150"], ["A", "B"], 2 / 1.5),
        (["tpot:30"], ["B", "C"], 2 / 1.5),  # B: TPOT counts as 0 (one token)
        (["ttft:150", "tpot:30"], ["B"], 1 / 1.5),  # every SLO must hold
        (["e2el:250"], ["A", "B"], 2 / 1.5),  # <= is good
        (["ttft:100,e2el:99"], [], 0.0),
    ],
)
def test_goodput(hand_run: Path, spec: list[str], good: list[str], goodput: float) -> None:
    requests = load_run(hand_run).requests
    slos = parse_goodput(spec)
    mask = goodput_mask(requests, slos)
    assert sorted(requests.loc[mask[mask].index, "request_id"]) == good
    assert request_goodput(requests, slos, 1.5) == pytest.approx(goodput)


def test_vllm_phase_times(hand_run: Path) -> None:
    phases = phase_times(load_run(hand_run).requests).set_index("request_id")
    a = phases.loc["A"]
    assert a["request_queue_time"] == pytest.approx(10)  # first scheduled - queued
    assert a["request_prefill_time"] == pytest.approx(80)  # first token - first scheduled
    assert a["request_decode_time"] == pytest.approx(150)  # last token - first token
    assert a["request_inference_time"] == pytest.approx(230)  # last token - first scheduled
    assert phases.loc["C", "request_queue_time"] == pytest.approx(200)
    assert phases.loc["B", "request_decode_time"] == pytest.approx(0)


def test_report_keys_preemptions_cache_and_kv(hand_run: Path) -> None:
    result = result_dict(load_run(hand_run), ReportOptions(percentiles=(99,)))
    assert result["num_preemptions"] == 2 and result["num_preempted_requests"] == 1
    assert result["prefix_cache_hit_rate"] == pytest.approx(5 / 30)
    assert result["max_kv_cache_usage"] == pytest.approx(0.4)
    assert result["mean_request_queue_time_ms"] == pytest.approx((10 + 0 + 200) / 3)


def test_attribution_groups_and_buckets(hand_run: Path) -> None:
    summary = attribution_summary(load_run(hand_run).requests).set_index("group")
    assert summary.loc["all", "requests"] == 3
    assert summary.loc["all", "queue_kv_capacity_ms"] == pytest.approx(200 / 3)
    # the slowest 1% (one request) by TTFT is C: 200 ms waiting for KV capacity
    assert summary.loc["slowest 1% by TTFT", "queue_kv_capacity_ms"] == pytest.approx(200)
    assert summary.loc["slowest 10% by E2E", "e2el"] == pytest.approx(320)
    parts = [c for c in summary.columns if c.endswith("_ms")]
    assert summary.loc["all", parts].sum() == pytest.approx(summary.loc["all", "e2el"])
    buckets = attribution_buckets(load_run(hand_run).requests, "e2el", (0, 50, 100))
    assert buckets["requests"].tolist() == [1, 2]


def test_unknown_percentile_metric_is_rejected() -> None:
    assert parse_percentile_metrics("ttft,e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError, match="unknown metric 'ttfb'"):
        parse_percentile_metrics("ttft,ttfb")
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(["itl:5"])


@pytest.mark.parametrize("chunk", [1, 2, 16_384])
def test_itl_and_peak_rate_in_chunks(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import pandas as pd

    from analysis import metrics, token_times

    monkeypatch.setattr(token_times, "_CHUNK_ROWS", chunk)
    done = pd.DataFrame({"status": ["FINISHED_LENGTH_CAPPED"] * 5, "output_len": [1] * 5,
                         "arrival_s": [0.0] * 5,
                         "token_times_s": [[], [1.0], [2.0, 2.5, 3.0], [], [3.2, 3.45]]})
    assert metrics.inter_token_latencies(done).tolist() == pytest.approx([500, 500, 250])
    assert metrics._peak_tokens_per_second(done, 0.0) == 3.0  # 3.0, 3.2, 3.45
