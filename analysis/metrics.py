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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.token_times import (
    TOKEN_COLUMN,
    Chunks,
    frame_chunks,
    gather_gaps,
    peak_tokens_per_second,
)

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
ROUTING_PART = {"routing_s": "Routing (fleet)"}  # fleet runs: arrival -> a replica's server
TRANSFER_PART = {"kv_transfer_s": "KV transfer (P/D)"}  # P/D runs: prefill -> decode replica
# Every part any run can have, in pipeline order (the KV transfer between prefill and decode).
ALL_PARTS = ROUTING_PART | {c: label for c, label in PARTS.items() if c != "decode_s"} | \
    TRANSFER_PART | {"decode_s": PARTS["decode_s"]}


def parts_of(requests: pd.DataFrame) -> dict[str, str]:
    """The parts a run's requests have: a fleet run's `routing_s` first, then PARTS, with a
    P/D run's `kv_transfer_s` after the prefill."""
    return {c: label for c, label in ALL_PARTS.items() if c in PARTS or c in requests.columns}


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


def completed_mask(requests: pd.DataFrame) -> pd.Series:
    """Per request: completed (vLLM's success: a finished status and an output)."""
    return requests["status"].isin(COMPLETED_STATUSES) & (requests["output_len"] > 0)


def completed_requests(requests: pd.DataFrame) -> pd.DataFrame:
    return requests[completed_mask(requests)]


def per_request_latencies(requests: pd.DataFrame) -> pd.DataFrame:
    """TTFT, TPOT and E2EL in ms per completed request (TPOT NaN when output_len <= 1)."""
    done = completed_requests(requests)
    ttft = (done["first_token_s"] - done["arrival_s"]) * 1e3
    e2el = (done["finish_s"] - done["arrival_s"]) * 1e3
    decode_tokens = (done["output_len"] - 1).where(done["output_len"] > 1)
    tpot = (e2el - ttft) / decode_tokens
    return pd.DataFrame({"request_id": done["request_id"], "ttft": ttft, "tpot": tpot,
                         "e2el": e2el, "output_len": done["output_len"]})


def inter_token_latencies(requests: pd.DataFrame, chunks: Chunks | None = None) -> np.ndarray:
    """Every gap between consecutive tokens of every completed request, in ms (request by
    request, in order), in one float64 array: no Python object per token, no second
    token-sized array (~1 GB at 1 M requests). `chunks`: the completed requests' token times
    when `requests` has no `token_times_s` column (`analysis.token_times.file_chunks`)."""
    done = completed_requests(requests)
    if chunks is None:
        counts = np.fromiter((len(t) for t in done[TOKEN_COLUMN]), np.int64, len(done))
        return gather_gaps(frame_chunks(done), int(np.maximum(counts - 1, 0).sum()))
    return gather_gaps(chunks(), int(np.maximum(done["output_len"] - 1, 0).sum()))


def summarize(values: np.ndarray, percentiles: Sequence[float],
              overwrite: bool = False) -> dict[str, float]:
    """Mean, median, std and percentiles of the non-NaN values. `overwrite`: the caller
    gives `values` up, the order statistics reorder it in place instead of copying it."""
    nan = np.isnan(values)
    if nan.any():  # a copy only when there is something to drop
        values = values[~nan]
    del nan
    if values.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0} | {_pkey(p): 0.0 for p in percentiles}
    out = {"mean": float(np.mean(values)), "std": float(np.std(values))}
    out["median"] = float(np.median(values, overwrite_input=overwrite))
    out.update({_pkey(p): float(np.percentile(values, p, overwrite_input=overwrite))
                for p in percentiles})
    return {key: out[key] for key in ("mean", "median", "std", *(_pkey(p) for p in percentiles))}


