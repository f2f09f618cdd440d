"""`rt report` and `rt compare` through the CLI: the JSON keys, tables, plots, and one-line
errors with exit code 2 for bad input."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from analysis.rundir import load_run, write_run
from cli import app

runner = CliRunner()

VLLM_HEAD = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
             "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
             "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"]


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_report_json_has_vllms_keys_in_order(hand_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    code, stdout, err = invoke("report", str(hand_run), "--result-filename", str(out),
                               "--no-plots")
    assert code == 0, err
    assert "============ Serving Benchmark Result ============" in stdout
    assert "slowest 1% by TTFT" in stdout
    result = json.loads(out.read_text())
    assert list(result)[:len(VLLM_HEAD)] == VLLM_HEAD
    metric_keys = [k for k in result if k.endswith(("_ttft_ms", "_tpot_ms", "_itl_ms",
                                                     "_e2el_ms"))]
    assert metric_keys == [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl")
                           for s in ("mean", "median", "std", "p99")]  # no e2el by default
    assert result["request_goodput"] is None
    assert (result["completed"], result["failed"]) == (3, 1)
    assert result["mean_tpot_ms"] == pytest.approx(47.5)
    assert "mean_request_queue_time_ms" in result


def test_report_selected_metrics_percentiles_and_goodput(hand_run: Path) -> None:
    code, stdout, err = invoke(
        "report", str(hand_run), "--save-result", "--percentile-metrics", "ttft,e2el",
        "--metric-percentiles", "50,99.9", "--goodput", "ttft:150", "--goodput", "tpot:30",
        "--plot-dir", str(hand_run / "p"))
    assert code == 0, err
    assert "Request goodput (req/s):                 0.67" in stdout
    assert "P99.9 E2EL (ms):" in stdout
    result = json.loads((hand_run / "result.json").read_text())
    assert "p99.9_e2el_ms" in result and "p50_ttft_ms" in result
    assert "mean_tpot_ms" not in result and "mean_itl_ms" not in result
    assert result["request_goodput"] == pytest.approx(1 / 1.5)
    assert sorted(p.name for p in (hand_run / "p").iterdir()) == [
        "attribution.png", "cdf.png", "percentiles.png", "timeline.png"]


def test_compare_table_and_ratio(hand_run: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(hand_run, other)
    info = json.loads((other / "run.json").read_text())
    info["engine_args"]["max_num_batched_tokens"] = 2048
    info["name"] = "other"
    (other / "run.json").write_text(json.dumps(info))
    code, stdout, err = invoke("compare", str(hand_run), str(other), "--csv",
                               str(tmp_path / "c.csv"), "--plot-dir", str(tmp_path / "plots"))
    assert code == 0, err
    header = stdout.splitlines()[0]
    assert "max_num_batched_tokens=512" in header and "max_num_batched_tokens=2048" in header
    assert " / " in header
    assert "1.000x" in stdout
    assert (tmp_path / "plots" / "percentiles.png").is_file()


def _half_written(hand_run: Path) -> Path:
    data = (hand_run / "requests.parquet").read_bytes()
    (hand_run / "requests.parquet").write_bytes(data[: len(data) // 2])
    return hand_run


def _half_written_steps(hand_run: Path) -> Path:
    data = (hand_run / "steps.parquet").read_bytes()
    (hand_run / "steps.parquet").write_bytes(data[: len(data) // 2])
    return hand_run


def _bad_json(hand_run: Path) -> Path:  # badinput4: once the JSON error alone, file unnamed
    (hand_run / "run.json").write_text('{"a":\n')
    return hand_run


def _missing_columns(hand_run: Path) -> Path:
    run = load_run(hand_run)
    write_run(hand_run, run.requests.drop(columns=["first_token_s"]).to_dict("list"),
              run.steps.to_dict("list"), run.info)
    return hand_run


@pytest.mark.parametrize(
    ("make", "extra", "message"),
    [
        (lambda p: p / "nope", [], "not a run directory (requests.parquet is missing)"),
        (_half_written, [], "unreadable run directory: requests.parquet: "),
        (_bad_json, [], "unreadable run directory: run.json: Expecting value: line 2 column 1"),
        (_half_written_steps, [], "unreadable run directory: steps.parquet: "),
        (_missing_columns, [], "lacks columns first_token_s"),
        (lambda p: p, ["--percentile-metrics", "ttft,ttfb"], "unknown metric 'ttfb'"),
        (lambda p: p, ["--goodput", "itl:5"], "--goodput"),
        (lambda p: p, ["--metric-percentiles", "100"], "--metric-percentiles"),
    ],
)
def test_report_bad_input_is_one_line_exit_2(hand_run: Path, make: object, extra: list[str],
                                             message: str) -> None:
    path = make(hand_run)  # type: ignore[operator]
    code, _, err = invoke("report", str(path), "--no-plots", *extra)
    assert code == 2
    assert err.startswith("rt: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


def test_compare_refuses_runs_of_different_traces(hand_run: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(hand_run, other)
    info = json.loads((other / "run.json").read_text())
    info["trace"]["digest"] = "def"
    (other / "run.json").write_text(json.dumps(info))
    code, _, err = invoke("compare", str(hand_run), str(other), "--no-plots")
    assert code == 2 and "incompatible runs" in err and len(err.strip().splitlines()) == 1
    code, _, err = invoke("compare", str(hand_run), "--no-plots")
    assert code == 2 and "two or more" in err


def _without(info: dict[str, Any], path: str) -> dict[str, Any]:
    """`info` less the field at the dotted `path`."""
    *parents, last = path.split(".")
    holder = info
    for part in parents:
        holder = holder[part]
    del holder[last]
    return info


# run.json edits of the hand-made run, and the one line each gives (badinput: `{}` was
# reported as a run of no kind, exit 0; "scaling": "x" was a TypeError's traceback; "fleet":
# "x" an AttributeError's in `rt calibrate --from-run`)
BAD_RUN_JSON: list[tuple[Callable[[dict[str, Any]], Any], str]] = [
    (lambda info: {}, "field 'kind' is missing"),
    (lambda info: _without(info, "rt_version"), "field 'rt_version' is missing"),
    (lambda info: _without(info, "trace.digest"), "field 'trace.digest' is missing"),
    (lambda info: {**info, "kind": "bogus"},
     "field 'kind' must be one of 'simulate', 'replay', 'endpoint', got \"bogus\""),
    (lambda info: {**info, "name": 7}, "field 'name' must be a string, got 7"),
    (lambda info: {**info, "trace": "t.jsonl"}, "field 'trace' must be an object, got \"t.jsonl\""),
    (lambda info: {**info, "trace": {**info["trace"], "requests": "4"}},
     "field 'trace.requests' must be an integer >= 0, got \"4\""),
    (lambda info: {**info, "timing": "Client"},
     "field 'timing' must be one of 'client', 'engine', got \"Client\""),
    (lambda info: {**info, "prefix_cache": {"queries": 30, "hits": "5"}},
     "field 'prefix_cache.hits' must be an integer >= 0, got \"5\""),
    (lambda info: {**info, "fleet": "x"}, "field 'fleet' must be an object or null, got \"x\""),
    (lambda info: {**info, "fleet": {"replicas": 2, "pools": [{"name": "a"}, 3]}},
     "field 'fleet.pools[1]' must be an object, got 3"),
    (lambda info: {**info, "scaling": "x"},
     "field 'scaling' must be an object or null, got \"x\""),
    (lambda info: {**info, "scaling": {"end_s": 2.0, "gpu_hours": 1.0, "cost": 0.0, "pools": [
        {"name": "p", "gpu_hours": 1.0, "cost": 0.0, "times_s": [0.0], "serving": [],
         "provisioned": [1]}]}},
     "field 'scaling.pools[0].serving' must be a non-empty list of integers >= 0, got []"),
]


@pytest.mark.parametrize(("edit", "problem"), BAD_RUN_JSON)
@pytest.mark.parametrize("command", ["report", "compare"])
def test_a_bad_run_json_is_one_line_naming_the_file_and_field(
        hand_run: Path, tmp_path: Path, command: str,
        edit: Callable[[dict[str, Any]], Any], problem: str) -> None:
    """`rt report` and `rt compare` read run.json through `load_run`: its head (kind,
    rt_version, name, trace) is required and the sections read are type-checked."""
    bad = tmp_path / "bad"
    shutil.copytree(hand_run, bad)
    (bad / "run.json").write_text(json.dumps(edit(json.loads((bad / "run.json").read_text()))))
    runs = [str(bad)] if command == "report" else [str(hand_run), str(bad)]
    code, out, err = invoke(command, *runs, "--no-plots")
    assert (code, out, err) == (2, "", f"rt: error: {bad / 'run.json'}: {problem}\n")


def test_a_full_scaling_section_and_a_fleet_are_accepted(hand_run: Path) -> None:
    """The checks refuse no section as the writers write it (one pool, fixed: `sim.autoscale.
    ScalingTimeline.to_json`; `sim.fleet_config.FleetFlags.describe`)."""
    info = json.loads((hand_run / "run.json").read_text())
    info["fleet"] = {"replicas": 1, "router": "round-robin", "pools": None}
    info["scaling"] = {"policy": None, "interval_s": None, "end_s": 1.5, "gpu_hours": 0.25,
                       "cost": 0.0, "pools": [
                           {"name": "default", "gpus_per_replica": 1, "cost_per_hour": 0.0,
                            "gpu_hours": 0.25, "cost": 0.0, "times_s": [0.0], "serving": [1],
                            "provisioned": [1], "decisions": []}]}
    (hand_run / "run.json").write_text(json.dumps(info))
    code, out, err = invoke("report", str(hand_run), "--no-plots")
    assert code == 0, err
    assert "Autoscaling policy:                      none (fixed fleet)" in out


@pytest.mark.parametrize(("command", "option", "target"), [
    ("report", "--html", "run.json"),
    ("report", "--trace-events", "requests.parquet"),
    ("report", "--result-filename", "run.json"),
    ("compare", "--csv", "steps.parquet"),
    ("compare", "--html", "run.json"),
    ("report", "--html", "."),  # a directory: once refused only after the page was made
])
def test_an_output_never_replaces_a_run_directorys_own_files(
        hand_run: Path, tmp_path: Path, command: str, option: str, target: str) -> None:
    """`rt report RUN --html RUN/run.json` (or compare's --csv onto a run's table) replaced
    the run it read with the page, exit 0 (badinput23)."""
    other = tmp_path / "other"
    shutil.copytree(hand_run, other)
    before = {p.name: p.read_bytes() for p in hand_run.iterdir()}
    runs = [str(hand_run)] + ([str(other)] if command == "compare" else [])
    path = hand_run / target
    code, out, err = invoke(command, *runs, "--no-plots", option, str(path))
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"rt: error: {option} {path}: "), err
    assert {p.name: p.read_bytes() for p in hand_run.iterdir()} == before
