"""`rt report`: one run's result as `vllm bench serve --save-result` writes it, plus rt's keys.

The JSON keeps vLLM's names and order (`date`, ..., `duration`, `completed`, `failed`, ...,
`request_goodput`, ..., then `mean_{m}_ms`, `median_{m}_ms`, `std_{m}_ms`, `p{P}_{m}_ms` for each
selected metric `m`; `e2el` only when selected, as in vLLM). rt's additions follow:
`{mean,median,std,p{P}}_request_{queue,prefill,decode,inference}_time_ms` (vLLM's
`vllm:request_*_time_seconds` definitions), preemptions, prefix-cache and KV figures.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.metrics import (
    DEFAULT_PERCENTILE_METRICS,
    PHASES,
    _pkey,
    benchmark_metrics,
    parse_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
    phase_times,
    prefix_cache_hit_rate,
    request_goodput,
    summarize,
)
from analysis.rundir import Run, check_output_file, load_run

REQUEST_COLUMNS = (
    "request_id", "arrival_s", "prompt_len", "engine_queued_s", "first_scheduled_s",
    "first_token_s", "finish_s", "status", "output_len", "cached_tokens", "num_preemptions",
    "token_times_s", "api_server_s", "step_boundary_s", "queue_token_budget_s",
    "queue_max_num_seqs_s", "queue_kv_capacity_s", "queue_preempted_step_s", "preempted_s",
    "prefill_s", "decode_s",
)
STEP_COLUMNS = ("step", "start_s", "end_s", "num_prefill_tokens", "num_decode_tokens",
                "kv_usage", "num_running", "num_waiting")
# Seconds from a run's start to any of its times at most: 4 x the longest trace (2^24 s,
# workloads.trace.MAX_ARRIVAL_S), room for the queue behind its last arrival. The metrics
# count per second (vLLM's peak concurrency); 1e300 s overflowed their int64 cast.
MAX_RUN_S = float(1 << 26)


@dataclass(frozen=True)
class ReportOptions:
    """vLLM's `--percentile-metrics`, `--metric-percentiles` and `--goodput` (ms)."""

    percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS
    percentiles: Sequence[float] = (99.0,)
    goodput: dict[str, float] = field(default_factory=dict)


# The report options of a table of runs (`rt compare`, `rt sweep`): four metrics, three
# percentiles.
TABLE_DEFAULTS = {"percentile_metrics": "ttft,tpot,itl,e2el", "metric_percentiles": "50,90,99"}


def _flag(default: Any, option: str, help: str) -> Any:
    return field(default=default, metadata={"flag": option, "help": help, "panel": None})


# `rt report --help`'s description of the command, beside its flags.
REPORT_HELP = """\
Report one run with vLLM's metrics, where the time went (all requests and the slowest
1%/10% by TTFT and E2E), and plots: percentile curves, CDFs, attribution, timeline.

TPOT = (E2EL - TTFT) / (output tokens - 1), vLLM's (guidellm calls it ITL); ITL = every
gap between consecutive tokens, pooled.
"""


@dataclass(frozen=True, slots=True)
class ReportFlags:
    """The three vLLM bench flags of a report, as typed on the command line."""

    percentile_metrics: str = _flag(
        "ttft,tpot,itl", "--percentile-metrics", "Metrics to report percentiles of: "
        "ttft,tpot,itl,e2el (vLLM's; e2el keys appear in the JSON only when selected).")
    metric_percentiles: str = _flag("99", "--metric-percentiles",
                                    "Comma-separated percentiles, e.g. 50,90,99,99.9.")
    goodput: list[str] | None = _flag(
        None, "--goodput", "SLOs in ms, KEY:MS with KEY ttft, tpot or e2el (repeat, or "
        "comma-separate): a request is good if it meets every one. Adds request_goodput.")

    def options(self) -> ReportOptions:
        """Parsed; ValueError naming the flag and value."""
        return ReportOptions(parse_percentile_metrics(self.percentile_metrics),
                             parse_metric_percentiles(self.metric_percentiles),
                             parse_goodput(self.goodput or []))


