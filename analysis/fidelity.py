"""`rt fidelity`: how far a simulated run is from a real run of the same trace.

Three views, each a relative error (sim - real) / real, a fraction (0.05 = 5%), unless named
otherwise:

* per metric: mean, p50, p90 and p99 of TTFT, ITL, TPOT and E2E latency (vLLM's definitions,
  `analysis.metrics`), and the throughputs;
* per step: the cost model's predicted time of each *real* step (computed by the caller, who
  owns the cost model) against its measured wall time (end_s - start_s);
* per request: TTFT of the same request in both runs (signed and absolute, ms and relative).

With several real runs of the same trace, `real` is the mean of their metrics (the real
system's expectation, not one draw of it) and `noise` the largest deviation of one real run
from that mean: how far the real system is from itself, the resolution at which this machine
can judge any simulator. Likewise with several simulated runs (step-time noise drawn from
different seeds): `sim` is their mean and `sim_noise` the largest deviation of one from it.
The per-step view is the first real run's measured steps against the profile's predictions
of them (no simulated run involved); the per-request view is the first real run against the
first simulated run, and the second real run against the first is reported as noise too.

With calibration replays (other traces like the real one, replayed in the same session),
`drift` is the calibration runs' mean metric against the real runs' mean, (cal - real) /
real: the profile is fitted on the former and judged on the latter, so a drift beyond the
noise floor (the machine ran calibration slower or faster than the real replays) enters the
error, and `drift_warnings` says so.

`gate` names the errors above a tolerance (the goal metrics: p50/p90 of TTFT and ITL).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.metrics import per_request_latencies
from analysis.output import save_figures
from analysis.report import ReportOptions, load_checked, result_dict
from analysis.rundir import Run

METRICS = ("ttft", "itl", "tpot", "e2el")
STATS = ("mean", "p50", "p90", "p99")
THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput")
GATE_KEYS = ("p50_ttft_ms", "p90_ttft_ms", "p50_itl_ms", "p90_itl_ms")
DRIFT_KEYS = ("p50_ttft_ms", "p50_itl_ms")  # medians: comparable across resampled traces
# |drift| warned about at least: two resampled traces of 60 requests on a noise-free simulated
# server differ by 2% (p50 TTFT) and 0.5% (p50 ITL), their p90 ITL by 8% (tests/sim).
DRIFT_FLOOR = 0.05


def _relative(sim: float, real: float) -> float:
    return (sim - real) / real if real else math.nan


def _metric_table(runs: Sequence[Run], keys: Sequence[str]) -> np.ndarray:
    """[runs, keys]: each run's value of each metric key (ms, or per second)."""
    options = ReportOptions(METRICS, (50.0, 90.0, 99.0))
    return np.array([[float(d[key]) for key in keys]
                     for d in (result_dict(run, options) for run in runs)])


