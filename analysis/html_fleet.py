"""A fleet run's per-replica views on its HTML page (`analysis.html_report`).

    the fleet table     per replica (named by pool and role when the fleet has pools): its
                        requests and share, prompt tokens, P/D prefills done for other
                        replicas, p50/p99 TTFT, mean KV usage, prefix-cache hit rate and
                        preemptions (`analysis.fleet.replica_table`; n/a where a replica
                        has no completed request or no step)
    the fleet figures   prefix hit rate, load imbalance (max/mean) and Jain's index of
                        requests and prompt tokens (`analysis.fleet.fleet_summary`)
    small multiples     each replica's running/waiting requests and KV usage over time, on
                        shared axes; past MAX_PANELS replicas, the busiest and the least busy
                        half and half (by requests decoded + prefilled)
"""

from __future__ import annotations

from html import escape

import numpy as np
import pandas as pd

from analysis.fleet import fleet_summary, replica_names, replica_table
from analysis.html_parts import cell, svg, table
from analysis.plots import replica_timelines
from analysis.rundir import Run

MAX_PANELS = 8
NAN = float("nan")  # n/a in a cell


def is_pd(requests: pd.DataFrame) -> bool:
    return "prefill_replica" in requests.columns


def num_replicas(run: Run) -> int:
    """run.json's replica count, or enough for every replica the records name."""
    fleet = run.info.get("fleet")
    count = int(fleet.get("replicas") or 0) if isinstance(fleet, dict) else 0
    for frame in (run.requests, run.steps):
        if "replica" in frame.columns and len(frame):
            count = max(count, int(frame["replica"].max()) + 1)
    return count


def prefills(requests: pd.DataFrame, count: int) -> np.ndarray:
    """Per replica: the P/D requests it prefilled for another replica."""
    elsewhere = requests[requests["prefill_replica"] != requests["replica"]]
    counts = elsewhere["prefill_replica"].value_counts()
    return np.array([int(counts.get(r, 0)) for r in range(count)])


def fleet_table(run: Run) -> tuple[pd.DataFrame, list[str], np.ndarray | None]:
    """`replica_table` of the run, the replicas' names, and (P/D) their prefills."""
    count = num_replicas(run)
    rows = replica_table(run.requests, run.steps, count)
    done = prefills(run.requests, count) if is_pd(run.requests) else None
    return rows, replica_names(run.info, count), done


def _table(rows: pd.DataFrame, names: list[str], done: np.ndarray | None) -> str:
    head = ["replica", "requests", "share %", "prompt tokens",
            *(["prefilled for others"] if done is not None else []), "p50 TTFT ms",
            "p99 TTFT ms", "mean KV use %", "prefix hit %", "preemptions"]
    lines = []
    for r, row in enumerate(rows.to_dict("records")):
        lines.append([f"<td>{escape(names[r])}</td>", cell(int(row["requests"])),
                      cell(row["share"] * 100, ".1f"), cell(int(row["prompt_tokens"])),
                      *([cell(int(done[r]))] if done is not None else []),
                      cell(row["p50_ttft_ms"], ".1f"), cell(row["p99_ttft_ms"], ".1f"),
                      cell(row["mean_kv_usage"] * 100, ".1f"),
                      cell(row["prefix_hit_rate"] * 100 if row["prompt_tokens"] else NAN,
                           ".1f"), cell(int(row["preemptions"]))])
    return table(head, lines, sortable=True, css_id="replicas")


def _summary(rows: pd.DataFrame) -> str:
    s = fleet_summary(rows)
    values = [("Fleet prefix cache hit rate (%)", s["prefix_hit_rate"] * 100, ".1f"),
              ("Load imbalance, requests (max/mean)", s["request_imbalance"], ".2f"),
              ("Load imbalance, prompt tokens (max/mean)", s["prompt_token_imbalance"], ".2f"),
              ("Jain's fairness index, requests", s["jain_requests"], ".3f"),
              ("Jain's fairness index, prompt tokens", s["jain_prompt_tokens"], ".3f")]
    return table(["fleet", "value"], [[f"<td>{escape(k)}</td>", cell(v, spec)]
                                      for k, v, spec in values])


def shown_replicas(load: np.ndarray, limit: int = MAX_PANELS) -> list[int]:
    """All replicas, or the `limit` // 2 busiest and the rest least busy (ties: lower
    index first), in replica order."""
    if len(load) <= limit:
        return list(range(len(load)))
    order = np.argsort(-load, kind="stable")
    busiest = order[:limit // 2].tolist()
    rest = [int(r) for r in np.argsort(load, kind="stable") if r not in busiest]
    return sorted(busiest + rest[:limit - len(busiest)])


def fleet_section(run: Run) -> str:
    """The fleet table, the fleet-wide figures and the replicas' small multiples."""
    rows, names, done = fleet_table(run)
    parts = ["<p>Per replica (a request counts where it decoded"
             + ("; P/D prefills done for other replicas counted apart" if done is not None
                else "") + "; click a header to sort).</p>", _table(rows, names, done),
             _summary(rows)]
    if run.steps.empty:
        return "".join(parts)
    load = rows["requests"].to_numpy() + (done if done is not None else 0)
    shown = shown_replicas(load)
    if len(shown) < len(rows):
        parts.append(f"<p>{len(shown)} of {len(rows)} replicas shown: the "
                     f"{MAX_PANELS // 2} busiest and the {len(shown) - MAX_PANELS // 2} "
                     f"least busy by requests decoded and prefilled.</p>")
    figure = replica_timelines(run.steps, {r: names[r] for r in shown})
    return "".join(parts) + svg(figure, "replica timelines")