@dataclass(frozen=True, slots=True)
class ReportFiles:
    """What `rt report` writes besides the console text."""

    save_result: bool = _flag(False, "--save-result", "Write the result JSON (vLLM's keys) to "
                              "RUN/result.json or --result-filename.")
    result_filename: Path | None = _flag(None, "--result-filename", "JSON file to write "
                                         "(implies --save-result).")
    save_detailed: bool = _flag(False, "--save-detailed", "Add vLLM's per-request arrays to "
                                "the JSON and write the per-request attribution next to it "
                                "(.attribution.csv).")
    plot_dir: Path | None = _flag(None, "--plot-dir", "Where the PNGs go (default: "
                                  "RUN/plots).")
    plots: bool = _flag(True, "--plots/--no-plots", "Draw the PNGs.")
    html: Path | None = _flag(None, "--html", "Also write one self-contained HTML report "
                              "here (no network needed to open it).")
    trace_events: Path | None = _flag(None, "--trace-events", "Also write the run's request "
                                      "and step timelines here, as Chrome trace events "
                                      "(Perfetto, chrome://tracing).")
    requests: int | None = _flag(None, "--requests", "--trace-events: keep this many "
                                 "requests (the slowest tenth always, the rest spread by "
                                 "arrival).")
    window: str | None = _flag(None, "--window", "--trace-events: LO,HI seconds of the run "
                               "to keep.")

    def __post_init__(self) -> None:
        self.time_window()  # a bad --window fails before any work
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        for option in ("--result-filename", "--html", "--trace-events"):
            check_output_file(getattr(self, option[2:].replace("-", "_")), option)

    def time_window(self) -> tuple[float, float] | None:
        """--window as (lo, hi) seconds; ValueError naming the flag."""
        if self.window is None:
            return None
        try:
            lo, hi = (float(v) for v in self.window.split(","))
        except ValueError:
            raise ValueError(f"--window: expected LO,HI seconds, got {self.window!r}") from None
        if not 0 <= lo < hi:
            raise ValueError(f"--window: need 0 <= LO < HI, got {self.window!r}")
        return lo, hi

    def result_path(self, run_dir: Path) -> Path | None:
        if self.result_filename is not None:
            return self.result_filename
        return run_dir / "result.json" if self.save_result else None


def check_run(run: Run) -> None:
    """ValueError (one line, naming the directory) for a run that cannot be analysed: no
    requests, or a half-written table missing columns."""
    if run.requests.empty:
        raise ValueError(f"{run.path}: the run has no requests")
    missing = [c for c in REQUEST_COLUMNS if c not in run.requests.columns]
    if missing:
        raise ValueError(f"{run.path}: requests.parquet lacks columns {', '.join(missing)} "
                         "(half-written or not an rt run)")
    if not run.steps.empty:
        missing = [c for c in STEP_COLUMNS if c not in run.steps.columns]
        if missing:
            raise ValueError(f"{run.path}: steps.parquet lacks columns {', '.join(missing)}")
    times = [c for c in REQUEST_COLUMNS if c.endswith("_s") and c != "token_times_s"]
    _check_times(run, "requests.parquet", run.requests, times, required=("arrival_s",))
    if not run.steps.empty:
        _check_times(run, "steps.parquet", run.steps, ["start_s", "end_s"],
                     required=("start_s", "end_s"))


def _check_times(run: Run, table: str, frame: pd.DataFrame, columns: Sequence[str],
                 required: Sequence[str]) -> None:
    """ValueError naming the table, column and first bad value of a time column (s) that is
    not numeric or holds a value past +-MAX_RUN_S; a `required` one (an arrival, a step's
    start and end) must also be >= 0, not NaN (a failed request has no first token, and a
    difference of two clocks may be -1e-12). A hand-edited or corrupted table: once a
    TypeError, or a numpy error after the report's first lines."""
    for name in columns:
        column = frame[name]  # object: a vLLM result file's, None where it has no value
        if not pd.api.types.is_numeric_dtype(column):
            wrong = column[column.map(lambda v: v is not None and (
                isinstance(v, bool) or not isinstance(v, int | float)))]
            if len(wrong):
                raise ValueError(f"{run.path}: {table} column {name!r}: value "
                                 f"{wrong.iloc[0]!r} is not a number of seconds")
        values = column.to_numpy(dtype=np.float64, na_value=np.nan)
        if name in required:
            bad, rule = ~((values >= 0) & (values <= MAX_RUN_S)), f"in [0, {MAX_RUN_S:,.0f}]"
        else:
            bad, rule = np.abs(values) > MAX_RUN_S, f"at most {MAX_RUN_S:,.0f} in size"
            bad |= np.isinf(values)
        if bad.any():
            raise ValueError(f"{run.path}: {table} column {name!r}: value "
                             f"{float(values[bad.argmax()])}: times must be seconds {rule}")