def _spread(runs: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """max_i |runs[i] - mean| / mean per column (unsigned, a fraction)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        spread: np.ndarray = np.abs(runs - mean).max(axis=0) / mean  # numpy's stubs: Any
    return spread


def metric_errors(reals: Sequence[Run], sims: Sequence[Run],
                  calibrations: Sequence[Run] = ()) -> pd.DataFrame:
    """Rows: `{stat}_{metric}_ms` for every stat and metric, then the throughputs; columns
    real (the mean over `reals`), sim (the mean over `sims`; ms, or per second for
    throughputs) and error (relative, signed); with two or more real runs also `noise`:
    max_i |real_i - real| / real (unsigned); with two or more simulated runs `sim_noise`,
    the same over them; with calibration runs `drift`: (mean over `calibrations` - real) /
    real (signed)."""
    if not reals or not sims:
        raise ValueError("metric_errors needs at least one real and one simulated run")
    keys = [f"{stat}_{metric}_ms" for metric in METRICS for stat in STATS] + list(THROUGHPUTS)
    real_runs, sim_runs = _metric_table(reals, keys), _metric_table(sims, keys)
    real, sim = real_runs.mean(axis=0), sim_runs.mean(axis=0)
    rows = {key: (real[i], sim[i], _relative(sim[i], real[i])) for i, key in enumerate(keys)}
    table = pd.DataFrame.from_dict(rows, orient="index", columns=["real", "sim", "error"])
    table.index.name = "metric"
    if len(reals) > 1:
        table["noise"] = _spread(real_runs, real)
    if len(sims) > 1:
        table["sim_noise"] = _spread(sim_runs, sim)
    if calibrations:
        cal = _metric_table(calibrations, keys).mean(axis=0)
        table["drift"] = [_relative(cal[i], real[i]) for i in range(len(keys))]
    return table


def drift_warnings(metrics: pd.DataFrame, keys: Sequence[str] = DRIFT_KEYS) -> list[str]:
    """One line per metric of `keys` whose |drift| exceeds the real runs' noise floor and
    `DRIFT_FLOOR` (what resampling the trace alone makes); none without a drift column, and
    none for a metric that was not measured (NaN drift: e.g. no ITL when every request
    streams one token). A NaN noise floor (one real run) counts as no floor."""
    if "drift" not in metrics.columns:
        return []
    out = []
    for key in keys:
        drift = float(metrics.loc[key, "drift"])
        noise = float(metrics.loc[key, "noise"]) if "noise" in metrics.columns else 0.0
        noise = noise if math.isfinite(noise) else 0.0
        if math.isfinite(drift) and abs(drift) > max(noise, DRIFT_FLOOR):
            out.append(f"machine drift: the calibration replays' {key} is {drift:+.1%} from "
                       f"the real replays' (noise {noise:.1%}, floor {DRIFT_FLOOR:.0%}): the "
                       "profile was fitted on a machine running unlike the one it is judged "
                       "on, and the error includes that difference")
    return out


def _percentiles(values: np.ndarray, qs: Sequence[float]) -> dict[str, float]:
    if values.size == 0:
        return {f"p{q:g}": math.nan for q in qs}
    return {f"p{q:g}": float(np.percentile(values, q)) for q in qs}


def step_errors(measured_s: Sequence[float] | np.ndarray,
                predicted_s: Sequence[float] | np.ndarray) -> dict[str, float]:
    """Per-step prediction error over steps with a positive measured time: mean and
    percentiles of |pred - meas| / meas, the signed median, and the bias on the total
    (Σ pred / Σ meas - 1). Fractions; `steps` is the count."""
    meas = np.asarray(measured_s, dtype=np.float64)
    pred = np.asarray(predicted_s, dtype=np.float64)
    if meas.shape != pred.shape:
        raise ValueError(f"{meas.size} measured step times but {pred.size} predictions")
    keep = meas > 0
    meas, pred = meas[keep], pred[keep]
    rel = (pred - meas) / meas if meas.size else np.empty(0)
    out: dict[str, float] = {"steps": float(meas.size),
                             "mape": float(np.abs(rel).mean()) if rel.size else math.nan,
                             "median_signed": float(np.median(rel)) if rel.size else math.nan}
    out.update({f"{k}_ape": v for k, v in _percentiles(np.abs(rel), (50, 90, 99)).items()})
    out["worst_ape"] = float(np.abs(rel).max()) if rel.size else math.nan
    out["bias_total"] = float(pred.sum() / meas.sum() - 1.0) if meas.size else math.nan
    return out


def ttft_errors(real: pd.DataFrame, sim: pd.DataFrame) -> dict[str, float]:
    """Per-request TTFT error of the requests completed in both runs: the signed error in ms
    (p10, p50, p90, mean), the absolute error in ms (p50, p90, p99) and the absolute relative
    error (p50, p90). `requests` is the count."""
    a = per_request_latencies(real)[["request_id", "ttft"]]
    b = per_request_latencies(sim)[["request_id", "ttft"]]
    both = a.merge(b, on="request_id", suffixes=("_real", "_sim"))
    diff = (both["ttft_sim"] - both["ttft_real"]).to_numpy(dtype=np.float64)
    rel = np.abs(diff) / both["ttft_real"].to_numpy(dtype=np.float64)
    out: dict[str, float] = {"requests": float(len(both)),
                             "mean_signed_ms": float(diff.mean()) if diff.size else math.nan}
    out.update({f"{k}_signed_ms": v for k, v in _percentiles(diff, (10, 50, 90)).items()})
    out.update({f"{k}_abs_ms": v for k, v in _percentiles(np.abs(diff), (50, 90, 99)).items()})
    out.update({f"{k}_abs_rel": v for k, v in _percentiles(rel, (50, 90)).items()})
    return out


@dataclass(frozen=True)
class FidelityReport:
    """The three views of real runs against simulated ones; `ttft_noise` is the
    per-request view of the second real run against the first (with one real run: None, and
    `metrics` has no `noise` column); `real_runs`, `sim_runs` and `calibration_runs` count
    the runs (with calibration runs, `metrics` has a `drift` column); `extra`: more of the
    run's account for fidelity.json (the endpoint's warm-up)."""

    metrics: pd.DataFrame  # metric_errors
    steps: dict[str, float] | None  # step_errors; None: no steps measured (client timing)
    ttft: dict[str, float]  # ttft_errors
    ttft_noise: dict[str, float] | None = None  # ttft_errors(reals[0], reals[1])
    real_runs: int = 1
    sim_runs: int = 1
    calibration_runs: int = 0
    extra: dict[str, Any] | None = None

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN as null)."""
        def clean(v: float) -> float | None:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        metrics = {key: {col: clean(float(val)) for col, val in row.items()}
                   for key, row in self.metrics.iterrows()}
        out = {"real_runs": self.real_runs, "sim_runs": self.sim_runs, "metrics": metrics,
               "steps": ({k: clean(v) for k, v in self.steps.items()}
                         if self.steps is not None else None),
               "ttft_per_request": {k: clean(v) for k, v in self.ttft.items()}}
        if self.ttft_noise is not None:
            out["ttft_per_request_noise"] = {k: clean(v) for k, v in self.ttft_noise.items()}
        if self.calibration_runs:
            out["calibration_runs"] = self.calibration_runs
            out["drift_warnings"] = drift_warnings(self.metrics)
        return {**out, **(self.extra or {})}


