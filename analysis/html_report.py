"""`rt report RUN --html`, `rt compare ... --html`: one self-contained HTML file per report.

A run's page: what ran (model, GPU, trace, engine flags), vLLM's "Serving Benchmark
Result" block as `vllm bench serve` prints it, rt's attribution (per part, per slowest
group, per percentile bucket), percentile curves and CDFs, the run's timeline, and the
slowest requests as a sortable table whose rows expand into the request's parts and its
timeline (`analysis.timelines`). A fleet run adds its replicas (`analysis.html_fleet`), and
each slow request's replica (P/D: and prefill replica), its timeline read from that
replica's steps. Several runs: the comparison table and overlaid curves
first, then each run's page folded. Figures are inline SVG (matplotlib), the JS is a few
lines for sorting and expanding; nothing is fetched. What a run lacks (engine-side times
of a client-timed run, steps) reads "n/a", never 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.attribution import SHORT, attribution_buckets, attribution_summary
from analysis.compare import compare_table, flatten, run_labels
from analysis.console import CLIENT_TIMING_NOTE, benchmark_block, is_client_timed
from analysis.engine_steps import EngineSteps
from analysis.html_fleet import fleet_section
from analysis.html_parts import NA, TAB10, cell, fmt, na_block, page, svg, table
from analysis.metrics import (
    PARTS,
    attribution,
    benchmark_metrics,
    completed_requests,
    parts_of,
    per_request_latencies,
    prefix_cache_hit_rate,
)
from analysis.plots import (
    ROUTING_COLOR,
    TRANSFER_COLOR,
    attribution_bars,
    cdfs,
    latency_values,
    percentile_curves,
    timeline,
)
from analysis.report import ReportOptions, result_dict
from analysis.rundir import Run
from analysis.timelines import LABELS, coalesced, engine_timeline

DEFAULT_SLOWEST = 100
CDF_POINTS = 1000  # a CDF is drawn through this many quantiles (keeps the SVG small)
KIND_COLORS = dict(zip(PARTS, TAB10, strict=False)) | {
    "routing_s": ROUTING_COLOR, "kv_transfer_s": TRANSFER_COLOR,
    "skipped_s": TAB10[2], "queue_s": "#c7c7c7", "client_wait_s": TAB10[9],
    "client_stream_s": TAB10[8], "mixed_s": "#999999"}
KIND_OF_LABEL = {label: kind for kind, label in LABELS.items()}
META_KEYS = ("kind", "timing", "model.name", "gpu.name", "trace.name", "trace.requests",
             "scheduler_config.max_num_batched_tokens", "scheduler_config.max_num_seqs",
             "cache_config.block_size", "cache_config.num_blocks",
             "cache_config.enable_prefix_caching", "cost_model.kind", "seed", "date",
             "rt_version", "endpoint.url")


def _compressed(series: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """Each metric's values as CDF_POINTS quantiles (the CDF looks the same, the SVG is
    small even for pooled ITL)."""
    grid = np.linspace(0.0, 1.0, CDF_POINTS)
    return {label: {m: np.quantile(v, grid) if v.size > CDF_POINTS else v
                    for m, v in values.items()} for label, values in series.items()}


def _curves(series: dict[str, dict[str, np.ndarray]]) -> str:
    return (svg(percentile_curves(series), "percentile curves")
            + svg(cdfs(_compressed(series)), "CDFs"))


def _meta(run: Run) -> str:
    flat = flatten(run.info)
    rows = [[f"<td>{escape(k)}</td>", f"<td>{fmt(flat[k])}</td>"] for k in META_KEYS
            if k in flat and flat[k] is not None]
    rows.append(["<td>requests / engine steps</td>",
                 f"<td>{len(run.requests):,} / {len(run.steps):,}</td>"])
    return table(["run.json", "value"], rows)


def _rt_figures(run: Run) -> str:
    """rt's counters; engine-side ones are n/a for a run without steps."""
    requests, steps, client = run.requests, run.steps, is_client_timed(run.info)
    no_steps = steps.empty
    kv = steps["kv_usage"] if not no_steps else None
    values = [
        ("Preemptions", NA if client else int(requests["num_preemptions"].sum())),
        ("Requests preempted", NA if client else int((requests["num_preemptions"] > 0).sum())),
        ("Prefix cache hit rate (%)", prefix_cache_hit_rate(requests, run.info) * 100),
        ("Mean KV cache usage (%)", NA if kv is None else float(kv.mean()) * 100),
        ("Max KV cache usage (%)", NA if kv is None else float(kv.max()) * 100),
        ("Engine steps", NA if no_steps else len(steps)),
    ]
    return table(["rt", "value"], [[f"<td>{escape(k)}</td>",
                                    cell(None if v == NA else v)] for k, v in values])


