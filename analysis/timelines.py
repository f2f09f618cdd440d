"""Each request's timeline as labelled segments, rebuilt from a run's files.

A run records, per request, its boundaries (arrival, queued, engine_queued, first_scheduled,
token times, finish) and the totals of its attribution parts; per step, its interval
[start_s, end_s), the waiting-queue head's `wait_reason` and `num_preempted`. From these:

    exact     API server [arrival, queued), step boundary [queued, engine_queued), the queue
              waits by cause (the intervals of the steps between taking-in and admission,
              each labelled by that step's wait_reason, as the recorder counts them), and
              which steps ended with a token for the request.
    inferred  the running phase's gaps. A stretch of k > 1 steps between two of its tokens
              is a preemption (wait + recompute) when its first step preempted something
              and the request still has preemptions to place (at most `num_preemptions`);
              else it was left out of k - 1 steps (token budget) and decoded in the last.
              Before the first token: the steps whose intervals add up to `prefill_s` are
              prefill chunks, a remainder is a preemption (if one is left to place) or
              skipped steps (token budget).

The records do not say in which steps a request was scheduled, so the inferred segments
are the likeliest reading, checked against the recorded parts by `part_totals`.
Client-timed runs (no engine-side times) get two segments: waiting for the first token and
streaming, both as the client saw them.

Fleet runs (a `replica` column): a request's segments come from its own replica's steps
(`EngineSteps`), after a routing segment [arrival, arrival + routing_s). A P/D request
prefilled on another replica (`prefill_replica` != `replica`) has two sides, as `sim.pd`
records them summed in one row:

    prefill replica  routing, API server [reached, queued), step boundary, queue,
                     prefill [first_scheduled, prefilled)
    decode replica   API server [prefilled, handed over), KV transfer (kv_transfer_s), step
                     boundary, queue (decode_queue_s), prefill (the first step: it samples
                     the first token), decode

The row keeps the prefill side's boundaries and the decode side's tokens; the decode side's
first step is the decode replica's step ending at the first token, and the boundaries
between (prefilled, handed over, transferred) follow back from it by the recorded parts
(decode side's API server, step boundary and queue: the totals less the prefill side's).
Preemptions before the first token are all placed on the prefill side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.engine_steps import EPS, QUEUE_PARTS, EngineSteps, StepIndex

LABELS = {
    "api_server_s": "API server", "step_boundary_s": "step boundary",
    "queue_token_budget_s": "queue: token budget", "queue_max_num_seqs_s":
    "queue: max_num_seqs", "queue_kv_capacity_s": "queue: KV capacity",
    "queue_preempted_step_s": "queue: step preempted", "queue_s": "queue (cause unknown)",
    "preempted_s": "preempted (wait + recompute)", "prefill_s": "prefill",
    "decode_s": "decode", "skipped_s": "skipped steps (token budget)",
    "routing_s": "routing", "kv_transfer_s": "KV transfer",
    "client_wait_s": "waiting for first token (client)", "client_stream_s": "streaming (client)",
    "mixed_s": "short segments, mixed",
}
# The attribution part each segment kind counts toward (skipped steps are token budget).
QUEUE_KINDS = ("queue_s", *QUEUE_PARTS.values())  # by StepIndex.reason_code
PART_OF = {"skipped_s": "queue_token_budget_s", "queue_s": "queue_token_budget_s"}


@dataclass(frozen=True)
class Segment:
    """One span of a request's timeline: `kind` is a key of LABELS, times in seconds."""

    kind: str
    start_s: float
    end_s: float
    args: dict[str, object] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return LABELS[self.kind]


@dataclass(frozen=True)
class RequestTimeline:
    """A request's segments (in time order, tiling [arrival, finish)) and its prefill
    chunks (one per step it prefilled in, each inside a prefill segment)."""

    request_id: str
    arrival_s: float
    finish_s: float
    segments: list[Segment]
    chunks: list[Segment]


def _num(value: object) -> float | None:
    if value is None:
        return None
    value = float(value)  # type: ignore[arg-type]
    return None if math.isnan(value) else value


