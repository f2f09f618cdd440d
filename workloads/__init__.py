"""Workloads: one trace model, real-trace loaders, vLLM-compatible synthetic generators.

Imports nothing else of the project. Units: seconds for times, tokens for lengths.
See `workloads.trace` (model), `workloads.tokens` (deterministic token ids),
`workloads.rtformat` (rt JSONL), `workloads.loaders` (file formats),
`workloads.arrivals` and `workloads.synthetic` (generators), `workloads.transforms`,
`workloads.stats`.
"""

from __future__ import annotations

from workloads.arrivals import MAX_SEED, ArrivalProcess, vllm_arrival_times
from workloads.csv_formats import write_vidur_csv
from workloads.defaults import DEFAULT_TRACE_PATH, default_trace
from workloads.errors import TraceError
from workloads.loaders import FORMATS, LoadResult, detect_format, load_trace, read_rows
from workloads.rows import LoadReport, RawRows
from workloads.rtformat import read_rt_jsonl, trace_digest, trace_info, write_rt_jsonl
from workloads.stats import (
    LengthStats,
    PrefixReuse,
    TimeStats,
    TraceStats,
    prefix_reuse,
    rows_stats,
    trace_stats,
)
from workloads.synthetic import (
    MultiTurn,
    PrefixRepetition,
    RandomLengths,
    multi_turn_trace,
    prefix_repetition_trace,
    random_trace,
    resample_like,
    resample_trace,
)
from workloads.timed_trace import write_timed_trace
from workloads.tokens import (
    RESERVED_TOKEN_IDS,
    output_token_ids,
    prompt_token_ids,
    stream_token_ids,
)
from workloads.trace import Span, Trace, TraceColumns, TraceRequest
from workloads.transforms import (
    ClipReport,
    TransformSpec,
    apply_transforms,
    check_max_model_len,
    clip_to_max_model_len,
    first_n,
    scale_time,
    time_window,
    to_mean_rate,
)

__all__ = [
    "DEFAULT_TRACE_PATH",
    "default_trace",
    "trace_digest",
    "trace_info",
    "FORMATS", "RESERVED_TOKEN_IDS", "ArrivalProcess", "MAX_SEED", "ClipReport", "LengthStats",
    "LoadReport", "LoadResult", "MultiTurn", "PrefixRepetition", "PrefixReuse", "RandomLengths",
    "RawRows", "TraceRequest", "Span", "TimeStats", "Trace", "TraceColumns", "TraceError",
    "TraceStats", "TransformSpec", "apply_transforms", "check_max_model_len",
    "clip_to_max_model_len", "detect_format",
    "first_n", "load_trace", "multi_turn_trace", "output_token_ids", "prefix_repetition_trace",
    "prefix_reuse", "prompt_token_ids", "random_trace", "read_rows", "read_rt_jsonl",
    "resample_like", "resample_trace", "rows_stats", "scale_time", "stream_token_ids",
    "time_window", "to_mean_rate", "trace_stats", "vllm_arrival_times", "write_rt_jsonl",
    "write_timed_trace",
    "write_vidur_csv",
]
