"""`rt compare`: several runs side by side (rows = metrics, columns = runs, ratios against the
first run), the compatibility check, and legend labels naming what differs between runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pandas as pd

from analysis.rundir import Run, check_output_file

# Leaves of run.json that say nothing about the configuration.
_NOISE = {"wall_s", "name", "date", "rt_version", "digest", "prefix_cache.queries", "runtime",
          "prefix_cache.hits"}
_PREFERRED = ("sweep.", "engine_args.", "scheduler_config.", "cache_config.", "fleet.replicas",
              "fleet.router", "model.name", "gpu.name", "kind", "trace.name", "cost_model.kind")


def _flag(default: Any, option: str, help: str) -> Any:  # runtime.flags.flag's metadata
    return field(default=default, metadata={"flag": option, "help": help, "panel": None})


# `rt compare --help`'s description of the command, beside its flags.
COMPARE_HELP = """\
Compare runs of one workload side by side: rows = metrics, columns = runs, and a
ratio column against the first run; overlaid percentile curves and CDFs whose legend
names what differs (budget, model, sim vs real...).
"""


@dataclass(frozen=True, slots=True)
class CompareFiles:
    """`rt compare`'s outputs besides the table on stdout."""

    csv: Path | None = _flag(None, "--csv", "Also write the table here.")
    html: Path | None = _flag(None, "--html", "Also write one self-contained HTML page here: "
                              "the table, the overlaid curves and each run's report.")
    plot_dir: Path | None = _flag(None, "--plot-dir", "Where the overlaid curves go (default: "
                                  "results/compare-<time>).")

    def __post_init__(self) -> None:
        check_output_file(self.csv, "--csv")
        check_output_file(self.html, "--html")


def check_compatible(runs: Sequence[Run]) -> None:
    """ValueError unless every run replays the same workload: equal trace digests where
    run.json records them, else the same request ids."""
    first = runs[0]
    for other in runs[1:]:
        a, b = _digest(first), _digest(other)
        if a is not None and b is not None:
            if a != b:
                raise ValueError(f"incompatible runs: {first.path} and {other.path} replay "
                                 f"different traces (digest {a[:12]} vs {b[:12]})")
            continue
        if set(first.requests["request_id"]) != set(other.requests["request_id"]):
            raise ValueError(f"incompatible runs: {first.path} and {other.path} have "
                             "different request ids")


def _digest(run: Run) -> str | None:
    trace = run.info.get("trace")
    return trace.get("digest") if isinstance(trace, dict) else None