def _seg(out: list[Segment], kind: str, lo: float | None, hi: float | None,
         **args: object) -> None:
    if lo is not None and hi is not None and hi - lo > EPS:
        out.append(Segment(kind, lo, hi, dict(args)))


def _queue_segments(out: list[Segment], steps: StepIndex, lo: float, hi: float) -> None:
    """[lo, hi) waiting for admission, split by each overlapping step's wait reason (runs of
    steps with one reason, back to back, make one segment)."""
    window = steps.overlapping(lo, hi)
    idx = np.arange(window.start, window.stop)
    codes = steps.reason_code[idx]
    joined = steps.start[idx[1:]] == steps.end[idx[:-1]]
    bounds = [0, *(np.nonzero((np.diff(codes) != 0) | ~joined)[0] + 1).tolist(), len(idx)]
    cursor = lo
    for g0, g1 in zip(bounds[:-1], bounds[1:], strict=True):
        if g1 == g0:
            continue
        a, b = max(steps.start[idx[g0]], lo), min(steps.end[idx[g1 - 1]], hi)
        _seg(out, "queue_s", cursor, a)
        _seg(out, QUEUE_KINDS[codes[g0]], a, b)
        cursor = b
    _seg(out, "queue_s", cursor, hi)


def _leading(steps: StepIndex, window: list[int], seconds: float) -> int:
    """How many leading steps of `window` add up to `seconds` (at least one)."""
    used = 0.0
    for i, k in enumerate(window):
        if i > 0 and used >= seconds - EPS:
            return i
        used += steps.end[k] - steps.start[k]
    return len(window)


def _prefill_segments(out: list[Segment], chunks: list[Segment], steps: StepIndex,
                      prefill_s: float, lo: float, hi: float, preemptions: int) -> None:
    """[lo, hi) = first scheduled to first token (or finish)."""
    window = list(steps.overlapping(lo, hi))
    if not window:
        _seg(out, "prefill_s", lo, hi)
        return
    if preemptions > 0:  # prefilled, was preempted, recomputed until the first token
        lead = window[:_leading(steps, window, prefill_s)]
        rest: list[int] = window[len(lead):]
        tail: list[int] = []
    else:  # prefilled in the leading steps and the last one, skipped the ones between
        last_span = steps.end[window[-1]] - steps.start[window[-1]]
        lead = window[:min(_leading(steps, window, prefill_s - last_span), len(window) - 1)]
        rest, tail = window[len(lead):-1], window[-1:]
        if not lead:
            lead, tail = tail, []
    chunks.extend(_chunk(steps, k, lo, hi) for k in lead + tail)
    cut = min(steps.end[lead[-1]], hi)
    _seg(out, "prefill_s", lo, cut if rest else hi, chunks=len(lead) if rest else len(chunks))
    if rest and preemptions > 0:
        _seg(out, "preempted_s", cut, hi)
    elif rest:
        _seg(out, "skipped_s", cut, steps.start[tail[0]], steps=len(rest))
        _seg(out, "prefill_s", steps.start[tail[0]], hi, chunks=1)


def _chunk(steps: StepIndex, k: int, lo: float, hi: float) -> Segment:
    """Step `k` as a prefill chunk of a request, clipped to [lo, hi); args: the step's
    number (and replica, in a fleet) and its prefill tokens."""
    args: dict[str, object] = {"step": int(steps.step[k])}
    if steps.replica is not None:
        args["replica"] = steps.replica
    args["step_prefill_tokens"] = int(steps.prefill_tokens[k])
    return Segment("prefill_s", max(steps.start[k], lo), min(steps.end[k], hi), args)