def _attribution(run: Run) -> str:
    if is_client_timed(run.info):
        return na_block("Where the time went", CLIENT_TIMING_NOTE)
    parts = attribution(run.requests)
    rows = [[f'<td><i style="background:{KIND_COLORS[r.column]};display:inline-block;'
             f'width:10px;height:10px"></i> {escape(r.part)}</td>', cell(r.mean_ms),
             cell(r.p99_ms), f'<td data-v="{r.share}">{r.share * 100:.1f}% <span class="share" '
             f'style="width:{r.share * 120:.0f}px"></span></td>'] for r in parts.itertuples()]
    summary = attribution_summary(run.requests)
    kinds = parts_of(run.requests)
    columns = ["requests", "ttft", "e2el", *(c.removesuffix("_s") + "_ms" for c in kinds)]
    head = ["mean ms", "n", "TTFT", "E2EL", *(SHORT[c] for c in kinds)]
    srows = [[f"<td>{escape(g['group'])}</td>"] + [cell(g[c], ".1f") for c in columns]
             for g in summary.to_dict("records")]
    bars = attribution_bars(attribution_buckets(run.requests, "ttft"),
                            attribution_buckets(run.requests, "e2el"))
    return (table(["part", "mean ms", "p99 ms", "share of mean E2E"], rows)
            + "<h3>All requests and the slowest</h3>" + table(head, srows)
            + svg(bars, "attribution by percentile bucket"))


def _bar(row: pd.Series, total_s: float, kinds: dict[str, str]) -> str:
    spans = "".join(
        f'<span style="width:{row[c] / total_s * 100:.3f}%;background:{KIND_COLORS[c]}" '
        f'title="{escape(label)}: {row[c] * 1e3:.1f} ms"></span>'
        for c, label in kinds.items() if total_s > 0 and row[c] > 0)
    return f'<div class="bar">{spans}</div>'


def _gantt(row: pd.Series, steps: EngineSteps, client: bool) -> tuple[str, str]:
    """The request's segments positioned over [arrival, finish), and as a sentence."""
    tl = engine_timeline(row, steps, client)
    span = max(tl.finish_s - tl.arrival_s, 1e-12)
    boxes, words = [], []
    for seg in coalesced(tl):
        ms = (seg.end_s - seg.start_s) * 1e3
        extra = ", ".join(f"{k[:-3]} {v:.1f} ms" if k.endswith(" ms") else f"{k} {v}"
                          for k, v in seg.args.items())
        title = f"{seg.label}: {ms:.1f} ms" + (f" ({extra})" if extra else "")
        color = KIND_COLORS[KIND_OF_LABEL.get(str(seg.args.get("dominant")), seg.kind)]
        fill = (f"repeating-linear-gradient(45deg,{color} 0 4px,#fff 4px 6px)"
                if seg.kind == "mixed_s" else color)
        boxes.append(f'<span style="left:{(seg.start_s - tl.arrival_s) / span * 100:.3f}%;'
                     f'width:{(seg.end_s - seg.start_s) / span * 100:.3f}%;'
                     f'background:{fill}" title="{escape(title)}"></span>')
        words.append(escape(title))
    return f'<div class="gantt">{"".join(boxes)}</div>', " &rarr; ".join(words)


def _legend(kinds: Sequence[str]) -> str:
    return '<p class="legend">' + "".join(
        f'<span><i style="background:{KIND_COLORS[k]}"></i>{escape(LABELS[k])}</span>'
        for k in kinds) + "</p>"


SLOW_HEAD = ("request", "arrival s", "prompt", "cached", "output", "TTFT ms", "TPOT ms",
             "E2E ms", "queue ms", "preemptions", "status")
# After "request" in a fleet run's table: where it decoded, and (P/D) where it prefilled.
REPLICA_HEAD = {"replica": "replica", "prefill_replica": "prefill replica"}


