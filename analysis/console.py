"""Console blocks: vLLM's "Serving Benchmark Result" (exact format), then rt's own block."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.metrics import BenchmarkMetrics, attribution, benchmark_metrics, completed_mask
from analysis.rundir import REQUESTS_FILE, Run, load_run
from analysis.token_times import Chunks, file_chunks

WIDTH = 50
_SECTIONS = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _line(label: str, value: object, fmt: str = "") -> str:
    return f"{label:<40} {value:<10{fmt}}"


def _pct_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def benchmark_block(m: BenchmarkMetrics, metrics: Sequence[str] = ("ttft", "tpot", "itl",
                    "e2el"), percentiles: Sequence[float] = (99,),
                    request_rate: float | None = None, goodput: float | None = None) -> str:
    """The block `vllm bench serve` prints, line for line. `request_rate`: the configured
    rate of a synthetic workload (printed only when finite, as vLLM does); `goodput`: the
    request goodput (printed only when given, as with vLLM's --goodput)."""
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=WIDTH, c="="),
        _line("Successful requests:", m.completed),
        _line("Failed requests:", m.failed),
    ]
    if request_rate is not None and math.isfinite(request_rate):
        lines.append(_line("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [
        _line("Benchmark duration (s):", m.duration_s, ".2f"),
        _line("Total input tokens:", m.total_input_tokens),
        _line("Total generated tokens:", m.total_output_tokens),
        _line("Request throughput (req/s):", m.request_throughput, ".2f"),
    ]
    if goodput is not None:
        lines.append(_line("Request goodput (req/s):", goodput, ".2f"))
    lines += [
        _line("Output token throughput (tok/s):", m.output_throughput, ".2f"),
        _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f"),
        _line("Peak concurrent requests:", m.max_concurrent_requests, ".2f"),
        _line("Total token throughput (tok/s):", m.total_token_throughput, ".2f"),
    ]
    for name in metrics:
        title, short = _SECTIONS[name]
        stats = m.stats[name]
        lines.append("{s:{c}^{n}}".format(s=title, n=WIDTH, c="-"))
        lines.append(_line(f"Mean {short} (ms):", stats["mean"], ".2f"))
        lines.append(_line(f"Median {short} (ms):", stats["median"], ".2f"))
        for p in percentiles:
            key = f"p{_pct_label(p)}"
            lines.append(_line(f"P{_pct_label(p)} {short} (ms):", stats[key], ".2f"))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


CLIENT_TIMING_NOTE = ("engine-side attribution is not available for client-timed runs "
                      "(timing: client)")


def is_client_timed(info: dict[str, object]) -> bool:
    """A run measured from the client (`rt replay --endpoint`): no engine-side times."""
    return info.get("timing") == "client"


def _rt_title() -> str:
    return "{s:{c}^{n}}".format(s=" rt: where the time went ", n=WIDTH, c="=")


def client_rt_block(prefix_hit_rate: float) -> str:
    """rt's block for a client-timed run: a one-line note instead of NaN rows; the prefix
    cache hit rate comes from the server's reported cached tokens ("n/a" when the server
    reported none)."""
    rate = _line("Prefix cache hit rate (%):", "n/a") if math.isnan(prefix_hit_rate) \
        else _line("Prefix cache hit rate (%):", prefix_hit_rate * 100, ".2f")
    return "\n".join([_rt_title(), CLIENT_TIMING_NOTE, "-" * WIDTH, rate, "=" * WIDTH])


def rt_block(requests: pd.DataFrame, steps: pd.DataFrame, prefix_hit_rate: float,
             client_timing: bool = False) -> str:
    """rt's answer to "what were requests waiting for?", plus cache and KV figures
    (`client_timing`: the short block of `client_rt_block`)."""
    if client_timing:
        return client_rt_block(prefix_hit_rate)
    parts = attribution(requests)
    lines = [_rt_title(), f"{'part':<30}{'mean ms':>10}{'p99 ms':>10}{'share':>8}"]
    for row in parts.itertuples():
        lines.append(f"{row.part:<30}{row.mean_ms:>10.2f}{row.p99_ms:>10.2f}"
                     f"{row.share * 100:>7.1f}%")
    preempted = requests["num_preemptions"]
    lines += [
        "-" * WIDTH,
        _line("Preemptions:", int(preempted.sum())),
        _line("Requests preempted:", int((preempted > 0).sum())),
        _line("Prefix cache hit rate (%):", prefix_hit_rate * 100, ".2f"),
        _line("Mean KV cache usage (%):",
              float(steps["kv_usage"].mean()) * 100 if len(steps) else 0.0, ".2f"),
        _line("Engine steps:", len(steps)),
        "=" * WIDTH,
    ]
    return "\n".join(lines)


def run_blocks(requests: pd.DataFrame, steps: pd.DataFrame, percentiles: Sequence[float],
               request_rate: float | None = None, result: Any = None,
               chunks: Chunks | None = None) -> str:
    """What `rt simulate` and `rt replay` print after a run: vLLM's result block, then rt's
    block when the driver's `result` (`runtime.records.RunResult`: its prefix-cache counts)
    is given; vLLM's block alone for a client-timed run. `chunks`: the completed requests'
    token times when `requests` has no `token_times_s` column."""
    blocks = [benchmark_block(benchmark_metrics(requests, percentiles, chunks),
                              percentiles=percentiles, request_rate=request_rate)]
    if result is not None:
        hits = result.prefix_cache_hits / max(result.prefix_cache_queries, 1)
        blocks.append(rt_block(requests, steps, hits))
    return "\n".join(blocks)


def show_run(run: Any, result: Any, percentiles: Sequence[float], request_rate: float | None,
             echo: Callable[[str], None], log: Callable[[str], None],
             chunks: Chunks | None = None) -> None:
    """A written run (`analysis.rundir.Run`) on the console: `run_blocks` to `echo` (when it
    has requests), then, given the driver's `result` (a `RunResult` or its summary: steps
    and wall seconds), where it was written to `log`."""
    if len(run.requests):
        echo(run_blocks(run.requests, run.steps, percentiles, request_rate, result, chunks))
    if result is not None:
        log(f"wrote {run.path} ({len(run.requests)} requests, {result.num_steps} steps, "
            f"{result.wall_s:.2f} s wall)")


REPORT_STEP_COLUMNS = ("kv_usage", "replica")  # the steps columns run_blocks, show_fleet read


def show_written_run(path: Path, result: Any, percentiles: Sequence[float],
                     request_rate: float | None, echo: Callable[[str], None],
                     log: Callable[[str], None]) -> Run:
    """`show_run` of the run directory just written at `path`, read without its token times
    (streamed from requests.parquet in batches of 8,192 rows for ITL and the peak token rate)
    and with `REPORT_STEP_COLUMNS` of its steps: the same text as `load_run` then `show_run`
    at a fraction of the memory (1 M requests: the token times alone are ~1 GB as one flat
    array, several GB as a frame column). Returns that run (for `show_fleet`)."""
    run = load_run(path, token_times=False, step_columns=REPORT_STEP_COLUMNS)
    done = completed_mask(run.requests).to_numpy(dtype=bool)
    show_run(run, result, percentiles, request_rate, echo, log,
             file_chunks(path / REQUESTS_FILE, done))
    return run