def _long_gaps(steps: StepIndex, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gaps between consecutive tokens that span more than one step: (i, k) per gap, i the
    index of the token before it, k the step right after that token."""
    token_steps = np.searchsorted(steps.end, tokens - EPS, side="left")
    gaps = np.nonzero(np.diff(token_steps) > 1)[0]
    return gaps, token_steps[gaps] + 1


def _decode_segments(out: list[Segment], steps: StepIndex, tokens: np.ndarray,
                     preemptions: int) -> None:
    """Token to token: runs of one-step gaps are decode; longer gaps are a preemption or
    skipped steps (see the module docstring)."""
    run_start, run_first = float(tokens[0]), 0
    for i, k in zip(*_long_gaps(steps, tokens), strict=True):
        a, b = float(tokens[i]), float(tokens[i + 1])
        _seg(out, "decode_s", run_start, a, tokens=int(i - run_first))
        if preemptions > 0 and steps.preempted[k] > 0:
            preemptions -= 1
            _seg(out, "preempted_s", a, b)
            run_start, run_first = b, i + 1
        else:
            last = int(np.searchsorted(steps.end, b - EPS, side="left"))
            _seg(out, "skipped_s", a, steps.start[last], steps=int(last - k))
            run_start, run_first = float(steps.start[last]), i
    _seg(out, "decode_s", run_start, float(tokens[-1]), tokens=int(len(tokens) - 1 - run_first))


def _preemptions_in_gaps(steps: StepIndex, tokens: np.ndarray, total: int) -> int:
    """How many of `total` preemptions the decode gaps take (the rest are before the first
    token)."""
    _, first_steps = _long_gaps(steps, tokens)
    return min(total, int(np.count_nonzero(steps.preempted[first_steps] > 0)))


def request_timeline(row: pd.Series, steps: StepIndex, client_timed: bool = False,
                     prefill_steps: StepIndex | None = None) -> RequestTimeline:
    """The segments of one request (a row of requests.parquet), from the steps of the
    engine it ran on (a fleet's: its replica's). `prefill_steps`: the prefill replica's
    steps of a P/D request prefilled elsewhere (see the module docstring)."""
    arrival, finish = float(row["arrival_s"]), _num(row["finish_s"])
    finish = arrival if finish is None else finish
    tokens = np.asarray(row["token_times_s"], dtype=np.float64)
    out: list[Segment] = []
    chunks: list[Segment] = []
    if client_timed:
        first = _num(row["first_token_s"])
        _seg(out, "client_wait_s", arrival, first if first is not None else finish)
        _seg(out, "client_stream_s", first, finish, chunks=len(tokens))
        return RequestTimeline(str(row["request_id"]), arrival, finish, out, chunks)
    reached = arrival + (_num(row.get("routing_s")) or 0.0)
    _seg(out, "routing_s", arrival, reached)
    queued, entry = _num(row["queued_s"]), _num(row["engine_queued_s"])
    scheduled = _num(row["first_scheduled_s"])
    before = prefill_steps or steps  # the steps it waited and prefilled in
    side = {"replica": before.replica} if prefill_steps is not None else {}
    _seg(out, "api_server_s", reached, queued, **side)
    _seg(out, "step_boundary_s", queued, entry)
    if entry is not None:
        _queue_segments(out, before, entry, scheduled if scheduled is not None else finish)
    if scheduled is not None:
        preemptions = int(row["num_preemptions"])
        in_gaps = _preemptions_in_gaps(steps, tokens, preemptions) if tokens.size else 0
        if prefill_steps is not None and tokens.size:
            _disaggregated(out, chunks, row, prefill_steps, steps, preemptions - in_gaps)
        else:
            end_prefill = float(tokens[0]) if tokens.size else finish
            _prefill_segments(out, chunks, before, float(row["prefill_s"]), scheduled,
                              end_prefill, preemptions - in_gaps)
        if tokens.size:
            _decode_segments(out, steps, tokens, in_gaps)
            _seg(out, "skipped_s", float(tokens[-1]), finish)  # aborted after its last token
    return RequestTimeline(str(row["request_id"]), arrival, finish, out, chunks)


def _disaggregated(out: list[Segment], chunks: list[Segment], row: pd.Series,
                   prefill: StepIndex, decode: StepIndex, preemptions: int) -> None:
    """A P/D request from its first scheduled step on the prefill replica to its first
    token on the decode replica (see the module docstring)."""
    first = float(row["token_times_s"][0])
    k = int(np.searchsorted(decode.end, first - EPS, side="left"))
    sampled = float(decode.start[k]) if k < len(decode.start) else first
    queued, entry = float(row["queued_s"]), float(row["engine_queued_s"])
    reached = float(row["arrival_s"]) + (_num(row.get("routing_s")) or 0.0)
    decode_api = float(row["api_server_s"]) - (queued - reached)
    decode_boundary = float(row["step_boundary_s"]) - (entry - queued)
    admitted = sampled - float(row["decode_queue_s"])
    transferred = admitted - decode_boundary
    handed_over = transferred - float(row["kv_transfer_s"])
    prefilled = handed_over - decode_api
    _prefill_segments(out, chunks, prefill, float(row["prefill_s"]) - (first - sampled),
                      float(row["first_scheduled_s"]), prefilled, preemptions)
    _seg(out, "api_server_s", prefilled, handed_over, replica=int(row["replica"]))
    _seg(out, "kv_transfer_s", handed_over, transferred, bytes=int(row["kv_transfer_bytes"]),
         **{"from": int(row["prefill_replica"]), "to": int(row["replica"])})
    _seg(out, "step_boundary_s", transferred, admitted)
    _queue_segments(out, decode, admitted, sampled)
    _seg(out, "prefill_s", sampled, first, chunks=1)
    if k < len(decode.start):
        chunks.append(_chunk(decode, k, sampled, first))


def engine_timeline(row: pd.Series, steps: EngineSteps, client_timed: bool = False
                    ) -> RequestTimeline:
    """`request_timeline` of a row on its own replica's steps (P/D: prefill on the prefill
    replica's, decode on the decode replica's)."""
    decode, prefill = steps.sides(row)
    return request_timeline(row, decode, client_timed, prefill)


def request_timelines(requests: pd.DataFrame, steps: pd.DataFrame,
                      client_timed: bool = False) -> list[RequestTimeline]:
    """The timeline of every row, in the table's order, each on its own replica's steps."""
    index = EngineSteps(steps)
    return [engine_timeline(row, index, client_timed) for _, row in requests.iterrows()]


def coalesced(timeline: RequestTimeline, max_segments: int = 64,
              min_fraction: float = 0.01) -> list[Segment]:
    """The segments, bounded for display: when there are more than `max_segments`, each run
    of consecutive segments shorter than `min_fraction` of the request's E2E becomes one
    "mixed_s" segment (args: how many, the dominant kind, ms per label). An overloaded run's
    queue alternates causes step by step; this keeps a request to about 2 / min_fraction
    segments. The tiling of [arrival, finish) is kept."""
    segments = timeline.segments
    if len(segments) <= max_segments:
        return segments
    short = min_fraction * (timeline.finish_s - timeline.arrival_s)
    out: list[Segment] = []
    group: list[Segment] = []
    for seg in [*segments, None]:
        if seg is not None and seg.end_s - seg.start_s < short:
            group.append(seg)
            continue
        if len(group) == 1:
            out.append(group[0])
        elif group:
            out.append(_mixed(group))
        group = []
        if seg is not None:
            out.append(seg)
    return out


def _mixed(group: list[Segment]) -> Segment:
    seconds: dict[str, float] = {}
    for seg in group:
        seconds[seg.kind] = seconds.get(seg.kind, 0.0) + seg.end_s - seg.start_s
    dominant = max(seconds, key=lambda k: seconds[k])
    args: dict[str, object] = {"segments": len(group), "dominant": LABELS[dominant]}
    args.update({f"{LABELS[k]} ms": round(v * 1e3, 3) for k, v in seconds.items()})
    return Segment("mixed_s", group[0].start_s, group[-1].end_s, args)


def part_totals(timeline: RequestTimeline) -> dict[str, float]:
    """Seconds per attribution part (requests.parquet's column names) of the segments:
    compare with the recorded parts to see how well the inference did."""
    totals: dict[str, float] = {}
    for seg in timeline.segments:
        part = PART_OF.get(seg.kind, seg.kind)
        totals[part] = totals.get(part, 0.0) + seg.end_s - seg.start_s
    return totals