def _slow_cells(row: pd.Series, lat_row: pd.Series, client: bool,
                replica_columns: list[str]) -> list[str]:
    queue = [c for c in PARTS if c.startswith("queue_") or c == "step_boundary_s"]
    waited = None if client else float(row[queue].sum()) * 1e3
    return [f"<td>{escape(str(row['request_id']))}</td>",
            *(cell(int(row[c])) for c in replica_columns),
            cell(float(row["arrival_s"]), ".3f"), cell(int(row["prompt_len"])),
            cell(int(row["cached_tokens"])), cell(int(row["output_len"])),
            cell(lat_row["ttft"], ".1f"), cell(lat_row["tpot"], ".2f"),
            cell(lat_row["e2el"], ".1f"), cell(waited, ".1f"),
            cell(None if client else int(row["num_preemptions"])),
            f"<td>{escape(str(row['status']))}</td>"]


def _slowest(run: Run, count: int) -> str:
    """The `count` slowest completed requests by E2E, sortable; a row expands into its
    parts and its timeline (from its own replica's steps in a fleet)."""
    client = is_client_timed(run.info)
    lat = per_request_latencies(run.requests).sort_values("e2el", ascending=False,
                                                          kind="stable").head(count)
    done = completed_requests(run.requests).loc[lat.index]
    steps = EngineSteps(run.steps.reset_index(drop=True))
    replica_columns = [c for c in REPLICA_HEAD if c in run.requests.columns]
    head = [SLOW_HEAD[0], *(REPLICA_HEAD[c] for c in replica_columns), *SLOW_HEAD[1:]]
    kinds = parts_of(run.requests)
    lines = []
    for (_, row), (_, lat_row) in zip(done.iterrows(), lat.iterrows(), strict=True):
        cells = _slow_cells(row, lat_row, client, replica_columns)
        gantt, words = _gantt(row, steps, client)
        parts = (na_block("parts", CLIENT_TIMING_NOTE) if client
                 else _bar(row, float(row["finish_s"] - row["arrival_s"]), kinds))
        detail = (f"parts of E2E{parts}timeline (arrival to finish){gantt}"
                  f"<small>{words}</small>")
        lines.append(f'<tr class="row">{"".join(cells)}</tr>\n<tr class="detail" hidden>'
                     f'<td colspan="{len(head)}">{detail}</td></tr>')
    legend = ["client_wait_s", "client_stream_s"] if client else [*kinds, "skipped_s",
                                                                  "mixed_s"]
    return (f"<p>The {len(lat)} slowest of {len(completed_requests(run.requests)):,} completed "
            f"requests by E2E latency; click a header to sort, a row to see its parts and "
            f"timeline.</p>{_legend(legend)}"
            f'<table class="sortable" id="slowest"><thead><tr>'
            + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr></thead><tbody>\n"
            + "\n".join(lines) + "\n</tbody></table>")


FLEET_TIMELINE = ("<p>Every replica's steps together (a window's means are over all their "
                  "steps); each replica's own under Replicas.</p>")


def run_section(run: Run, options: ReportOptions, slowest: int = DEFAULT_SLOWEST,
                curves: bool = True) -> str:
    """One run's part of the page (see the module docstring)."""
    m = benchmark_metrics(run.requests, options.percentiles)
    result = result_dict(run, options)
    block = benchmark_block(m, options.percentile_metrics, options.percentiles,
                            goodput=result["request_goodput"])
    parts = [f"<h2>What ran</h2>{_meta(run)}",
             f"<details><summary>run.json</summary><pre>"
             f"{escape(json.dumps(run.info, indent=2, sort_keys=True))}</pre></details>",
             f"<h2>vLLM's result</h2><pre>{escape(block)}</pre>",
             f"<h2>Where the time went</h2>{_rt_figures(run)}{_attribution(run)}"]
    if curves:
        parts.append("<h2>Latency percentiles and CDFs</h2>"
                     + _curves({run.name: latency_values(run.requests)}))
    fleet = "replica" in run.requests.columns
    parts.append("<h2>Timeline</h2>" + (FLEET_TIMELINE if fleet else "")
                 + (svg(timeline(run.steps), "timeline") if not run.steps.empty
                    else na_block("Timeline", "the run has no engine steps (client-timed)")))
    if fleet:
        parts.append(f"<h2>Replicas</h2>{fleet_section(run)}")
    parts.append(f"<h2>Slowest requests</h2>{_slowest(run, slowest)}")
    return "\n".join(parts)