def _pkey(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def benchmark_metrics(requests: pd.DataFrame, percentiles: Sequence[float] = (99,),
                      chunks: Chunks | None = None) -> BenchmarkMetrics:
    """vLLM's benchmark result. `chunks`: the completed requests' token times when
    `requests` has no `token_times_s` column (`analysis.token_times.file_chunks`)."""
    done = completed_requests(requests)
    lat = per_request_latencies(requests)
    start = float(requests["arrival_s"].min()) if len(requests) else 0.0
    end = float(requests["finish_s"].max()) if len(requests) else 0.0
    duration = max(end - start, 1e-12)
    total_in = int(done["prompt_len"].sum())
    total_out = int(done["output_len"].sum())
    values = {"ttft": lat["ttft"].to_numpy(), "tpot": lat["tpot"].to_numpy(),
              "itl": inter_token_latencies(requests, chunks), "e2el": lat["e2el"].to_numpy()}
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(requests) - len(done),
        duration_s=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=_peak_tokens_per_second(
            done, float(done["arrival_s"].min()) if len(done) else start, chunks),
        max_concurrent_requests=_peak_concurrency(done),
        stats={name: summarize(np.asarray(v, dtype=np.float64), percentiles,
                               overwrite=name == "itl")  # the ITL array is ours alone
               for name, v in values.items()},
    )


def _peak_tokens_per_second(done: pd.DataFrame, start: float,
                            chunks: Chunks | None = None) -> float:
    """vLLM's `max_output_tokens_per_s` (`analysis.token_times.peak_tokens_per_second`)."""
    return peak_tokens_per_second(frame_chunks(done) if chunks is None else chunks(), start)


def _peak_concurrency(done: pd.DataFrame) -> int:
    """vLLM 0.32's `max_concurrent_requests` ("Peak concurrent requests"), from
    `vllm/benchmarks/serve.py` `calculate_metrics`: one-second buckets from the first
    completed request's start t0; a request counts in every bucket from int(start - t0) to
    int(end - t0), both included; the peak is the fullest bucket. So requests that follow
    one another within a second all count: it is at least the instantaneous peak (e.g. 22
    where at most 10 were ever in flight at once). vLLM's main branch later replaced it by
    the instantaneous peak (a sweep-line over [start, end), after vllm#56653); 0.32 is the
    `vllm bench serve` this is checked against."""
    if done.empty:
        return 0
    t0 = float(done["arrival_s"].min())
    first = np.floor(done["arrival_s"].to_numpy(dtype=np.float64) - t0).astype(np.int64)
    last = np.floor(done["finish_s"].to_numpy(dtype=np.float64) - t0).astype(np.int64)
    counts = np.zeros(int(last.max()) + 2, dtype=np.int64)
    np.add.at(counts, first, 1)
    np.add.at(counts, last + 1, -1)
    return int(np.cumsum(counts).max())


def attribution(requests: pd.DataFrame, percentiles: Sequence[float] = (99,)) -> pd.DataFrame:
    """Per part: mean and percentiles in ms over completed requests, and the part's share of
    the mean E2E latency (shares sum to 1)."""
    done = completed_requests(requests)
    e2e_mean = float((done["finish_s"] - done["arrival_s"]).mean()) if len(done) else 0.0
    rows = []
    for column, label in parts_of(requests).items():
        ms = done[column].to_numpy(dtype=np.float64) * 1e3
        row = {"part": label, "column": column,
               "mean_ms": float(ms.mean()) if ms.size else 0.0,
               "share": float(ms.mean() / 1e3 / e2e_mean) if e2e_mean > 0 else 0.0}
        row.update({f"{_pkey(p)}_ms": float(np.percentile(ms, p)) if ms.size else 0.0
                    for p in percentiles})
        rows.append(row)
    return pd.DataFrame(rows)


# ---- vLLM bench options: --percentile-metrics, --metric-percentiles, --goodput -------------

DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")  # vLLM's default selection
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys (DistServe)


def parse_percentile_metrics(text: str) -> list[str]:
    """`--percentile-metrics ttft,tpot,itl,e2el`; ValueError naming an unknown metric."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics: unknown metric {', '.join(unknown) or text!r} "
                         f"(choose from {', '.join(METRICS)})")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    """`--metric-percentiles 50,90,99.9`: each in (0, 100)."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles: not a comma-separated list of numbers: "
                         f"{text!r}") from None
    if not values or any(not 0 < p < 100 for p in values):
        raise ValueError(f"--metric-percentiles: each must be in (0, 100), got {text!r}")
    return values


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """vLLM's `--goodput ttft:200 tpot:50 e2el:2000` (ms); items may also be comma- or
    space-separated in one string. ValueError on an unknown key or a bad value."""
    slos: dict[str, float] = {}
    for item in (part for text in items for part in text.replace(",", " ").split()):
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: expected KEY:MS with KEY one of "
                             f"{', '.join(GOODPUT_METRICS)}, got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r}: {value!r} is not a number") from None
        if not 0 <= slos[key] < math.inf:  # nan too: no request would meet it
            raise ValueError(f"--goodput: {item!r}: the SLO must be a number of ms >= 0")
    return slos


