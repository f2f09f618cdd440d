"""Serving metrics with `vllm bench serve`'s definitions, and rt's latency attribution.

All inputs are a run's `requests` table (seconds); outputs are milliseconds where vLLM uses
milliseconds. Definitions (vLLM `calculate_metrics`):
    TTFT  first token - arrival                        one value per request
    TPOT  (E2EL - TTFT) / (output_len - 1)             requests with output_len > 1 only
    ITL   gaps between consecutive tokens              pooled over all requests
    E2EL  finish - arrival                             one value per request
    duration = last finish - first arrival; throughputs divide by it.
Statistics: mean, median, std (population) and linear-interpolated percentiles, as numpy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

COMPLETED_STATUSES = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
METRICS = ("ttft", "tpot", "itl", "e2el")
# Attribution parts (columns of requests.parquet), in pipeline order, with their labels.
PARTS = {
    "api_server_s": "API server (tokenize, queue)",
    "step_boundary_s": "Wait for step boundary",
    "queue_token_budget_s": "Queue: token budget",
    "queue_max_num_seqs_s": "Queue: max_num_seqs",
    "queue_kv_capacity_s": "Queue: KV capacity",
    "queue_preempted_step_s": "Queue: step preempted",
    "preempted_s": "Preempted (wait + recompute)",
    "prefill_s": "Prefill execution",
    "decode_s": "Decode execution",
}


@dataclass(frozen=True)
class BenchmarkMetrics:
    """vLLM's benchmark result for one run. `stats[metric][stat]` is in ms, with stat one of
    "mean", "median", "std" and "p<P>" for each requested percentile."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, dict[str, float]] = field(default_factory=dict)


def completed_requests(requests: pd.DataFrame) -> pd.DataFrame:
    return requests[requests["status"].isin(COMPLETED_STATUSES) & (requests["output_len"] > 0)]


def per_request_latencies(requests: pd.DataFrame) -> pd.DataFrame:
    """TTFT, TPOT and E2EL in ms per completed request (TPOT NaN when output_len <= 1)."""
    done = completed_requests(requests)
    ttft = (done["first_token_s"] - done["arrival_s"]) * 1e3
    e2el = (done["finish_s"] - done["arrival_s"]) * 1e3
    decode_tokens = (done["output_len"] - 1).where(done["output_len"] > 1)
    tpot = (e2el - ttft) / decode_tokens
    return pd.DataFrame({"request_id": done["request_id"], "ttft": ttft, "tpot": tpot,
                         "e2el": e2el, "output_len": done["output_len"]})


def inter_token_latencies(requests: pd.DataFrame) -> np.ndarray:
    """Every gap between consecutive tokens of every completed request, in ms."""
    gaps = [np.diff(np.asarray(times, dtype=np.float64))
            for times in completed_requests(requests)["token_times_s"] if len(times) > 1]
    return np.concatenate(gaps) * 1e3 if gaps else np.empty(0)


def summarize(values: np.ndarray, percentiles: Sequence[float]) -> dict[str, float]:
    values = values[~np.isnan(values)]
    if values.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0} | {_pkey(p): 0.0 for p in percentiles}
    out = {"mean": float(np.mean(values)), "median": float(np.median(values)),
           "std": float(np.std(values))}
    out.update({_pkey(p): float(np.percentile(values, p)) for p in percentiles})
    return out


def _pkey(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def benchmark_metrics(requests: pd.DataFrame,
                      percentiles: Sequence[float] = (99,)) -> BenchmarkMetrics:
    done = completed_requests(requests)
    lat = per_request_latencies(requests)
    start = float(requests["arrival_s"].min()) if len(requests) else 0.0
    end = float(requests["finish_s"].max()) if len(requests) else 0.0
    duration = max(end - start, 1e-12)
    total_in = int(done["prompt_len"].sum())
    total_out = int(done["output_len"].sum())
    values = {"ttft": lat["ttft"].to_numpy(), "tpot": lat["tpot"].to_numpy(),
              "itl": inter_token_latencies(requests), "e2el": lat["e2el"].to_numpy()}
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(requests) - len(done),
        duration_s=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=_peak_tokens_per_second(done, start),
        max_concurrent_requests=_peak_concurrency(done),
        stats={name: summarize(np.asarray(v, dtype=np.float64), percentiles)
               for name, v in values.items()},
    )


def _peak_tokens_per_second(done: pd.DataFrame, start: float) -> float:
    times = [t for times in done["token_times_s"] for t in times]
    if not times:
        return 0.0
    seconds = np.floor(np.asarray(times) - start).astype(np.int64)
    return float(np.bincount(seconds).max())


def _peak_concurrency(done: pd.DataFrame) -> int:
    """Largest number of requests in flight, over [arrival, finish) intervals."""
    if done.empty:
        return 0
    events = np.concatenate([done["arrival_s"].to_numpy(), done["finish_s"].to_numpy()])
    deltas = np.concatenate([np.ones(len(done)), -np.ones(len(done))])
    order = np.lexsort((deltas, events))  # at equal times, finishes (-1) come first
    return int(np.cumsum(deltas[order]).max())


def attribution(requests: pd.DataFrame, percentiles: Sequence[float] = (99,)) -> pd.DataFrame:
    """Per part: mean and percentiles in ms over completed requests, and the part's share of
    the mean E2E latency (shares sum to 1)."""
    done = completed_requests(requests)
    e2e_mean = float((done["finish_s"] - done["arrival_s"]).mean()) if len(done) else 0.0
    rows = []
    for column, label in PARTS.items():
        ms = done[column].to_numpy(dtype=np.float64) * 1e3
        row = {"part": label, "column": column,
               "mean_ms": float(ms.mean()) if ms.size else 0.0,
               "share": float(ms.mean() / 1e3 / e2e_mean) if e2e_mean > 0 else 0.0}
        row.update({f"{_pkey(p)}_ms": float(np.percentile(ms, p)) if ms.size else 0.0
                    for p in percentiles})
        rows.append(row)
    return pd.DataFrame(rows)
