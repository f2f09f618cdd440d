"""rt sweep: the SLO language, the rate bisection, the knee, and identical results from the
local process pool and Ray."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analysis.plots import knee_index
from analysis.sweep import RateSearch, meets_slo, parse_slo
from cli import app

runner = CliRunner()
SMALL = ["sweep", "--dataset-name", "random", "--num-prompts", "24", "--random-input-len",
         "300", "--random-output-len", "12", "--random-range-ratio", "0.5",
         "--request-rate", "30", "--max-num-batched-tokens", "256,2048", "--max-num-seqs",
         "64", "--jobs", "2"]


def test_parse_slo() -> None:
    assert parse_slo("p99_ttft_ms=500,p99.9_itl_ms=50,mean_e2el_ms=2000") == {
        "p99_ttft_ms": 500.0, "p99.9_itl_ms": 50.0, "mean_e2el_ms": 2000.0}
    for bad in ("p99_ttfb_ms=5", "p99_ttft=5", "p99_ttft_ms:5", "p100_ttft_ms=5", ""):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)
    assert meets_slo({"failed": 0, "p99_ttft_ms": 500.0}, {"p99_ttft_ms": 500})
    assert not meets_slo({"failed": 1, "p99_ttft_ms": 1.0}, {"p99_ttft_ms": 500})


def _search(threshold: float, lo: float = 1.0, hi: float = 100.0) -> RateSearch:
    search = RateSearch(lo, hi, tolerance=0.02)
    while rates := search.next_rates():
        for rate in rates:
            search.record(rate, rate <= threshold)
    return search


def test_bisection_finds_the_highest_passing_rate() -> None:
    search = _search(37.0)
    assert search.status == "found"
    assert search.best is not None and 37.0 * 0.98 <= search.best <= 37.0
    assert search.runs == 2 + 8  # both ends, then geometric halving to 2 %
    assert _search(500.0).status == "at least hi" and _search(500.0).runs == 2
    assert _search(0.5).status == "below range" and _search(0.5).best is None


def test_knee_of_a_rising_curve() -> None:
    assert knee_index([1, 2, 4, 8, 16], [10, 10.5, 11, 14, 80]) == 3
    assert knee_index([1, 2], [1, 2]) is None


def _sweep(tmp_path: Path, name: str, *extra: str) -> list[dict[str, object]]:
    result = runner.invoke(app, [*SMALL, "--result-dir", str(tmp_path / name), "--no-plots",
                                 *extra])
    assert result.exit_code == 0, result.stderr
    records = json.loads((tmp_path / name / "sweep.json").read_text())
    return [{k: v for k, v in r.items() if k not in ("date", "run_dir")} for r in records]


@pytest.fixture(scope="module")
def local_records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return _sweep(tmp_path_factory.mktemp("sweep"), "local")


def test_sweep_table_shows_the_budget_trade_off(local_records: list[dict[str, object]]
                                                ) -> None:
    small, large = local_records
    assert (small["max_num_batched_tokens"], large["max_num_batched_tokens"]) == (256, 2048)
    assert small["completed"] == large["completed"] == 24
    assert large["mean_ttft_ms"] < small["mean_ttft_ms"]  # type: ignore[operator]
    assert large["p99_itl_ms"] > small["p99_itl_ms"]  # type: ignore[operator]


def test_sweep_on_ray_gives_identical_results(local_records: list[dict[str, object]],
                                              tmp_path: Path) -> None:
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'rt[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert _sweep(tmp_path, "ray", "--executor", "ray") == local_records
    finally:
        ray.shutdown()


def test_sweep_plots_and_bad_input(tmp_path: Path) -> None:
    result = runner.invoke(app, [*SMALL, "--max-num-batched-tokens", "512,1024",
                                 "--result-dir", str(tmp_path / "p"), "--jobs", "1"])
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "p" / "latency_vs_max_num_batched_tokens.png").is_file()
    for extra, message in ((["--slo", "p99_ttfb_ms=5"], "--slo"),
                           (["--find-max-rate"], "--find-max-rate needs --slo"),
                           (["--percentile-metrics", "foo"], "unknown metric"),
                           (["--executor", "dask"], "--executor"),
                           (["--address", "auto"], "--address 'auto' needs --executor ray"),
                           # badinput23: once ignored without a word
                           (["--rate-range", "1,4"], "--rate-range '1,4' needs --find-max-rate"),
                           (["--rate-tolerance", "0.2"],
                            "--rate-tolerance 0.2 needs --find-max-rate"),
                           (["--find-max-rate", "--slo", "p99_ttft_ms=5", "--rate-range",
                             "1,4"], "--request-rate or --rate-range, not both"),
                           (["--find-max-rate", "--slo", "p99_ttft_ms=5", "--time-scale",
                             "0.5,1"],
                            "--time-scale '0.5,1' does not combine with --find-max-rate"),
                           (["--max-num-batched-tokens", "x"], "--max-num-batched-tokens"),
                           # badinput23b: once each point run twice
                           (["--request-rate", "1,1,2"], "--request-rate: '1' given twice"),
                           (["--max-num-seqs", "8,16,8"], "--max-num-seqs: '8' given twice"),
                           (["--gpu", "h200,a100-80gb,h200"], "--gpu: 'h200' given twice")):
        result = runner.invoke(app, [*SMALL, *extra, "--result-dir", str(tmp_path / "e")])
        assert result.exit_code == 2, (extra, result.stderr)
        assert result.stderr.startswith("rt: error: ") and message in result.stderr


def test_a_sweep_run_again_reuses_its_finished_points(tmp_path: Path) -> None:
    """Runs are written atomically; a point whose run directory is complete and matches
    (labels, trace digest) is not simulated again, one that is missing is."""
    first = _sweep(tmp_path, "s")
    runs = sorted(p for p in (tmp_path / "s").iterdir() if (p / "run.json").is_file())
    assert len(runs) == 2
    kept = (runs[0] / "requests.parquet").stat().st_mtime_ns
    shutil.rmtree(runs[1])  # as if the sweep had been cut short before this point
    again = _sweep(tmp_path, "s")
    assert again == first
    assert (runs[0] / "requests.parquet").stat().st_mtime_ns == kept
    assert (runs[1] / "run.json").is_file()


def test_a_rate_search_plots_against_the_flag_only_the_rates_every_value_ran(
        tmp_path: Path) -> None:
    """--find-max-rate: each budget bisects its own rates; only the bracket's ends (5 and
    200 req/s) and its first midpoint ran at both budgets, so the budget figure has those
    three series, not one per rate."""
    from analysis.sweep import write_sweep

    rates = {512: (5.0, 200.0, 31.62, 36.52), 2048: (5.0, 200.0, 31.62, 47.33)}
    records = [{"max_num_batched_tokens": budget, "request_rate": rate,
                "run_dir": f"r{budget}-{rate}", "completed": 10,
                **{f"p{p}_{m}_ms": rate + p for p in (50, 90, 99) for m in ("ttft", "itl")}}
               for budget, budget_rates in rates.items() for rate in budget_rates]
    _, figures = write_sweep(records, tmp_path, ("max_num_batched_tokens",), None, plots=True)
    ttft_axes = figures["latency_vs_max_num_batched_tokens"].axes[0]
    assert sorted({line.get_label().split()[0] for line in ttft_axes.get_lines()}) == [
        "request_rate=200.0", "request_rate=31.62", "request_rate=5.0"]
    assert len(ttft_axes.get_lines()) == 9  # 3 rates x p50, p90, p99


@pytest.mark.parametrize("args, named", [
    (["--request-rate", "1,4"], "--request-rate 1,4"),
    (["--rate-range", "1,4", "--find-max-rate", "--slo", "p99_ttft_ms=500"], "--rate-range 1,4"),
    (["--find-max-rate", "--slo", "p99_ttft_ms=500"], "--find-max-rate"),
])
def test_rates_on_a_trace_without_a_span_name_the_sweeps_flag(tmp_path: Path, args: list[str],
                                                              named: str) -> None:
    """Once named as --target-rate, a flag rt sweep does not have (badinput23)."""
    from workloads import Trace, TraceRequest, write_rt_jsonl

    trace = tmp_path / "same.jsonl"
    write_rt_jsonl(Trace(tuple(TraceRequest(f"r{i}", 1.0, 32, 4) for i in range(3)), "s"),
                   trace)
    result = runner.invoke(app, ["sweep", "--trace", str(trace), *args, "--no-plots",
                                 "--result-dir", str(tmp_path / "s")])
    assert result.exit_code == 2 and result.stderr == (
        f"rt: error: {named}: the trace has no time span to rescale to a request rate (all "
        "arrivals coincide)\n")