def goodput_mask(requests: pd.DataFrame, slos: dict[str, float]) -> pd.Series:
    """Per completed request: meets every SLO (value <= SLO ms). As vLLM, a request with one
    output token has TPOT 0 here."""
    lat = per_request_latencies(requests)
    good = pd.Series(True, index=lat.index)
    for key, slo_ms in slos.items():
        values = lat[key].fillna(0.0) if key == "tpot" else lat[key]
        good &= values <= slo_ms
    return good


def request_goodput(requests: pd.DataFrame, slos: dict[str, float],
                    duration_s: float) -> float:
    """Good requests per second of the run's duration (vLLM's `request_goodput`)."""
    return float(goodput_mask(requests, slos).sum()) / duration_s


# ---- vLLM's per-request phase times (vllm:request_*_time_seconds) --------------------------

PHASES = {
    "request_queue_time": "Queue time (first scheduled - queued)",
    "request_prefill_time": "Prefill time (first token - first scheduled)",
    "request_decode_time": "Decode time (last token - first token)",
    "request_inference_time": "Inference time (last token - first scheduled)",
}


def phase_times(requests: pd.DataFrame) -> pd.DataFrame:
    """Per completed request, in ms, as vLLM's frontend computes them (IterationStats):
    queue = first SCHEDULED - QUEUED (engine), prefill = first token - first scheduled
    (preemptions during prefill included), decode = last token - first token,
    inference = last token - first scheduled."""
    done = completed_requests(requests)
    last = done[TOKEN_COLUMN].map(lambda t: float(t[-1]) if len(t) else np.nan)
    last = last.fillna(done["finish_s"])
    return pd.DataFrame({
        "request_id": done["request_id"],
        "request_queue_time": (done["first_scheduled_s"] - done["engine_queued_s"]) * 1e3,
        "request_prefill_time": (done["first_token_s"] - done["first_scheduled_s"]) * 1e3,
        "request_decode_time": (last - done["first_token_s"]) * 1e3,
        "request_inference_time": (last - done["first_scheduled_s"]) * 1e3,
    })


# ---- cache and KV figures ---------------------------------------------------------------


def prefix_cache_hit_rate(requests: pd.DataFrame, info: dict[str, object]) -> float:
    """Hit tokens / queried tokens: the run's scheduler counters when run.json has them
    (vLLM's prefix_cache_{hits,queries}), else cached / prompt tokens of all requests. A
    client-timed run knows cached tokens only if the server reported them
    (`usage.prompt_tokens_details.cached_tokens`; vLLM needs --enable-prompt-tokens-details):
    NaN (unknown) when none did."""
    if info.get("timing") == "client" and not info.get("cached_tokens_reported"):
        return float("nan")
    counters = info.get("prefix_cache")
    if isinstance(counters, dict) and counters.get("queries"):
        return float(counters["hits"]) / float(counters["queries"])
    prompt = float(requests["prompt_len"].sum()) if len(requests) else 0.0
    return float(requests["cached_tokens"].sum()) / prompt if prompt else 0.0


def kv_usage_over_time(steps: pd.DataFrame, bin_s: float = 1.0) -> pd.DataFrame:
    """Per `bin_s` window of step ends: mean and max KV usage (0-1), mean running and waiting
    requests, scheduled tokens (prefill, decode) and steps. Empty windows are left out."""
    if steps.empty:
        return pd.DataFrame(columns=["time_s", "kv_usage_mean", "kv_usage_max", "running",
                                     "waiting", "prefill_tokens", "decode_tokens", "steps"])
    window = np.floor(steps["end_s"].to_numpy() / bin_s).astype(np.int64)
    grouped = steps.groupby(window)
    out = pd.DataFrame({
        "kv_usage_mean": grouped["kv_usage"].mean(),
        "kv_usage_max": grouped["kv_usage"].max(),
        "running": grouped["num_running"].mean(),
        "waiting": grouped["num_waiting"].mean(),
        "prefill_tokens": grouped["num_prefill_tokens"].sum(),
        "decode_tokens": grouped["num_decode_tokens"].sum(),
        "steps": grouped["step"].count(),
    })
    out.insert(0, "time_s", out.index.to_numpy() * bin_s)
    return out.reset_index(drop=True)
