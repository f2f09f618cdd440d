"""Sweep results: the SLO language, the search for the highest rate that meets every SLO
(bisection), and the results table. Pure functions over result dicts (`report.result_dict`)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.metrics import METRICS

SWEEP_TABLE = "sweep.csv"  # the sweep's summary table, in its result directory

_SLO_KEY = re.compile(r"^(mean|median|std|p(\d+(?:\.\d+)?))_([a-z0-9_]+)_ms$")
_SLO_METRICS = (*METRICS, "request_queue_time", "request_prefill_time",
                "request_decode_time", "request_inference_time")


def sweep_slos(slo: str | None, find_max_rate: bool) -> dict[str, float] | None:
    """--slo parsed (None without it); ValueError for --find-max-rate without --slo."""
    slos = parse_slo(slo) if slo is not None else None
    if find_max_rate and not slos:
        raise ValueError("--find-max-rate needs --slo")
    return slos


def parse_slo(text: str) -> dict[str, float]:
    """`p99_ttft_ms=500,p99_itl_ms=50`: result keys and their upper bounds (ms). ValueError
    on an unknown key or a bad value."""
    slos: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        key, sep, value = item.partition("=")
        match = _SLO_KEY.match(key.strip())
        if not sep or not match or match.group(3) not in _SLO_METRICS:
            raise ValueError(f"--slo: expected KEY=MS with KEY like p99_ttft_ms or "
                             f"mean_itl_ms (metrics {', '.join(_SLO_METRICS)}), got {item!r}")
        if match.group(2) is not None and not 0 < float(match.group(2)) < 100:
            raise ValueError(f"--slo: {item!r}: the percentile must be in (0, 100)")
        if key.strip() in slos:  # (once the last bound taken without a word)
            raise ValueError(f"--slo: {key.strip()!r} given twice")
        try:
            slos[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {item!r}: {value!r} is not a number") from None
        if not 0 < slos[key.strip()] < math.inf:  # nan too: no latency meets it
            raise ValueError(f"--slo: {item!r}: the bound must be a number of ms > 0")
    if not slos:
        raise ValueError("--slo: no SLO given")
    return slos


def slo_needs(slos: dict[str, float]) -> tuple[list[str], list[float]]:
    """The metrics and percentiles a report must compute for these SLOs."""
    metrics, percentiles = [], []
    for key in slos:
        match = _SLO_KEY.match(key)
        assert match is not None
        metrics.append(match.group(3))
        if match.group(2) is not None:
            percentiles.append(float(match.group(2)))
    return metrics, percentiles


def meets_slo(result: dict[str, Any], slos: dict[str, float]) -> bool:
    """Every SLO holds (value <= bound), and no request failed."""
    return result.get("failed", 0) == 0 and all(
        float(result[key]) <= bound for key, bound in slos.items())


@dataclass
class RateSearch:
    """Bisection on request rate for the highest rate meeting the SLOs, within [lo, hi].

    First both ends are run; if `lo` fails the answer is "below lo", if `hi` passes it is
    "at least hi"; otherwise the bracket halves until (hi - lo) / hi <= tolerance. `best` is
    the highest passing rate found (None if none passed)."""

    lo: float
    hi: float
    tolerance: float = 0.05
    runs: int = 0
    best: float | None = None
    status: str = "searching"
    _lo_ok: bool | None = field(default=None, repr=False)
    _hi_ok: bool | None = field(default=None, repr=False)

    def next_rates(self) -> list[float]:
        """Rates to run next ([] when done)."""
        if self.status != "searching":
            return []
        if self._lo_ok is None:
            return [self.lo, self.hi]
        return [_round(math.sqrt(self.lo * self.hi) if self.lo > 0 else self.hi / 2)]

    def record(self, rate: float, ok: bool) -> None:
        self.runs += 1
        if ok and (self.best is None or rate > self.best):
            self.best = rate
        if self._lo_ok is None or self._hi_ok is None:
            if rate == self.lo:
                self._lo_ok = ok
            if rate == self.hi:
                self._hi_ok = ok
            if self._lo_ok is not None and self._hi_ok is not None:
                if not self._lo_ok:
                    self.status = "below range"
                elif self._hi_ok:
                    self.status = "at least hi"
                else:
                    self._check_done()
            return
        if ok:
            self.lo = rate
        else:
            self.hi = rate
        self._check_done()

    def _check_done(self) -> None:
        if (self.hi - self.lo) / self.hi <= self.tolerance:
            self.status = "found"


def _round(rate: float) -> float:
    return float(f"{rate:.4g}")


TABLE_KEYS = ("completed", "request_throughput", "request_goodput", "p50_ttft_ms",
              "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p99_tpot_ms", "p99_e2el_ms",
              "num_preemptions")


def results_table(records: Sequence[dict[str, Any]], point_keys: Sequence[str],
                  slos: dict[str, float] | None = None) -> pd.DataFrame:
    """One row per run: the point's values, then the headline metrics (and whether the run
    meets the SLOs)."""
    keys = [k for k in TABLE_KEYS if any(r.get(k) is not None for r in records)]
    if slos:
        keys += [k for k in slos if k not in keys]
    rows = []
    for record in records:
        row = {k: record.get(k) for k in point_keys}
        row.update({k: record.get(k) for k in keys})
        if slos:
            row["meets_slo"] = meets_slo(record, slos)
        rows.append(row)
    return pd.DataFrame(rows)


def render(table: pd.DataFrame) -> str:
    """Fixed-width text, one line per run."""
    columns = list(table.columns)
    widths = {c: max(len(str(c)), *(len(_cell(v)) for v in table[c])) + 2 for c in columns}
    lines = ["".join(f"{str(c):>{widths[c]}}" for c in columns)]
    for row in table.itertuples(index=False):
        lines.append("".join(f"{_cell(v):>{widths[c]}}" for c, v in zip(columns, row,
                                                                          strict=True)))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() and abs(value) >= 100 else f"{value:.2f}"
    return str(value)


# ---- the sweep's orchestration that needs no simulator: rate search and the output ---------

RunRates = Callable[[list[tuple[int, float]]], list[dict[str, Any]]]


def rate_bracket(rate_range: Sequence[float] | None, rates: Sequence[float] | None,
                 trace_rate: float | None) -> tuple[float, float]:
    """The search's [lo, hi]: --rate-range, else the extremes of --request-rate, else 0.5x to
    8x the trace's own mean rate. ValueError when there is none or lo >= hi."""
    bracket = list(rate_range) if rate_range is not None else None
    if bracket is None and rates and len(rates) >= 2:
        bracket = [min(rates), max(rates)]
    if bracket is None and trace_rate is not None:
        bracket = [round(trace_rate * 0.5, 4), round(trace_rate * 8, 4)]
    if bracket is None or len(bracket) != 2 or bracket[0] >= bracket[1]:
        raise ValueError("--find-max-rate needs a bracket: --rate-range LO,HI (LO < HI)")
    return bracket[0], bracket[1]