def fidelity_report(reals: Sequence[Run], sims: Sequence[Run],
                    measured_step_s: Sequence[float] | np.ndarray,
                    predicted_step_s: Sequence[float] | np.ndarray,
                    calibrations: Sequence[Run] = (), extra: dict[str, Any] | None = None
                    ) -> FidelityReport:
    """All three views; the step times are the first real run's (measured, and as
    predicted), the per-request view the first real run against the first simulated one.
    With two or more real runs of the same trace, the noise floor too; with calibration
    runs, the drift. No measured steps (a client-timed run): no per-step view."""
    noise = (ttft_errors(reals[0].requests, reals[1].requests) if len(reals) > 1 else None)
    steps = (step_errors(measured_step_s, predicted_step_s) if len(measured_step_s) else None)
    return FidelityReport(metric_errors(reals, sims, calibrations), steps,
                          ttft_errors(reals[0].requests, sims[0].requests), noise, len(reals),
                          len(sims), len(calibrations), extra)


def gate(report: FidelityReport, max_error: float,
         keys: Sequence[str] = GATE_KEYS) -> list[str]:
    """One line per gated metric whose |error| exceeds `max_error` (a fraction); the line
    gives the noise floor too when the report has one."""
    if not max_error >= 0:
        raise ValueError(f"--max-error must be >= 0, got {max_error}")
    out = []
    for key in keys:
        row = report.metrics.loc[key]
        error = float(row["error"])
        if not abs(error) <= max_error:  # NaN fails too
            noise = f" (noise {float(row['noise']):.1%})" if "noise" in row.index else ""
            out.append(f"{key}: error {error:+.1%} exceeds {max_error:.1%}{noise}")
    return out


def _ttft_line(label: str, t: dict[str, float]) -> str:
    return (f"{label} ({t['requests']:.0f} requests): signed p10/p50/p90 "
            f"{t['p10_signed_ms']:+.2f}/{t['p50_signed_ms']:+.2f}/"
            f"{t['p90_signed_ms']:+.2f} ms, |error| p50/p90/p99 {t['p50_abs_ms']:.2f}/"
            f"{t['p90_abs_ms']:.2f}/{t['p99_abs_ms']:.2f} ms, relative p50/p90 "
            f"{t['p50_abs_rel']:.1%}/{t['p90_abs_rel']:.1%}")


