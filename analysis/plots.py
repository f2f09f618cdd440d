"""Plots as matplotlib Figures (no pyplot, no global state; `fig.savefig(path)` renders with
Agg). The CLI decides where they go.

    percentile_curves   TTFT/ITL/TPOT/E2EL against percentile (x up to 99.9, tail stretched),
                        log y, one line per run
    cdfs                empirical CDFs, log x, one line per run
    timeline            running/waiting requests, KV usage, scheduled tokens per step
    replica_timelines   a fleet's replicas as small multiples: running/waiting, KV usage
    attribution_bars    mean parts per percentile bucket (by TTFT and by E2E), stacked
    latency_vs_rate     p50/p90/p99 against request rate per configuration, knee marked
    latency_vs_flag     p50/p90/p99 against one engine flag (e.g. the token budget)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from analysis.attribution import PART_MS
from analysis.metrics import (
    PARTS,
    inter_token_latencies,
    kv_usage_over_time,
    per_request_latencies,
)

# A part's colour, by its column in ms: C0..C8 in PARTS order, fleets' routing and P/D's KV
# transfer outside tab10's first nine (the HTML report uses the same).
ROUTING_COLOR, TRANSFER_COLOR = "#17becf", "#393b79"
PART_COLORS = {c.removesuffix("_s") + "_ms": f"C{i}" for i, c in enumerate(PARTS)} | {
    "routing_ms": ROUTING_COLOR, "kv_transfer_ms": TRANSFER_COLOR}
TITLES = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2el": "E2E latency"}
PERCENTILE_TICKS = (0.0, 50.0, 90.0, 99.0, 99.9)
STAT_STYLES = {"p50": ":", "p90": "--", "p99": "-"}

Series = Mapping[str, Mapping[str, np.ndarray]]  # label -> metric -> values (ms)


def latency_values(requests: pd.DataFrame) -> dict[str, np.ndarray]:
    """TTFT, ITL (pooled), TPOT and E2EL values in ms of one run's requests."""
    lat = per_request_latencies(requests)
    return {"ttft": lat["ttft"].to_numpy(dtype=np.float64),
            "itl": inter_token_latencies(requests),
            "tpot": lat["tpot"].dropna().to_numpy(dtype=np.float64),
            "e2el": lat["e2el"].to_numpy(dtype=np.float64)}


def _tail_x(p: np.ndarray) -> np.ndarray:
    """Percentile to x: -log10(1 - p/100), so 90, 99 and 99.9 are evenly spaced."""
    return -np.log10(1.0 - np.asarray(p) / 100.0)


def _grid(ncols: int, nplots: int, size: tuple[float, float]) -> tuple[Figure, list[Axes]]:
    nrows = (nplots + ncols - 1) // ncols
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel().tolist()
    for ax in axes[nplots:]:
        ax.set_visible(False)
    return fig, axes[:nplots]


