"""analysis.fidelity: per-step, per-request and gated errors on hand-made runs."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from analysis.fidelity import (
    DRIFT_FLOOR,
    FidelityReport,
    drift_warnings,
    fidelity_report,
    gate,
    metric_errors,
    render,
    step_errors,
    ttft_errors,
)
from analysis.rundir import Run
from tests.analysis.conftest import HAND_STEPS, request


def _requests(ttfts_s: list[float]) -> pd.DataFrame:
    return pd.DataFrame({
        "request_id": [f"r{i}" for i in range(len(ttfts_s))],
        "arrival_s": [0.0] * len(ttfts_s), "first_token_s": ttfts_s,
        "finish_s": [t + 0.1 for t in ttfts_s], "output_len": [3] * len(ttfts_s),
        "status": ["FINISHED_LENGTH_CAPPED"] * len(ttfts_s),
        "token_times_s": [[t, t + 0.05, t + 0.1] for t in ttfts_s]})


def test_step_errors() -> None:
    out = step_errors([0.01, 0.02, 0.0], [0.011, 0.018, 0.5])  # the 0 s step is skipped
    assert out["steps"] == 2
    assert out["mape"] == pytest.approx(0.1)
    assert out["bias_total"] == pytest.approx(0.029 / 0.03 - 1)
    with pytest.raises(ValueError):
        step_errors([0.01], [0.01, 0.02])


def test_ttft_errors_matches_requests_by_id() -> None:
    real = _requests([0.010, 0.020, 0.040])
    sim = _requests([0.011, 0.020, 0.030]).iloc[::-1]  # order does not matter
    out = ttft_errors(real, sim)
    assert out["requests"] == 3
    assert out["p50_signed_ms"] == pytest.approx(0.0)
    assert out["p90_abs_ms"] == pytest.approx(8.2)


def test_gate_and_render() -> None:
    metrics = pd.DataFrame({"real": [10.0, 20.0, 5.0, 8.0], "sim": [10.4, 23.0, 5.0, 8.0],
                            "error": [0.04, 0.15, 0.0, math.nan]},
                           index=["p50_ttft_ms", "p90_ttft_ms", "p50_itl_ms", "p90_itl_ms"])
    report = FidelityReport(metrics, step_errors([0.01], [0.01]),
                            ttft_errors(_requests([0.01]), _requests([0.01])))
    violations = gate(report, 0.05)
    assert [v.split(":")[0] for v in violations] == ["p90_ttft_ms", "p90_itl_ms"]
    assert gate(report, 0.2) == ["p90_itl_ms: error +nan% exceeds 20.0%"]
    assert "p90_ttft_ms" in render(report)
    assert report.to_json_dict()["metrics"]["p90_itl_ms"]["error"] is None


def test_noise_floor_column_and_lines() -> None:
    metrics = pd.DataFrame({"real": [10.0, 20.0], "sim": [11.0, 20.0], "error": [0.1, 0.0],
                            "noise": [0.08, -0.02]}, index=["p50_ttft_ms", "p90_ttft_ms"])
    noise = ttft_errors(_requests([0.010, 0.020]), _requests([0.012, 0.020]))
    report = FidelityReport(metrics, step_errors([0.01], [0.01]),
                            ttft_errors(_requests([0.01]), _requests([0.01])), noise)
    assert gate(report, 0.05, ("p50_ttft_ms", "p90_ttft_ms")) == [
        "p50_ttft_ms: error +10.0% exceeds 5.0% (noise 8.0%)"]
    text = render(report)
    assert text.splitlines()[0].split() == ["metric", "real", "sim", "error", "noise"]
    assert text.splitlines()[1].split()[-2:] == ["+10.0%", "8.0%"]
    assert "per-request TTFT noise (real run 2 vs 1) (2 requests)" in text
    assert report.to_json_dict()["ttft_per_request_noise"]["p90_abs_ms"] == pytest.approx(1.8)


def _run(ttfts_s: list[float]) -> Run:
    rows = [request(f"r{i}", 0.0, [t, t + 0.05, t + 0.1], queued=0.0, scheduled=0.0)
            for i, t in enumerate(ttfts_s)]
    return Run(Path("r"), pd.DataFrame(rows), pd.DataFrame(HAND_STEPS), {"name": "r"})


def test_metric_errors_against_the_mean_of_real_runs() -> None:
    """`real` is the mean over real runs, `noise` the largest deviation of one from it."""
    reals = [_run([0.010, 0.010, 0.010]), _run([0.014, 0.014, 0.014])]
    table = metric_errors(reals, [_run([0.013, 0.013, 0.013])])
    row = table.loc["p50_ttft_ms"]
    assert row["real"] == pytest.approx(12.0) and row["sim"] == pytest.approx(13.0)
    assert row["error"] == pytest.approx(1 / 12)
    assert row["noise"] == pytest.approx(2 / 12)
    assert "sim_noise" not in table.columns
    single = metric_errors(reals[:1], [_run([0.013, 0.013, 0.013])])
    assert "noise" not in single.columns
    assert single.loc["p50_ttft_ms", "error"] == pytest.approx(0.3)
    with pytest.raises(ValueError):
        metric_errors([], [reals[0]])
    with pytest.raises(ValueError):
        metric_errors(reals, [])


def test_metric_errors_against_the_mean_of_simulated_runs() -> None:
    """`sim` is the mean over simulated runs, `sim_noise` the largest deviation of one."""
    sims = [_run([0.011, 0.011, 0.011]), _run([0.012, 0.012, 0.012]),
            _run([0.016, 0.016, 0.016])]
    table = metric_errors([_run([0.010, 0.010, 0.010])], sims)
    row = table.loc["p50_ttft_ms"]
    assert row["sim"] == pytest.approx(13.0)
    assert row["error"] == pytest.approx(0.3)
    assert row["sim_noise"] == pytest.approx(3 / 13)
    assert "noise" not in table.columns
    report = fidelity_report([_run([0.010, 0.010, 0.010])], sims, [0.01], [0.01])
    assert report.sim_runs == 3 and report.ttft["p50_signed_ms"] == pytest.approx(1.0)
    text = render(report)
    assert text.splitlines()[0].split() == ["metric", "real", "sim", "error", "sim_noise"]
    assert "sim: the mean of 3 simulations" in text
    assert report.to_json_dict()["sim_runs"] == 3


def test_drift_of_calibration_runs_against_the_real_runs_and_its_warning() -> None:
    """`drift` is (mean over calibration runs - real) / real, exactly; it is warned about when
    beyond both the real runs' noise and DRIFT_FLOOR, and reported in text and JSON."""
    reals = [_run([0.010, 0.010, 0.010]), _run([0.011, 0.011, 0.011])]  # p50 TTFT 10.5 ms
    calibrations = [_run([0.012, 0.012, 0.012]), _run([0.014, 0.014, 0.014])]  # mean 13 ms
    sims = [_run([0.013, 0.013, 0.013])]
    table = metric_errors(reals, sims, calibrations)
    assert table.loc["p50_ttft_ms", "drift"] == pytest.approx(13 / 10.5 - 1)
    assert table.loc["p50_itl_ms", "drift"] == pytest.approx(0.0)  # ITL 50 ms in all
    assert drift_warnings(table) == [
        "machine drift: the calibration replays' p50_ttft_ms is +23.8% from the real "
        "replays' (noise 4.8%, floor 5%): the profile was fitted on a machine running unlike "
        "the one it is judged on, and the error includes that difference"]
    # within the floor (no noise column: one real run), or within the noise: no warning
    assert drift_warnings(metric_errors(reals[:1], sims, [_run([0.0104] * 3)])) == []
    assert DRIFT_FLOOR == 0.05 and "drift" not in metric_errors(reals, sims).columns
    # a metric not measured (NaN drift: no ITL) warns of nothing; a NaN noise is no floor
    unmeasured = table.copy()
    unmeasured.loc["p50_ttft_ms", "drift"] = float("nan")
    assert drift_warnings(unmeasured) == []
    unmeasured.loc["p50_ttft_ms", "drift"] = 0.06
    unmeasured.loc["p50_ttft_ms", "noise"] = float("nan")
    assert drift_warnings(unmeasured)[0].startswith(
        "machine drift: the calibration replays' p50_ttft_ms is +6.0% from the real replays' "
        "(noise 0.0%, floor 5%)")
    report = fidelity_report(reals, sims, [0.01], [0.01], calibrations, {"warmup": {"n": 1}})
    text = render(report)
    assert text.splitlines()[0].split()[-2:] == ["noise", "drift"]
    assert text.splitlines()[-1].startswith("machine drift: the calibration replays' p50_ttft")
    assert "drift: the mean of 2 calibration replays" in text
    out = report.to_json_dict()
    assert out["calibration_runs"] == 2 and out["warmup"] == {"n": 1}
    assert out["drift_warnings"] == drift_warnings(table)
    assert out["metrics"]["p50_ttft_ms"]["drift"] == pytest.approx(13 / 10.5 - 1)