def flatten(info: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differing_keys(infos: Sequence[dict[str, Any]]) -> list[str]:
    """Flattened run.json keys whose values differ between runs, the configuration's
    flags first."""
    flats = [flatten(info) for info in infos]
    keys = sorted({k for flat in flats for k in flat})
    differ = [k for k in keys if k not in _NOISE and not k.endswith(".digest")
              and len({repr(flat.get(k)) for flat in flats}) > 1]

    def rank(key: str) -> tuple[int, str]:
        hits = [i for i, p in enumerate(_PREFERRED) if key.startswith(p)]
        return (hits[0] if hits else len(_PREFERRED), key)

    return sorted(differ, key=rank)


def run_labels(runs: Sequence[Run], max_keys: int = 2) -> list[str]:
    """Legend labels naming what differs (e.g. 'max_num_batched_tokens=512'); run names
    when nothing in run.json differs. Leaf names, deduplicated (a flag shows once even when
    engine_args and scheduler_config both record it)."""
    if len(runs) < 2:
        return [run.name for run in runs]
    if _mixed_timing(runs):
        return _dedup([kind_label(run.info) for run in runs], runs)
    chosen: list[str] = []
    for key in differing_keys([run.info for run in runs]):
        leaf = key.rsplit(".", 1)[-1]
        if leaf not in [c.rsplit(".", 1)[-1] for c in chosen]:
            chosen.append(key)
        if len(chosen) == max_keys:
            break
    if not chosen:
        return [run.name for run in runs]
    labels = []
    for run in runs:
        flat = flatten(run.info)
        labels.append(", ".join(f"{k.rsplit('.', 1)[-1]}={flat.get(k)}" for k in chosen))
    return _dedup(labels, runs)


def _dedup(labels: list[str], runs: Sequence[Run]) -> list[str]:
    if len(set(labels)) < len(labels):
        return [f"{label} ({run.name})" for label, run in zip(labels, runs, strict=True)]
    return labels


def _mixed_timing(runs: Sequence[Run]) -> bool:
    """Some runs are client-timed (an endpoint replay, a vLLM bench file) and some are not,
    or kinds differ with one among them: their engine flags are not comparable (None on
    one side)."""
    kinds = {str(run.info.get("kind")) for run in runs}
    return bool(kinds & {"endpoint", "vllm-bench"}) and len(kinds) > 1


def kind_label(info: dict[str, Any]) -> str:
    """'endpoint HOST:PORT' for an endpoint run, 'vllm bench BACKEND' for a vLLM bench
    result file, else the run's kind (simulate, replay)."""
    kind = str(info.get("kind") or "run")
    if kind == "vllm-bench":
        return f"vllm bench {info.get('backend') or ''}".strip()
    endpoint = info.get("endpoint")
    url = endpoint.get("url") if isinstance(endpoint, dict) else None
    if kind != "endpoint" or not isinstance(url, str):
        return kind
    host = urlsplit(url).netloc.rpartition("@")[2] or url  # never user:password@
    return f"endpoint {host}"


COMPARE_KEYS_HEAD = ("completed", "failed", "duration", "request_throughput",
                     "request_goodput", "output_throughput", "total_token_throughput",
                     "max_output_tokens_per_s", "max_concurrent_requests")
COMPARE_KEYS_TAIL = ("num_preemptions", "num_preempted_requests", "prefix_cache_hit_rate",
                     "mean_kv_cache_usage", "max_kv_cache_usage", "num_engine_steps",
                     "fleet_replicas", "fleet_prefix_hit_rate", "fleet_request_imbalance",
                     "fleet_prompt_token_imbalance", "fleet_jain_requests")


def compare_table(results: Sequence[dict[str, Any]], labels: Sequence[str]) -> pd.DataFrame:
    """Rows = numeric result keys (vLLM's first, then the latency keys, then rt's), columns
    = runs, plus one ratio column per later run against the first (NaN where the first is
    0 or the value is missing)."""
    latency = [k for k in results[0] if k.endswith("_ms")]
    keys = [k for k in (*COMPARE_KEYS_HEAD, *latency, *COMPARE_KEYS_TAIL)
            if any(isinstance(r.get(k), int | float) and not isinstance(r.get(k), bool)
                   for r in results)]
    table = pd.DataFrame({label: [_number(r.get(k)) for k in keys]
                          for label, r in zip(labels, results, strict=True)}, index=keys)
    first = table.iloc[:, 0]
    for label in labels[1:]:
        table[f"{label} / {labels[0]}"] = table[label] / first.where(first != 0)
    table.index.name = "metric"
    return table


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else float("nan")


def render_table(table: pd.DataFrame) -> str:
    """Fixed-width text: metric names left, values right-aligned."""
    width = max(12, *(len(str(c)) + 2 for c in table.columns))
    name_width = max(len(str(i)) for i in table.index) + 2
    lines = [f"{'metric':<{name_width}}" + "".join(f"{str(c):>{width}}" for c in table.columns)]
    for key, row in table.iterrows():
        cells = "".join(f"{_fmt(v, str(c)):>{width}}" for c, v in row.items())
        lines.append(f"{str(key):<{name_width}}{cells}")
    return "\n".join(lines)


def _fmt(value: float, column: str) -> str:
    if value != value:  # NaN: not available (a client-timed run's server-side figures)
        return "n/a"
    if " / " in column:
        return f"{value:.3f}x"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def compare_runs(runs: Sequence[Run], options: Any, plots: bool
                 ) -> tuple[pd.DataFrame, dict[str, Any]]:
    """`rt compare`: the table of checked, compatible runs (`report.ReportOptions` options)
    and, with `plots`, overlaid percentile curves and CDFs labelled by what differs."""
    from analysis.report import result_dict

    check_compatible(runs)
    labels = run_labels(runs)
    table = compare_table([result_dict(r, options) for r in runs], labels)
    if not plots:
        return table, {}
    from analysis.plots import cdfs, latency_values, percentile_curves

    series = {label: latency_values(r.requests) for label, r in zip(labels, runs, strict=True)}
    return table, {"percentiles": percentile_curves(series), "cdf": cdfs(series)}


def compare_dirs(paths: Sequence[Path], options: Any, files: CompareFiles, plots: bool,
                 show: Callable[[str], None]) -> tuple[Path | None, dict[str, Any]]:
    """`rt compare`: the run directories (two or more, checked as `rt report` does) compared;
    the table goes to `show`, then to --csv and --html. Returns the HTML page written (if
    any) and the figures. ValueError on fewer than two runs or a bad one."""
    from analysis.html_report import write_html_report
    from analysis.report import load_checked

    if len(paths) < 2:
        raise ValueError("compare needs two or more run directories")
    runs = [load_checked(p) for p in paths]
    table, figures = compare_runs(runs, options, plots)
    show(render_table(table))
    if files.csv is not None:
        table.to_csv(files.csv)
    html = write_html_report(runs, files.html, options) if files.html is not None else None
    return html, figures
