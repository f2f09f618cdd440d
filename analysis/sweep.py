"""Sweep results: the SLO language, the search for the highest rate that meets every SLO
(bisection), and the results table. Pure functions over result dicts (`report.result_dict`)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from analysis.metrics import METRICS

_SLO_KEY = re.compile(r"^(mean|median|std|p(\d+(?:\.\d+)?))_([a-z0-9_]+)_ms$")
_SLO_METRICS = (*METRICS, "request_queue_time", "request_prefill_time",
                "request_decode_time", "request_inference_time")


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
        try:
            slos[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {item!r}: {value!r} is not a number") from None
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
