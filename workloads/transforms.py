"""Trace transforms: time window, first-N, time scaling or a target mean rate, max-model-len clip.

`apply_transforms` runs them in that fixed order: window (on the original clock), first-N,
time scaling, clipping. Each returns a new `Trace`; request ids and prompt structure are kept,
so token ids (`workloads.tokens`) do not change when a trace is cut or stretched.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from workloads.errors import TraceError
from workloads.trace import MAX_ARRIVAL_S, Trace, TraceRequest


@dataclass(frozen=True, slots=True)
class TransformSpec:
    """Which transforms to apply (None: skip).

    Attributes:
        start_s: window start, seconds from the trace start (default 0 with a duration).
        duration_s: window length in seconds (default: to the end with a start).
        first_n: keep the first N requests (after the window).
        time_scale: multiply every arrival time by this factor (> 0; 2 = half the rate).
        target_rate: rescale arrival times so the mean rate rows / span is this (req/s).
        max_model_len: clip to this context length in tokens (see `clip_to_max_model_len`).
    """

    start_s: float | None = None
    duration_s: float | None = None
    first_n: int | None = None
    time_scale: float | None = None
    target_rate: float | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _positive(self.time_scale, "--time-scale")
        _positive(self.target_rate, "--target-rate")
        _positive(self.duration_s, "--duration")
        _positive(self.first_n, "--first-n")
        _positive(self.max_model_len, "--max-model-len")
        if self.start_s is not None and (not math.isfinite(self.start_s) or self.start_s < 0):
            raise TraceError("must be a finite number >= 0 seconds", column="--start",
                             value=self.start_s)
        if self.time_scale is not None and self.target_rate is not None:
            raise TraceError("give --time-scale or --target-rate, not both",
                             column="--target-rate", value=self.target_rate)


@dataclass(frozen=True, slots=True)
class ClipReport:
    """Requests changed by max-model-len clipping (counts of requests)."""

    clipped_outputs: int = 0
    dropped_prompts: int = 0


def apply_transforms(trace: Trace, spec: TransformSpec) -> tuple[Trace, ClipReport]:
    """Apply the transforms `spec` selects, in the order window, first-N, scale, clip."""
    if spec.start_s is not None or spec.duration_s is not None:
        trace = time_window(trace, spec.start_s or 0.0, spec.duration_s)
    if spec.first_n is not None:
        trace = first_n(trace, spec.first_n)
    if spec.time_scale is not None:
        trace = scale_time(trace, spec.time_scale)
    if spec.target_rate is not None:
        trace = to_mean_rate(trace, spec.target_rate)
    report = ClipReport()
    if spec.max_model_len is not None:
        trace, report = clip_to_max_model_len(trace, spec.max_model_len)
    return trace, report


def time_window(trace: Trace, start_s: float, duration_s: float | None) -> Trace:
    """Requests arriving in [start_s, start_s + duration_s), re-timed to start at start_s = 0."""
    end = math.inf if duration_s is None else start_s + duration_s
    kept = [_at(req, req.arrival_s - start_s) for req in trace if start_s <= req.arrival_s < end]
    if not kept:
        raise TraceError(f"no request arrives in the window [{start_s}, {end}) s",
                         column="--start", value=start_s)
    return trace.replace_requests(kept)


def first_n(trace: Trace, n: int) -> Trace:
    """The first `n` requests (all of them if the trace is shorter)."""
    return trace.replace_requests(trace.requests[:n])


def scale_time(trace: Trace, factor: float, option: str = "--time-scale",
               given: float | None = None) -> Trace:
    """Every arrival time multiplied by `factor` (> 0): 2 halves the rate. A last arrival
    past `MAX_ARRIVAL_S` names `option` and its value (`given`, default `factor`)."""
    _positive(factor, option)
    last = trace[-1].arrival_s * factor if len(trace) else 0.0
    if last > MAX_ARRIVAL_S:
        raise TraceError(f"puts the last arrival at {last:.4g} s, past the "
                         f"{MAX_ARRIVAL_S:,.0f} s (194 days) a trace may span", column=option,
                         value=factor if given is None else given)
    return trace.replace_requests([_at(req, req.arrival_s * factor) for req in trace])


def to_mean_rate(trace: Trace, rate: float) -> Trace:
    """Arrival times scaled so that rows / (last - first arrival) equals `rate` req/s."""
    _positive(rate, "--target-rate")
    if len(trace) < 2 or trace[-1].arrival_s == trace[0].arrival_s:
        raise TraceError("the trace has no time span to rescale (all arrivals coincide)",
                         column="--target-rate", value=rate)
    current = len(trace) / (trace[-1].arrival_s - trace[0].arrival_s)
    return scale_time(trace, current / rate, "--target-rate", rate)


def clip_to_max_model_len(trace: Trace, max_model_len: int) -> tuple[Trace, ClipReport]:
    """Fit every request into `max_model_len` tokens (prompt + output), as vLLM requires.

    A request whose prompt leaves no room for one output token (prompt_len >= max_model_len)
    is dropped; otherwise its output is cut to max_model_len - prompt_len tokens. Both are
    counted in the report, never silent.
    """
    _positive(max_model_len, "--max-model-len")
    kept: list[TraceRequest] = []
    clipped = dropped = 0
    for req in trace:
        room = max_model_len - req.prompt_len
        if room < 1:
            dropped += 1
        elif req.output_len > room:
            clipped += 1
            kept.append(dataclasses.replace(req, output_len=room))
        else:
            kept.append(req)
    if not kept:
        raise TraceError("every prompt is at least max-model-len tokens long",
                         column="--max-model-len", value=max_model_len)
    return trace.replace_requests(kept), ClipReport(clipped, dropped)


def _at(req: TraceRequest, arrival_s: float) -> TraceRequest:
    return dataclasses.replace(req, arrival_s=max(arrival_s, 0.0))


def _positive(value: float | None, option: str) -> None:
    if value is not None and (isinstance(value, bool) or not value > 0 or
                              not math.isfinite(value)):
        raise TraceError("must be > 0", column=option, value=value)


def check_max_model_len(trace: Trace, max_model_len: int) -> None:
    """ValueError naming the first request whose prompt + output exceed `max_model_len` (an
    engine would refuse it): the trace must be clipped first."""
    for req in trace:
        if req.prompt_len + req.output_len > max_model_len:
            raise ValueError(
                f"request {req.request_id}: {req.prompt_len} prompt + {req.output_len} output "
                f"tokens exceed max_model_len={max_model_len} (clip the trace with "
                "`rt trace convert --max-model-len`)")