def load_checked(path: Path) -> Run:
    """The run directory at `path` (or a vLLM result JSON), checked by `check_run`."""
    run = load_run(path)
    check_run(run)
    return run


def metric_keys(name: str, stats: dict[str, float]) -> dict[str, float]:
    """vLLM's keys for one metric: mean_{m}_ms, median_{m}_ms, std_{m}_ms, p{P}_{m}_ms."""
    out = {f"{stat}_{name}_ms": value for stat, value in stats.items()
           if stat in ("mean", "median", "std")}
    out.update({f"{stat}_{name}_ms": value for stat, value in stats.items()
                if stat.startswith("p")})
    return out


def measured_rate(requests: pd.DataFrame) -> float:
    """Requests per second of the arrivals (N / arrival span; inf if all arrive at once)."""
    span = float(requests["arrival_s"].max() - requests["arrival_s"].min())
    return len(requests) / span if span > 0 else math.inf


def _rate_value(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # vLLM writes the string "inf"


def result_dict(run: Run, options: ReportOptions | None = None) -> dict[str, Any]:
    """The report of one run, vLLM keys first (see the module docstring)."""
    options = options or ReportOptions()
    requests, info = run.requests, run.info
    m = benchmark_metrics(requests, options.percentiles)
    configured = info.get("request_rate")
    rate = float(configured) if configured is not None else measured_rate(requests)
    model = info.get("model") if isinstance(info.get("model"), dict) else {}
    result: dict[str, Any] = {
        "date": info.get("date") or datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": info.get("kind", "rt"),
        "backend": info.get("backend", "rt-" + str(info.get("kind", "run"))),
        "label": run.name,
        "model_id": model.get("name") if model else info.get("model"),
        "tokenizer_id": model.get("name") if model else info.get("model"),
        "num_prompts": len(requests),
        "request_rate": _rate_value(rate),
        "burstiness": info.get("burstiness", 1.0),
        "max_concurrency": info.get("max_concurrency"),
        "duration": m.duration_s,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input_tokens,
        "total_output_tokens": m.total_output_tokens,
        "request_throughput": m.request_throughput,
        "request_goodput": (request_goodput(requests, options.goodput, m.duration_s)
                            if options.goodput else None),
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name in options.percentile_metrics:
        result.update(metric_keys(name, m.stats[name]))
    result.update(_rt_keys(run, options))
    result.update(_fleet_keys(run))
    return result


def _fleet_keys(run: Run) -> dict[str, Any]:
    """A fleet run's figures (`analysis.fleet`): replicas, fleet prefix hit rate, imbalance
    (max/mean) of requests and prompt tokens, Jain's index, and each replica's share."""
    if "replica" not in run.requests.columns or run.requests["replica"].isna().all():
        return {}
    from analysis.fleet import fleet_summary, replica_table

    table = replica_table(run.requests, run.steps)
    summary = fleet_summary(table)
    return {"fleet_replicas": int(summary["replicas"]),
            "fleet_prefix_hit_rate": summary["prefix_hit_rate"],
            "fleet_request_imbalance": summary["request_imbalance"],
            "fleet_prompt_token_imbalance": summary["prompt_token_imbalance"],
            "fleet_jain_requests": summary["jain_requests"],
            "fleet_replica_shares": [round(float(x), 6) for x in table["share"]]}


def _rt_keys(run: Run, options: ReportOptions) -> dict[str, Any]:
    """rt's keys. A client-timed run (`timing: client`) has no server-side figures: they
    are None (JSON null; "n/a" in `rt compare`), never 0."""
    requests, steps = run.requests, run.steps
    client = run.info.get("timing") == "client"
    phases = phase_times(requests)
    out: dict[str, Any] = {}
    for name in PHASES:
        stats = summarize(phases[name].to_numpy(dtype=np.float64), options.percentiles)
        out.update({k: None if client else v for k, v in metric_keys(name, stats).items()})
    kv = steps["kv_usage"].to_numpy(dtype=np.float64) if len(steps) else np.zeros(1)
    hit_rate = prefix_cache_hit_rate(requests, run.info)
    server: dict[str, Any] = {
        "num_preemptions": int(requests["num_preemptions"].sum()),
        "num_preempted_requests": int((requests["num_preemptions"] > 0).sum()),
        "prefix_cache_hit_rate": None if math.isnan(hit_rate) else hit_rate,
        "mean_kv_cache_usage": float(kv.mean()),
        "max_kv_cache_usage": float(kv.max()),
        "num_engine_steps": len(steps),
    }
    if client:
        server = {k: None for k in server} | {"prefix_cache_hit_rate":
                                               server["prefix_cache_hit_rate"]}
    out.update(server)
    out.update({
        "measured_request_rate": _rate_value(measured_rate(requests)),
        "goodput_config": dict(options.goodput) or None,
        "percentile_metrics": ",".join(options.percentile_metrics),
        "metric_percentiles": ",".join(_pkey(p)[1:] for p in options.percentiles),
    })
    scaling = run.info.get("scaling")
    if scaling:  # a fleet run: GPU-hours and cost (analysis.scaling)
        out.update({"gpu_hours": scaling["gpu_hours"], "cost": scaling["cost"]})
    return out


def detailed(run: Run) -> dict[str, Any]:
    """`--save-detailed`'s per-request arrays, as vLLM names them (seconds)."""
    from analysis.metrics import completed_requests

    done = completed_requests(run.requests)
    return {
        "input_lens": done["prompt_len"].astype(int).tolist(),
        "output_lens": done["output_len"].astype(int).tolist(),
        "ttfts": (done["first_token_s"] - done["arrival_s"]).tolist(),
        "itls": [np.diff(np.asarray(t, dtype=np.float64)).tolist()
                 for t in done["token_times_s"]],
        "start_times": done["arrival_s"].tolist(),
        "errors": ["" for _ in range(len(done))],
    }


def report_run(run: Run, options: ReportOptions, files: ReportFiles, home: Path | None = None
               ) -> tuple[str, list[Path], dict[str, Any]]:
    """`rt report` of one checked run: the text to print (vLLM's block, rt's block and, for a
    server-timed run, the attribution), the files written (the result JSON, with
    --save-detailed the per-request attribution next to it, the HTML report, the trace
    events) and the figures to save."""
    from analysis.attribution import (
        attribution_buckets,
        attribution_summary,
        render_summary,
        request_attribution,
    )
    from analysis.console import benchmark_block, is_client_timed, rt_block

    result = result_dict(run, options)
    reqs, steps, client = run.requests, run.steps, is_client_timed(run.info)
    text = [benchmark_block(benchmark_metrics(reqs, options.percentiles),
                            options.percentile_metrics, options.percentiles,
                            goodput=result["request_goodput"]),
            rt_block(reqs, steps, prefix_cache_hit_rate(reqs, run.info), client_timing=client)]
    if not client:
        text.append(render_summary(attribution_summary(reqs)))
    if "replica" in reqs.columns:
        from analysis.fleet import fleet_block

        text.append(fleet_block(reqs, steps))
    if run.info.get("scaling"):
        from analysis.scaling import scaling_block

        text.append(scaling_block(run.info["scaling"]))
    written = _report_files(run, options, files)
    out = files.result_path(home or run.path)
    if out is not None:
        if files.save_detailed:
            result.update(detailed(run))
            written.append(out.with_suffix(".attribution.csv"))
            request_attribution(reqs).to_csv(written[-1], index=False)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        written.insert(0, out)
    figures: dict[str, Any] = {}
    if files.plots:
        from analysis.plots import report_figures

        figures = report_figures(reqs, steps, run.name, attribution_buckets(reqs, "ttft"),
                                 attribution_buckets(reqs, "e2el"))
        if (run.info.get("scaling") or {}).get("policy"):
            from analysis.scaling import replica_figure

            figures["replicas"] = replica_figure(run.info["scaling"], reqs)
    return "\n".join(text), written, figures


def _report_files(run: Run, options: ReportOptions, files: ReportFiles) -> list[Path]:
    written = []
    if files.html is not None:
        from analysis.html_report import write_html_report

        written.append(write_html_report(run, files.html, options))
    if files.trace_events is not None:
        from analysis.trace_events import write_trace_events

        written.append(write_trace_events(run, files.trace_events, files.requests,
                                          files.time_window()))
    return written