def _compare(runs: Sequence[Run], options: ReportOptions) -> str:
    labels = run_labels(runs)
    data = compare_table([result_dict(r, options) for r in runs], labels)
    rows = [[f"<td>{escape(str(key))}</td>"] + [cell(v, ".4g") for v in values]
            for key, values in zip(data.index, data.to_numpy(), strict=True)]
    series = {label: latency_values(r.requests) for label, r in zip(labels, runs, strict=True)}
    return ("<h2>Side by side</h2>" + table(["metric", *map(str, data.columns)], rows)
            + "<h2>Latency percentiles and CDFs</h2>" + _curves(series))


def html_report(runs: Run | Sequence[Run], options: ReportOptions | None = None,
                slowest: int = DEFAULT_SLOWEST) -> str:
    """The HTML document of one run, or of several compared."""
    options = options or ReportOptions()
    if isinstance(runs, Run):
        runs = [runs]
    if len(runs) == 1:
        run = runs[0]
        title = f"rt report: {run.name}"
        body = f"<h1>{escape(title)}</h1>{_subtitle(run)}{run_section(run, options, slowest)}"
        return page(title, body)
    title = f"rt compare: {', '.join(r.name for r in runs)}"
    folded = "\n".join(
        f"<details{' open' if i == 0 else ''}><summary><b>{escape(label)}</b> ({escape(r.name)})"
        f"</summary>{run_section(r, options, slowest, curves=False)}</details>"
        for i, (label, r) in enumerate(zip(run_labels(runs), runs, strict=True)))
    body = f"<h1>{escape(title)}</h1>{_compare(runs, options)}<h2>Each run</h2>{folded}"
    return page(title, body)


def _subtitle(run: Run) -> str:
    info = run.info
    model = info.get("model")
    name = model.get("name") if isinstance(model, dict) else model
    bits = [str(info.get("kind", "run")), str(name or ""), f"{len(run.requests):,} requests"]
    if is_client_timed(info):
        bits.append("client-timed: engine-side parts are n/a")
    return f'<p class="sub">{escape(" · ".join(b for b in bits if b))}</p>'


def write_html_report(runs: Run | Sequence[Run], out_path: Path,
                      options: ReportOptions | None = None,
                      slowest: int = DEFAULT_SLOWEST) -> Path:
    """Write `html_report(runs, ...)` to `out_path` (parents created); returns the path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(html_report(runs, options, slowest), encoding="utf-8")
    return out_path


def sweep_html(results: pd.DataFrame, figures: dict[str, Figure] | None = None,
               title: str = "rt sweep", slos: dict[str, float] | None = None) -> str:
    """A sweep's page: the results table (`analysis.sweep.results_table`, one row per run,
    sortable) and its figures (e.g. `plots.latency_vs_rate`)."""
    head = [str(c) for c in results.columns]
    rows = []
    for record in results.to_dict("records"):
        cells = []
        for value in record.values():
            if isinstance(value, bool):
                cells.append(f'<td data-v="{int(value)}">{"yes" if value else "no"}</td>')
            else:
                cells.append(cell(value, ".4g"))
        rows.append(cells)
    slo_text = ", ".join(f"{k} <= {v:g}" for k, v in (slos or {}).items())
    body = (f"<h1>{escape(title)}</h1><p class=\"sub\">{len(results)} runs"
            + (f" · SLOs: {escape(slo_text)}" if slo_text else "") + "</p>"
            + "<h2>Results</h2>" + table(head, rows, sortable=True)
            + "".join(f"<h2>{escape(name)}</h2>{svg(fig, name)}"
                      for name, fig in (figures or {}).items()))
    return page(title, body)


def write_sweep_html(results: pd.DataFrame, out_path: Path,
                     figures: dict[str, Figure] | None = None, title: str = "rt sweep",
                     slos: dict[str, float] | None = None) -> Path:
    """Write `sweep_html(...)` to `out_path` (parents created); returns the path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(sweep_html(results, figures, title, slos), encoding="utf-8")
    return out_path
