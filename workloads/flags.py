"""The workload's flags, declared once, and the one path from them to a trace.

A workload is a trace file (any supported format; arrival flags time length-only files) or a
synthetic dataset with `vllm bench serve`'s flags, then the transforms (window, first N, time
scale, target rate, clipping to a context length). Every command that takes a workload builds
a `WorkloadFlags` (cli.py turns its fields into options; each field's metadata carries the
option name, help and panel) and calls `load_workload`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workloads.arrivals import MAX_SEED, ArrivalProcess
from workloads.defaults import DEFAULT_TRACE_PATH
from workloads.errors import TraceError
from workloads.loaders import FORMATS, detect_format, load_trace, read_rows
from workloads.report import clip_notes, load_notes
from workloads.stats import TraceStats, rows_stats
from workloads.synthetic import (
    MultiTurn,
    PrefixRepetition,
    RandomLengths,
    multi_turn_trace,
    prefix_repetition_trace,
    random_trace,
    resample_trace,
)
from workloads.trace import Trace
from workloads.transforms import TransformSpec, apply_transforms

DATASETS = ("random", "prefix_repetition", "multi_turn", "resample")
WORKLOAD_PANEL = "Workload"


def _flag(default: Any, option: str, help: str | None = None, **bounds: Any) -> Any:
    """A flag field (`runtime.flags.flag`'s metadata; `bounds`: the parser's min=, max=)."""
    return field(default=default, metadata={"flag": option, "help": help,
                                            "panel": WORKLOAD_PANEL, **bounds})


@dataclass(frozen=True, slots=True)
class TraceFileFlags:
    """`--trace`: the trace file of a command that defaults to the embedded excerpt."""

    trace: Path | None = _flag(
        None, "--trace", "Trace file (any `rt trace` format). Default: the embedded excerpt of "
        "the Azure conversation trace (first 10 min), unless --dataset-name is given.")


@dataclass(frozen=True, slots=True)
class WorkloadFlags:
    """Where requests come from (file or synthetic), when they arrive, and which are kept.
    Lengths in tokens, times in seconds, rates in requests per second."""

    fmt: str | None = _flag(None, "--format", f"Input format, one of {', '.join(FORMATS)} "
                            "(default: detect).")
    trace_model: str | None = _flag(None, "--trace-model", "Keep only rows of this model "
                                    "(BurstGPT 'Model', e.g. GPT-4).")
    hash_block_size: int | None = _flag(None, "--hash-block-size", "Tokens per hash id "
                                        "(default: Mooncake 512, Bailian 16).")
    dataset_name: str | None = _flag(None, "--dataset-name", "Synthetic workload instead of "
                                     f"a trace: {', '.join(DATASETS)}.")
    dataset_path: Path | None = _flag(None, "--dataset-path",
                                      "Trace whose lengths 'resample' draws from.")
    num_prompts: int = _flag(1000, "--num-prompts", "Requests.")
    input_len: int = _flag(1024, "--random-input-len")
    output_len: int = _flag(128, "--random-output-len")
    range_ratio: float = _flag(0.0, "--random-range-ratio",
                               "Lengths uniform in [L(1-r), L(1+r)], 0 <= r < 1.")
    prefix_len: int = _flag(0, "--random-prefix-len", "Shared prefix tokens before every "
                            "prompt.")
    rep_prefix_len: int = _flag(256, "--prefix-repetition-prefix-len")
    rep_suffix_len: int = _flag(256, "--prefix-repetition-suffix-len")
    rep_num_prefixes: int = _flag(10, "--prefix-repetition-num-prefixes")
    rep_output_len: int = _flag(128, "--prefix-repetition-output-len")
    turns: int = _flag(4, "--multi-turn-num-turns")
    turn_gap_s: float = _flag(10.0, "--multi-turn-gap-s", "Seconds between a conversation's "
                              "turns.")
    request_rate: float = _flag(math.inf, "--request-rate", "Requests/s of the vLLM arrival "
                                "process; inf = all at t = 0.")
    burstiness: float = _flag(1.0, "--burstiness", "Gamma shape of the gaps (1 = Poisson, <1 "
                              "burstier, inf = constant).")
    seed: int = _flag(0, "--seed", "Seed of every random draw (as vLLM).", min=0,
                      max=MAX_SEED)
    start_s: float | None = _flag(None, "--start", "Window start, s from the trace start "
                                  "(arrivals re-timed to 0).")
    duration_s: float | None = _flag(None, "--duration", "Window length in s.")
    first_n: int | None = _flag(None, "--first-n", "Keep the first N requests.")
    time_scale: float | None = _flag(None, "--time-scale", "Multiply arrival times by this "
                                     "factor (2 = half the rate).")
    target_rate: float | None = _flag(None, "--target-rate", "Rescale arrival times to this "
                                      "mean rate (req/s).")
    max_model_len: int | None = _flag(None, "--max-model-len", "Clip outputs to fit this "
                                      "context (tokens); drop prompts that do not fit. "
                                      "Counted and reported.")

    @property
    def arrivals(self) -> ArrivalProcess:
        return ArrivalProcess(self.request_rate, self.burstiness, self.seed)

    @property
    def lengths(self) -> RandomLengths:
        return RandomLengths(self.input_len, self.output_len, self.range_ratio, self.prefix_len)

    @property
    def transforms(self) -> TransformSpec:
        return TransformSpec(self.start_s, self.duration_s, self.first_n, self.time_scale,
                             self.target_rate, self.max_model_len)


@dataclass(frozen=True, slots=True)
class Workload:
    """A loaded workload: the trace, the file format it came from ('synthetic' otherwise),
    and the notes loading and clipping left (one line each, for the user)."""

    trace: Trace
    format: str
    notes: tuple[str, ...]


def load_workload(flags: WorkloadFlags, path: Path | None = None) -> Workload:
    """The trace at `path` (default: the embedded excerpt) or `flags.dataset_name`'s
    synthetic trace, then the transforms. TraceError (one line naming the flag) on bad
    input, on both a path and a dataset, or on no request left."""
    if path is not None and flags.dataset_name is not None:
        raise TraceError("give either --trace or --dataset-name, not both (a trace file "
                         "or a synthetic workload)",
                         column="--dataset-name", value=flags.dataset_name)
    notes: list[str] = []
    if flags.dataset_name is None:
        result = load_trace(path or DEFAULT_TRACE_PATH, flags.fmt, model=flags.trace_model,
                            arrivals=flags.arrivals, hash_block_size=flags.hash_block_size)
        notes += load_notes(result.report, flags.trace_model)
        trace, kind = result.trace, result.report.format
    else:
        trace, kind = synthetic_trace(flags, notes), "synthetic"
    trace, clip = apply_transforms(trace, flags.transforms)
    notes += clip_notes(clip, flags.max_model_len)
    if len(trace) == 0:
        raise TraceError(f"the workload has no requests ({trace.name or 'trace'})")
    return Workload(trace, kind, tuple(notes))


def synthetic_trace(flags: WorkloadFlags, notes: list[str]) -> Trace:
    """`flags.dataset_name`'s trace with vLLM bench's generators (same seed, same arrivals);
    'resample' appends its source's load notes to `notes`."""
    name, n, arrivals = flags.dataset_name, flags.num_prompts, flags.arrivals
    if name == "random":
        return random_trace(n, flags.lengths, arrivals)
    if name == "prefix_repetition":
        repetition = PrefixRepetition(flags.rep_prefix_len, flags.rep_suffix_len,
                                      flags.rep_num_prefixes, flags.rep_output_len)
        return prefix_repetition_trace(n, repetition, arrivals)
    if name == "multi_turn":
        return multi_turn_trace(n, MultiTurn(flags.turns, flags.turn_gap_s, flags.lengths),
                                arrivals)
    if name == "resample":
        if flags.dataset_path is None:
            raise TraceError("resample needs a trace to draw lengths from",
                             column="--dataset-path")
        source = load_trace(flags.dataset_path, flags.fmt)
        notes += load_notes(source.report, None)
        return resample_trace(source.trace, n, arrivals)
    raise TraceError(f"must be one of {', '.join(DATASETS)}", column="--dataset-name",
                     value=name)


def all_rows_stats(flags: WorkloadFlags, path: Path) -> tuple[TraceStats, str]:
    """Statistics over every row of the file, failed rows included (`--keep-failed`): the
    file as it is, so no row filter and no transform may be given."""
    if flags.trace_model is not None or flags.transforms != TransformSpec():
        raise TraceError("--keep-failed reads the file as is: it takes no --trace-model "
                         "and no transforms", column="--keep-failed", value=True)
    if (flags.fmt or detect_format(path)) == "rt":
        raise TraceError("an rt trace has no failed rows to keep (its rows are requests "
                         "already)", column="--keep-failed", value=True)
    rows = read_rows(path, flags.fmt, hash_block_size=flags.hash_block_size)
    return rows_stats(rows), f"{rows.format}, all rows"