def search_max_rates(num_configs: int, run: RunRates, slos: dict[str, float],
                     bracket: tuple[float, float], tolerance: float
                     ) -> tuple[list[dict[str, Any]], list[RateSearch]]:
    """Bisect every configuration's rate at once: each round runs the next rates of all
    searches in one batch (`run` takes (config index, rate) pairs and returns their result
    dicts in order). Returns every run's record and the finished searches."""
    searches = [RateSearch(bracket[0], bracket[1], tolerance) for _ in range(num_configs)]
    records: list[dict[str, Any]] = []
    while batch := [(i, r) for i, s in enumerate(searches) for r in s.next_rates()]:
        for (i, rate), record in zip(batch, run(batch), strict=True):
            searches[i].record(rate, meets_slo(record, slos))
            records.append(record)
    return records, searches


def search_summary(labels: dict[str, Any], search: RateSearch) -> str:
    """One line: the highest rate meeting the SLOs for one configuration."""
    name = ", ".join(f"{k}={v}" for k, v in labels.items()) or "config"
    answer = {"found": f"{search.best:g} req/s",
              "at least hi": f">= {search.hi:g} req/s (the top of the range passed)",
              "below range": f"< {search.lo:g} req/s (the bottom of the range failed)"}
    return (f"max rate meeting the SLOs, {name}: {answer[search.status]} "
            f"({search.runs} runs, bisection)")


def write_sweep(records: list[dict[str, Any]], root: Path, grid_keys: Sequence[str],
                slos: dict[str, float] | None, plots: bool) -> tuple[str, dict[str, Any]]:
    """Write root/sweep.csv, root/sweep.json and root/sweep.html (the table and the figures,
    self-contained); return the table as text and the figures
    (latency against each swept engine flag, and against rate when 3+ rates ran)."""
    point_keys = [k for k in records[0] if k in grid_keys
                  or k in ("model", "gpu", "replicas", "router", "time_scale")]
    if "request_rate" not in point_keys:
        point_keys.append("request_rate")
    table = results_table(records, point_keys, slos)
    table["run_dir"] = [Path(str(r["run_dir"])).name for r in records]
    root.mkdir(parents=True, exist_ok=True)
    table.to_csv(root / SWEEP_TABLE, index=False)
    (root / "sweep.json").write_text(json.dumps(records, indent=2, default=str) + "\n")
    figures = _sweep_figures(pd.DataFrame(records), records, point_keys, grid_keys) if plots \
        else {}
    from analysis.html_report import write_sweep_html

    write_sweep_html(table, root / "sweep.html", figures, title=f"rt sweep {root.name}",
                     slos=slos)
    return render(table), figures


def _sweep_figures(full: pd.DataFrame, records: list[dict[str, Any]], point_keys: list[str],
                   grid_keys: Sequence[str]) -> dict[str, Any]:
    from analysis.plots import latency_vs_flag, latency_vs_rate

    figures = {}
    varying = [k for k in point_keys if k != "request_rate" and full[k].nunique() > 1]
    rate_key = "time_scale" if "time_scale" in point_keys else "request_rate"
    for flag in varying:
        rows = _rates_at_every_value(full, flag, rate_key)
        if flag in grid_keys and len(rows):
            series = rate_key if rows[rate_key].nunique() > 1 else None
            figures[f"latency_vs_{flag}"] = latency_vs_flag(rows, flag, series)
    if full["request_rate"].nunique() >= 3:
        full["config"] = [", ".join(f"{k}={r[k]}" for k in varying if k != rate_key) or "run"
                          for r in records]
        full["request_rate"] = full["request_rate"].astype(float)
        figures["latency_vs_rate"] = latency_vs_rate(full)
    return figures


def _rates_at_every_value(full: pd.DataFrame, flag: str, rate_key: str) -> pd.DataFrame:
    """The rows of the rates that ran at every value of `flag`: all of a grid's; with
    --find-max-rate, where each configuration bisects its own rates, the bracket's ends and
    the midpoints all took (a series per bisected rate would be a point or two, and a legend
    taller than the plot)."""
    values = full[flag].nunique()
    return full[full.groupby(rate_key)[flag].transform("nunique") == values]
