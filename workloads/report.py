"""Text rendering of trace statistics and load reports (returns lines; the CLI prints them)."""

from __future__ import annotations

from workloads.rows import LoadReport
from workloads.stats import LengthStats, TraceStats
from workloads.transforms import ClipReport

_LABEL_WIDTH = 15


def render_stats(stats: TraceStats, title: str) -> list[str]:
    """The `rt trace inspect` table: one "label  value" line per statistic."""
    rows = [("trace", title), ("rows", str(stats.rows))]
    if stats.time is None:
        rows.append(("arrivals", "no time span (no timestamps, or all at t = 0)"))
    else:
        t = stats.time
        rows += [("span", f"{t.span_s:.1f} s ({t.span_s / 60:.1f} min, {t.span_s / 3600:.2f} h)"),
                 ("mean rate", f"{t.mean_rate:#.4g} req/s"),
                 ("peak / min", str(t.peak_per_min)), ("peak / s", str(t.peak_per_s)),
                 ("IA-CV", f"{t.ia_cv:#.4g}"), ("IoD (1 s)", f"{t.iod_1s:#.4g}")]
    rows += [("prompt tokens", _lengths(stats.prompt)), ("output tokens", _lengths(stats.output))]
    if stats.prefix is not None:
        p = stats.prefix
        size = f"{p.block_size}-token blocks" if p.block_size else "mixed block sizes"
        rows.append(("prefix reuse", f"{100 * p.block_reuse:.1f} % of {p.block_refs} block "
                     f"refs ({size}, {p.distinct_blocks} distinct), "
                     f"{100 * p.token_hit_fraction:.1f} % of prompt tokens"))
    return [f"{label:<{_LABEL_WIDTH}}{value}" for label, value in rows]


def load_notes(report: LoadReport, model: str | None) -> list[str]:
    """One line per thing loading dropped or noticed (nothing when the file was clean)."""
    notes = []
    if report.dropped_failed:
        notes.append(f"dropped {report.dropped_failed} failed rows (output tokens = 0); "
                     "--keep-failed on inspect counts them")
    if report.dropped_empty_prompt:
        notes.append(f"dropped {report.dropped_empty_prompt} rows with 0 prompt tokens")
    if report.dropped_model:
        notes.append(f"kept model {model!r}: dropped {report.dropped_model} rows of other models")
    if report.uncovered_hash_rows:
        notes.append(f"{report.uncovered_hash_rows} rows have fewer hash ids than their prompt "
                     "needs; their uncovered tails get request-unique tokens")
    if report.synthetic_arrivals:
        notes.append("the file has no timestamps: arrivals come from --request-rate/--burstiness")
    return notes


def clip_notes(report: ClipReport, max_model_len: int | None) -> list[str]:
    """Lines reporting max-model-len clipping (nothing when no request changed)."""
    notes = []
    if report.clipped_outputs:
        notes.append(f"max-model-len {max_model_len}: clipped the output of "
                     f"{report.clipped_outputs} requests")
    if report.dropped_prompts:
        notes.append(f"max-model-len {max_model_len}: dropped {report.dropped_prompts} requests "
                     "whose prompt leaves no room for an output token")
    return notes


def _lengths(s: LengthStats) -> str:
    return f"mean {s.mean:.1f}  p50 {_num(s.p50)}  p99 {_num(s.p99)}  max {s.max}"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"