def percentile_curves(series: Series, metrics: Sequence[str] = ("ttft", "itl", "tpot",
                                                                 "e2el")) -> Figure:
    """x = percentile (0 to 99.9, tail stretched), y = latency in ms (log)."""
    fig, axes = _grid(2, len(metrics), (5.5, 3.6))
    grid = np.concatenate([np.linspace(0, 90, 91), np.linspace(90, 99.9, 200)[1:]])
    for ax, metric in zip(axes, metrics, strict=True):
        for label, values in series.items():
            v = values[metric]
            if v.size:
                ax.plot(_tail_x(grid), np.maximum(np.percentile(v, grid), 1e-3), label=label)
        ax.set_yscale("log")
        ax.set_xticks(_tail_x(np.array(PERCENTILE_TICKS)),
                      [f"{p:g}" for p in PERCENTILE_TICKS])
        ax.set_xlabel("percentile")
        ax.set_ylabel("ms (log)")
        ax.set_title(f"{TITLES[metric]} by percentile (lower is better)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    return fig


def cdfs(series: Series, metrics: Sequence[str] = ("ttft", "itl", "tpot", "e2el")) -> Figure:
    """Empirical CDFs, x = ms (log)."""
    fig, axes = _grid(2, len(metrics), (5.5, 3.6))
    for ax, metric in zip(axes, metrics, strict=True):
        for label, values in series.items():
            v = np.sort(values[metric])
            if v.size:
                ax.step(np.maximum(v, 1e-3), np.arange(1, v.size + 1) / v.size, where="post",
                        label=label)
        ax.set_xscale("log")
        ax.set_xlabel("ms (log)")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_title(f"{TITLES[metric]} CDF")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    return fig


def timeline(steps: pd.DataFrame, bin_s: float | None = None) -> Figure:
    """The run over time: requests running/waiting, KV usage (mean and max per window),
    scheduled prefill and decode tokens per step."""
    span = float(steps["end_s"].max()) if len(steps) else 1.0
    bin_s = bin_s or max(span / 400, 1e-3)
    t = kv_usage_over_time(steps, bin_s)
    fig, axes = _grid(1, 3, (10, 2.6))
    axes[0].plot(t["time_s"], t["running"], label="running")
    axes[0].plot(t["time_s"], t["waiting"], label="waiting")
    axes[0].set_ylabel("requests")
    axes[0].legend(fontsize=8)
    axes[1].plot(t["time_s"], t["kv_usage_mean"] * 100, label="mean")
    axes[1].plot(t["time_s"], t["kv_usage_max"] * 100, label="max", alpha=0.6)
    axes[1].set_ylabel("KV cache usage (%)")
    axes[1].legend(fontsize=8)
    per_step = t["steps"].where(t["steps"] > 0)
    axes[2].stackplot(t["time_s"], t["prefill_tokens"] / per_step,
                      t["decode_tokens"] / per_step, labels=["prefill", "decode"])
    axes[2].set_ylabel("tokens per step")
    axes[2].set_xlabel(f"time (s), {bin_s:.3g} s windows")
    axes[2].legend(fontsize=8, loc="upper right")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[0].set_title("Run timeline")
    return fig


def replica_timelines(steps: pd.DataFrame, replicas: Mapping[int, str],
                      bin_s: float | None = None) -> Figure:
    """Small multiples of a fleet run: a row per replica in `replicas` (index -> title),
    running and waiting requests, and KV usage (mean per window); axes shared so the rows
    compare."""
    span = float(steps["end_s"].max()) if len(steps) else 1.0
    bin_s = bin_s or max(span / 200, 1e-3)
    fig = Figure(figsize=(10, 0.4 + 1.5 * len(replicas)), layout="constrained")
    axes = fig.subplots(len(replicas), 2, squeeze=False, sharex=True, sharey="col")
    for (left, right), (r, title) in zip(axes, replicas.items(), strict=True):
        t = kv_usage_over_time(steps[steps["replica"] == r], bin_s)
        left.plot(t["time_s"], t["running"], label="running", lw=1)
        left.plot(t["time_s"], t["waiting"], label="waiting", lw=1)
        right.plot(t["time_s"], t["kv_usage_mean"] * 100, color="C2", lw=1)
        left.set_ylabel(title, fontsize=8)
        for ax in (left, right):
            ax.grid(True, alpha=0.3)
            ax.tick_params(labelsize=7)
    axes[0][0].set_title("requests: running, waiting (mean per window)", fontsize=9)
    axes[0][1].set_title("KV cache usage (%)", fontsize=9)
    axes[0][0].legend(fontsize=7, loc="upper right")
    for ax in axes[-1]:
        ax.set_xlabel(f"time (s), {bin_s:.3g} s windows", fontsize=8)
    return fig


def attribution_bars(by_ttft: pd.DataFrame, by_e2e: pd.DataFrame) -> Figure:
    """Stacked mean parts (ms) per percentile bucket; rows of `attribution_buckets`. The
    TTFT panel leaves decode out (what is left is TTFT, plus any preemption after the first
    token); the E2E panel stacks every part."""
    fig, axes = _grid(2, 2, (6, 4))
    panels = ((axes[0], by_ttft, "TTFT", [c for c in PART_MS if c != "decode_ms"]),
              (axes[1], by_e2e, "E2E", list(PART_MS)))
    for ax, table, name, columns in panels:
        bottom = np.zeros(len(table))
        x = np.arange(len(table))
        for column, label in PART_MS.items():
            if column not in columns or column not in table.columns:
                continue
            values = table[column].to_numpy(dtype=np.float64)
            if values.any():
                ax.bar(x, values, bottom=bottom, label=label, color=PART_COLORS[column])
                bottom += values
        ax.set_xticks(x, [f"{g}\n(n={n})" for g, n in zip(table["group"], table["requests"],
                                                             strict=True)])
        ax.set_xlabel(f"requests bucketed by {name} percentile")
        ax.set_ylabel("mean ms, stacked")
        what = "parts before decode" if name == "TTFT" else "all parts of E2E"
        ax.set_title(f"Where the time went, by {name} ({what})", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    return fig


def knee_index(x: Sequence[float], y: Sequence[float]) -> int | None:
    """The knee of a rising latency curve (Kneedle: x and y scaled to [0, 1], the point
    farthest below the chord from first to last). None with fewer than three points or
    no rise."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xs.size < 3 or np.ptp(xs) == 0 or np.ptp(ys) == 0:
        return None
    xn = (xs - xs.min()) / np.ptp(xs)
    yn = (ys - ys.min()) / np.ptp(ys)
    gap = xn - yn
    best = int(np.argmax(gap))
    return best if gap[best] > 0 else None


def latency_vs_rate(table: pd.DataFrame, config_column: str = "config",
                    metrics: Sequence[str] = ("ttft", "itl", "e2el"),
                    rate_column: str = "request_rate") -> Figure:
    """p50/p90/p99 (columns `p50_{m}_ms`, ...) against request rate, one color per
    configuration; the knee of each p99 curve is circled."""
    fig, axes = _grid(len(metrics), len(metrics), (5, 3.8))
    colors = [f"C{i}" for i in range(10)]
    for ax, metric in zip(axes, metrics, strict=True):
        for i, (config, rows) in enumerate(table.groupby(config_column, sort=False)):
            rows = rows.sort_values(rate_column)
            color = colors[i % len(colors)]
            for stat, style in STAT_STYLES.items():
                column = f"{stat}_{metric}_ms"
                if column in rows:
                    ax.plot(rows[rate_column], rows[column], style, color=color, marker=".",
                            label=f"{config} {stat}" if stat == "p99" else None)
            p99 = f"p99_{metric}_ms"
            knee = knee_index(rows[rate_column], rows[p99]) if p99 in rows else None
            if knee is not None:
                ax.plot(rows[rate_column].iloc[knee], rows[p99].iloc[knee], "o", ms=12,
                        mfc="none", color=color)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s, log)")
        ax.set_ylabel("ms (log)")
        ax.set_title(f"{TITLES[metric]} vs rate: p50 dotted, p90 dashed, p99 solid, o = knee",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    return fig


def latency_vs_flag(table: pd.DataFrame, flag: str, series_column: str | None = None,
                    metrics: Sequence[str] = ("ttft", "itl")) -> Figure:
    """p50/p90/p99 against one engine flag (log2 x), e.g. the TTFT/ITL trade-off over
    `max_num_batched_tokens`; one color per value of `series_column` (e.g. the rate)."""
    fig, axes = _grid(len(metrics), len(metrics), (5.5, 4))
    groups = table.groupby(series_column, sort=False) if series_column else [(None, table)]
    for ax, metric in zip(axes, metrics, strict=True):
        for i, (name, rows) in enumerate(groups):
            rows = rows.sort_values(flag)
            for stat, style in STAT_STYLES.items():
                column = f"{stat}_{metric}_ms"
                if column in rows:
                    prefix = f"{series_column}={name} " if series_column else ""
                    ax.plot(rows[flag], rows[column], style, color=f"C{i % 10}", marker="o",
                            label=f"{prefix}{stat}")
        ax.set_xscale("log", base=2)
        ticks = sorted(table[flag].unique())
        ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel(flag)
        ax.set_ylabel("ms (log)")
        ax.set_title(f"{TITLES[metric]} vs {flag} (lower is better)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def report_figures(requests: pd.DataFrame, steps: pd.DataFrame, label: str,
                   by_ttft: pd.DataFrame, by_e2e: pd.DataFrame) -> dict[str, Figure]:
    """The PNGs of `rt report`, by file stem. No attribution figure when no part has a
    value (a client-timed run: the parts are NaN), no timeline without steps."""
    series = {label: latency_values(requests)}
    figures = {"percentiles": percentile_curves(series), "cdf": cdfs(series)}
    if _has_parts(by_ttft) or _has_parts(by_e2e):
        figures["attribution"] = attribution_bars(by_ttft, by_e2e)
    if len(steps):
        figures["timeline"] = timeline(steps)
    return figures


def _has_parts(table: pd.DataFrame) -> bool:
    values = table[[c for c in PART_MS if c in table]].to_numpy(dtype=np.float64)
    return bool(np.nan_to_num(values).any())
