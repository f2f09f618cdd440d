"""A fleet run per replica: who got what, and how even the load was.

Reads the `replica` columns a fleet run adds to requests.parquet and steps.parquet. Load
imbalance is max / mean over replicas (1 = perfectly even); Jain's fairness index is
(sum x)^2 / (n * sum x^2), from 1/n (one replica takes everything) to 1 (even).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.metrics import completed_requests


def is_fleet(requests: pd.DataFrame) -> bool:
    return "replica" in requests.columns


def jain_index(values: Sequence[float]) -> float:
    x = np.asarray(values, dtype=np.float64)
    total = float((x * x).sum())
    return float(x.sum() ** 2 / (len(x) * total)) if len(x) and total > 0 else 1.0


def imbalance(values: Sequence[float]) -> float:
    """max / mean (1.0 for an empty or all-zero load)."""
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean()) if len(x) else 0.0
    return float(x.max() / mean) if mean > 0 else 1.0


def replica_names(info: dict[str, Any], count: int) -> list[str]:
    """"replica r" for r < count, with its pool's name and role (other than "both") when
    run.json's fleet section lists pools (replicas are numbered pool by pool)."""
    fleet = info.get("fleet")
    pools = (fleet.get("pools") if isinstance(fleet, dict) else None) or []
    owners = [pool for pool in pools for _ in range(int(pool.get("count", 1)))]
    names = []
    for r in range(count):
        pool = owners[r] if r < len(owners) else None
        role = pool.get("role", "both") if pool else "both"
        where = f"{pool.get('name')}" + (f", {role}" if role != "both" else "") if pool else ""
        names.append(f"replica {r}" + (f" ({where})" if where else ""))
    return names


def replica_table(requests: pd.DataFrame, steps: pd.DataFrame,
                  num_replicas: int | None = None) -> pd.DataFrame:
    """One row per replica: requests (and share), prompt tokens, p50/p99 TTFT (ms) of its
    completed requests, mean KV usage over its steps, its prefix-cache hit rate (cached /
    prompt tokens) and preemptions.

    A real run through `rt route` (`rt replay --endpoint`) has no steps (mean KV usage NaN)
    and may have requests of unknown replica (null `replica`: counted in no replica's row,
    but in the shares' denominator); its hit rates are the servers' reported cached tokens."""
    stepped = "replica" in steps.columns and len(steps)
    n = num_replicas or int(np.nanmax([requests["replica"].max(), -1.0,
                                       steps["replica"].max() if stepped else -1.0]) + 1)
    done = completed_requests(requests)
    ttft_ms = (done["first_token_s"] - done["arrival_s"]) * 1e3
    rows = []
    for r in range(n):
        mine, ttft = requests[requests["replica"] == r], ttft_ms[done["replica"] == r]
        kv = steps.loc[steps["replica"] == r, "kv_usage"] if stepped else pd.Series([], dtype=float)
        prompt = int(mine["prompt_len"].sum())
        rows.append({
            "replica": r, "requests": len(mine), "share": len(mine) / max(len(requests), 1),
            "prompt_tokens": prompt,
            "p50_ttft_ms": float(ttft.median()) if len(ttft) else float("nan"),
            "p99_ttft_ms": float(np.percentile(ttft, 99)) if len(ttft) else float("nan"),
            "mean_kv_usage": float(kv.mean()) if len(kv) else float("nan"),
            "prefix_hit_rate": float(mine["cached_tokens"].sum()) / prompt if prompt else 0.0,
            "preemptions": int(mine["num_preemptions"].sum())})
    return pd.DataFrame(rows)


def fleet_summary(table: pd.DataFrame) -> dict[str, float]:
    """Fleet-wide: prefix hit rate, imbalance of requests and prompt tokens, Jain's index."""
    prompt = float(table["prompt_tokens"].sum())
    hits = float((table["prefix_hit_rate"] * table["prompt_tokens"]).sum())
    return {"replicas": float(len(table)),
            "prefix_hit_rate": hits / prompt if prompt else 0.0,
            "request_imbalance": imbalance(table["requests"]),
            "prompt_token_imbalance": imbalance(table["prompt_tokens"]),
            "jain_requests": jain_index(table["requests"]),
            "jain_prompt_tokens": jain_index(table["prompt_tokens"])}


def fleet_block(requests: pd.DataFrame, steps: pd.DataFrame) -> str:
    """The console's fleet block: a line per replica, then the fleet-wide figures."""
    table = replica_table(requests, steps)
    s = fleet_summary(table)
    lines = ["{s:{c}^50}".format(s=" Fleet ", c="="),
             f"{'replica':>7}{'requests':>10}{'share':>7}{'p50 TTFT':>10}{'p99 TTFT':>10}"
             f"{'KV use':>8}{'hit rate':>9}{'preempt':>8}"]
    for row in table.to_dict("records"):
        lines.append(f"{row['replica']:>7}{row['requests']:>10}{row['share']:>7.1%}"
                     f"{row['p50_ttft_ms']:>10.1f}{row['p99_ttft_ms']:>10.1f}"
                     f"{row['mean_kv_usage']:>8.1%}{row['prefix_hit_rate']:>9.1%}"
                     f"{row['preemptions']:>8}")
    lines += [f"{'Fleet prefix cache hit rate:':<40} {s['prefix_hit_rate']:.1%}",
              f"{'Load imbalance, requests (max/mean):':<40} {s['request_imbalance']:.2f}",
              f"{'Load imbalance, prompt tokens:':<40} {s['prompt_token_imbalance']:.2f}",
              f"{'Jain fairness, requests / tokens:':<40} {s['jain_requests']:.3f} / "
              f"{s['jain_prompt_tokens']:.3f}",
              "=" * 50]
    return "\n".join(lines)
