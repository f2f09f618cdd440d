"""Latency attribution per request and aggregated: what the slow requests waited for.

Each completed request's E2E latency is split into the parts of `metrics.PARTS` (they sum to
it exactly, see runtime/records.py). Here: the per-request table, group means (all requests,
the slowest 1% and 10% by TTFT and by E2E) and means per percentile bucket.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.metrics import ALL_PARTS, completed_requests, parts_of

# Every part's column in ms (routing and KV transfer only in fleet and P/D runs' tables).
PART_MS = {column.removesuffix("_s") + "_ms": label for column, label in ALL_PARTS.items()}
SHORT = {"routing_s": "routing", "api_server_s": "api", "step_boundary_s": "step",
         "queue_token_budget_s": "q:budget", "queue_max_num_seqs_s": "q:seqs",
         "queue_kv_capacity_s": "q:kv", "queue_preempted_step_s": "q:preempt",
         "preempted_s": "preempted", "prefill_s": "prefill", "kv_transfer_s": "kv xfer",
         "decode_s": "decode"}  # column headers of the summary tables
SORT_KEYS = {"ttft": "TTFT", "e2el": "E2E"}
DEFAULT_BUCKETS = (0.0, 50.0, 90.0, 99.0, 100.0)


def request_attribution(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per completed request: TTFT, E2EL and every part, in ms."""
    done = completed_requests(requests)
    out = pd.DataFrame({
        "request_id": done["request_id"],
        "ttft": (done["first_token_s"] - done["arrival_s"]) * 1e3,
        "e2el": (done["finish_s"] - done["arrival_s"]) * 1e3,
        "num_preemptions": done["num_preemptions"],
    })
    for column in parts_of(requests):
        out[column.removesuffix("_s") + "_ms"] = done[column] * 1e3
    return out.reset_index(drop=True)


def slowest(per_request: pd.DataFrame, by: str, fraction: float) -> pd.DataFrame:
    """The slowest `fraction` of requests by `by` (at least one; ties by request order)."""
    count = max(1, math.ceil(len(per_request) * fraction))
    return per_request.sort_values(by, kind="stable", ascending=False).head(count)


def _group_row(label: str, rows: pd.DataFrame) -> dict[str, object]:
    row: dict[str, object] = {"group": label, "requests": len(rows),
                              "ttft": float(rows["ttft"].mean()) if len(rows) else 0.0,
                              "e2el": float(rows["e2el"].mean()) if len(rows) else 0.0}
    parts = [c for c in rows.columns if c.endswith("_ms")]
    row.update({c: float(rows[c].mean()) if len(rows) else 0.0 for c in parts})
    return row


def attribution_summary(requests: pd.DataFrame,
                        fractions: Sequence[float] = (0.10, 0.01)) -> pd.DataFrame:
    """Mean TTFT, E2EL and parts (ms) for all requests and for the slowest fractions by TTFT
    and by E2E. Rows: 'all', 'slowest 10% by TTFT', ..."""
    per_request = request_attribution(requests)
    rows = [_group_row("all", per_request)]
    for by, name in SORT_KEYS.items():
        for fraction in fractions:
            label = f"slowest {fraction * 100:g}% by {name}"
            rows.append(_group_row(label, slowest(per_request, by, fraction)))
    return pd.DataFrame(rows)


def attribution_buckets(requests: pd.DataFrame, by: str = "e2el",
                        edges: Sequence[float] = DEFAULT_BUCKETS) -> pd.DataFrame:
    """Mean parts (ms) of the requests in each percentile bucket of `by` (ttft or e2el):
    rows 'p0-50', 'p50-90', 'p90-99', 'p99-100' for the default edges."""
    per_request = request_attribution(requests)
    values = per_request[by].to_numpy(dtype=np.float64)
    rank = pd.Series(values).rank(method="first").to_numpy() - 1  # 0..n-1
    pct = (rank + 1) / max(len(values), 1) * 100  # each request's percentile, (0, 100]
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        inside = (pct > lo) & (pct <= hi)
        rows.append(_group_row(f"p{lo:g}-{hi:g}", per_request[inside]))
    return pd.DataFrame(rows)


def render_summary(summary: pd.DataFrame) -> str:
    """A fixed-width text table of `attribution_summary` (ms)."""
    short = {c.removesuffix("_s") + "_ms": name for c, name in SHORT.items()
             if c.removesuffix("_s") + "_ms" in summary.columns}
    header = f"{'mean ms':<24}{'n':>6}{'TTFT':>10}{'E2EL':>10}" + "".join(
        f"{name:>10}" for name in short.values())
    lines = [header]
    for row in summary.to_dict("records"):
        lines.append(f"{row['group']:<24}{row['requests']:>6}{row['ttft']:>10.1f}"
                     f"{row['e2el']:>10.1f}" + "".join(f"{row[c]:>10.1f}" for c in short))
    return "\n".join(lines)