def render(report: FidelityReport) -> str:
    """Fixed-width text: the metric table (with the noise columns when there are several
    runs), then the step and per-request lines."""
    spread = [c for c in ("noise", "sim_noise", "drift") if c in report.metrics.columns]
    lines = [f"{'metric':<28}{'real':>12}{'sim':>12}{'error':>10}"
             + "".join(f"{c:>10}" for c in spread)]
    for key, row in report.metrics.iterrows():
        lines.append(f"{str(key):<28}{row['real']:>12.3f}{row['sim']:>12.3f}"
                     f"{row['error']:>+10.1%}"
                     + "".join(f"{row[c]:>+10.1%}" if c == "drift" else f"{row[c]:>10.1%}"
                               for c in spread))
    s = report.steps
    if s is None:
        lines.append("per-step time prediction: none (client-side timing: the real engine's "
                     "steps were not measured)")
    else:
        lines.append(f"per-step time prediction ({s['steps']:.0f} real steps): MAPE "
                     f"{s['mape']:.1%}, p50 {s['p50_ape']:.1%}, p90 {s['p90_ape']:.1%}, p99 "
                     f"{s['p99_ape']:.1%}, worst {s['worst_ape']:.1%}, signed median "
                     f"{s['median_signed']:+.1%}, total busy time {s['bias_total']:+.1%}")
    lines.append(_ttft_line("per-request TTFT error", report.ttft))
    if report.ttft_noise is not None:
        lines.append(_ttft_line("per-request TTFT noise (real run 2 vs 1)",
                                report.ttft_noise))
    if "noise" in spread:
        lines.append(f"real: the mean of {report.real_runs} real replays of the trace; noise: "
                     "the largest deviation of one of them from that mean (an error within "
                     "it is as close as this machine can tell)")
    if "sim_noise" in spread:
        lines.append(f"sim: the mean of {report.sim_runs} simulations, step-time noise drawn "
                     "from as many seeds; sim_noise: the largest deviation of one from it")
    if "drift" in spread:
        lines.append(f"drift: the mean of {report.calibration_runs} calibration replays (the "
                     "profile's fit) against the real replays' mean: how differently the "
                     "machine ran them")
        lines += drift_warnings(report.metrics)
    return "\n".join(lines)


def replay_order(repeats: int, calibrate: bool) -> list[tuple[str, int]]:
    """The order of `rt fidelity`'s replays, ("calibration" or "real", repeat index): C R,
    R C, C R, ... so a linear drift of the machine's speed falls on both alike (only R's
    without calibration replays)."""
    order: list[tuple[str, int]] = []
    for i in range(repeats):
        pair = [("calibration", i)] if calibrate else []
        pair = [*pair, ("real", i)] if i % 2 == 0 else [("real", i), *pair]
        order += pair
    return order


def write_fidelity(reals: Sequence[Run], sims: Sequence[Run], predicted_s: Sequence[float],
                   root: Path, plots: bool, max_error: float | None,
                   calibrations: Sequence[Run] = (), extra: dict[str, Any] | None = None
                   ) -> tuple[str, list[str], dict[str, Any]]:
    """`rt fidelity`'s outputs: writes root/fidelity.json; returns the text table, the gate's
    violations (none without `max_error`) and the overlaid figures (with `plots`).
    `predicted_s`: the profile's prediction of each of the first real run's steps (none
    for a client-timed run, whose steps table is empty); `calibrations`: the calibration
    replays (the drift column); `extra`: more keys for fidelity.json."""
    steps = reals[0].steps
    measured = (steps["end_s"] - steps["start_s"]).to_numpy() if len(steps) else np.empty(0)
    report = fidelity_report(reals, sims, measured, np.asarray(predicted_s, dtype=np.float64),
                             calibrations, extra)
    (root / "fidelity.json").write_text(json.dumps(report.to_json_dict(), indent=2) + "\n")
    figures: dict[str, Any] = {}
    if plots:
        from analysis.plots import cdfs, latency_values, percentile_curves

        series = {("real" if i == 0 else f"real {i + 1}"): latency_values(run.requests)
                  for i, run in enumerate(reals)}
        series["sim"] = latency_values(sims[0].requests)
        figures = {"percentiles": percentile_curves(series), "cdf": cdfs(series)}
    violations = gate(report, max_error) if max_error is not None else []
    return render(report), violations, figures


def report_fidelity_dirs(real_dirs: Sequence[Path], sim_dirs: Sequence[Path],
                         predict: Callable[[pd.DataFrame], Sequence[float]], root: Path,
                         plots: bool, max_error: float | None, echo: Callable[[str], None],
                         log: Callable[[str], None], calibration_dirs: Sequence[Path] = (),
                         extra: dict[str, Any] | None = None) -> bool:
    """`write_fidelity` on run directories (checked as `rt report` does), its table to `echo`,
    its figures to root/plots, then what was written and each --max-error violation to
    `log`; True when there was one. `predict(steps)`: the profile's seconds of each step of
    the first real run; `calibration_dirs` and `extra` as `write_fidelity`'s."""
    reals = [load_checked(path) for path in real_dirs]
    text, violations, figures = write_fidelity(
        reals, [load_checked(path) for path in sim_dirs], predict(reals[0].steps), root, plots,
        max_error, [load_checked(path) for path in calibration_dirs], extra)
    echo(text)
    save_figures(figures, root / "plots", log)
    log(f"wrote {root}/fidelity.json")
    for line in violations:
        log(f"fidelity: {line}")
    return bool(violations)
