"""A run as a Chrome trace-event file (JSON), which Perfetto and chrome://tracing open.

    pid 1 "engine"     tid 1: each step a complete span ("X") named by its batch
                       (e.g. "P 512 + D 31"), args = its StepRecord columns; counters ("C")
                       "requests" (running, waiting) and "KV cache usage (%)", one event per
                       change
    pid 100 + r        a fleet run's replica r instead of "engine": the same track and
                       counters from its own steps, named "replica r" (with its pool and
                       role when the fleet has pools)
    pid 2 "requests"   one track (tid) per request, in arrival order: a span for the whole
                       request (args: lengths, TTFT, E2EL, status; a fleet's replica and
                       routing, P/D's prefill replica and KV transfer) holding its segments
                       (`analysis.timelines`: routing, API server, step boundary, each queue
                       wait by cause, prefill with its chunks nested inside, KV transfer,
                       decode, skipped steps, preemption + recompute), each from the steps of
                       the replica it happened on (args of a chunk: its step and replica)

Timestamps are microseconds on the run's clock (`ts`, `dur`; rounded to 1 ns, a child's
end never past its parent's). Bounding a large run:
    window=(lo, hi)  keep the steps overlapping [lo, hi) s and the requests alive in it
    requests=N       keep N request tracks: the slowest tenth of N by E2E latency (so the
                     slow ones are always there), the rest evenly spread in arrival order
    max_steps=M      more steps than M left (a fleet's, all replicas together): runs of
                     identical decode-only steps (same sequences, back to back, on one
                     engine) become one span "D n x k" (args: steps k)
    max_segments=S   a request with more than S segments (an overloaded run's queue
                     alternates causes step by step) has each run of segments shorter than
                     1% of its E2E shown as one span (`timelines.coalesced`; args: ms per
                     kind)
What was kept is written under `otherData`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.engine_steps import EngineSteps
from analysis.fleet import replica_names
from analysis.rundir import Run
from analysis.timelines import RequestTimeline, coalesced, engine_timeline

ENGINE_PID, REQUESTS_PID = 1, 2
REPLICA_PID = 100  # + replica index, in a fleet run
DEFAULT_MAX_STEPS = 100_000
DEFAULT_MAX_SEGMENTS = 64
STEP_ARGS = ("step", "num_prefill_tokens", "num_decode_tokens", "num_seqs", "num_prefill_seqs",
             "context_tokens", "kv_usage", "num_running", "num_waiting", "num_preempted",
             "num_finished", "wait_reason", "duration_s")


def _us(seconds: float) -> float:
    return round(float(seconds) * 1e6, 3)


def _span(name: str, cat: str, start_s: float, end_s: float, pid: int, tid: int,
          args: dict[str, Any] | None = None) -> dict[str, Any]:
    ts = _us(start_s)
    event = {"name": name, "cat": cat, "ph": "X", "ts": ts,
             "dur": round(_us(end_s) - ts, 3), "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    return event


def _meta(name: str, pid: int, tid: int, value: object) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _plain(value: object) -> object:
    """A JSON value: numpy scalars to Python, NaN to None, floats to 6 significant digits."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return None if math.isnan(value) else float(f"{value:.6g}")
    return value


# ---- selection ---------------------------------------------------------------------------


def select_requests(requests: pd.DataFrame, count: int | None,
                    window: tuple[float, float] | None = None) -> pd.DataFrame:
    """The requests the file keeps, in arrival order (see the module docstring)."""
    chosen = requests.sort_values("arrival_s", kind="stable")
    if window is not None:
        lo, hi = window
        finish = chosen["finish_s"].fillna(chosen["arrival_s"])
        chosen = chosen[(chosen["arrival_s"] < hi) & (finish >= lo)]
    if count is None or len(chosen) <= count:
        return chosen
    e2el = chosen["finish_s"].fillna(chosen["arrival_s"]) - chosen["arrival_s"]
    slow = set(e2el.sort_values(ascending=False, kind="stable").index[:max(1, count // 10)])
    rest = [i for i in chosen.index if i not in slow]
    spread = np.linspace(0, len(rest) - 1, count - len(slow)).round().astype(int)
    keep = slow | {rest[i] for i in spread}
    return chosen[chosen.index.isin(keep)]


def select_steps(steps: pd.DataFrame, window: tuple[float, float] | None) -> pd.DataFrame:
    if window is None or steps.empty:
        return steps
    lo, hi = window
    return steps[(steps["end_s"] > lo) & (steps["start_s"] < hi)]


# ---- engine track ------------------------------------------------------------------------


def _step_name(prefill: int, decode: int) -> str:
    if prefill and decode:
        return f"P {prefill} + D {decode}"
    return f"P {prefill}" if prefill else f"D {decode}"


def _decode_runs(steps: pd.DataFrame) -> np.ndarray:
    """Run id per step: consecutive decode-only steps with equal num_seqs, back to back."""
    decode = (steps["num_prefill_tokens"].to_numpy() == 0)
    seqs = steps["num_seqs"].to_numpy()
    joined = steps["start_s"].to_numpy()[1:] == steps["end_s"].to_numpy()[:-1]
    same = decode[1:] & decode[:-1] & (seqs[1:] == seqs[:-1]) & joined
    return np.cumsum(np.r_[True, ~same])


def engine_events(steps: pd.DataFrame, max_steps: int | None = DEFAULT_MAX_STEPS,
                  pid: int = ENGINE_PID, name: str = "engine", sort_index: int = 0
                  ) -> tuple[list[dict[str, Any]], int]:
    """One engine's step spans and counters, as process `pid`; also the number of step
    spans after merging."""
    events = [_meta("process_name", pid, 0, name),
              _meta("process_sort_index", pid, 0, sort_index),
              _meta("thread_name", pid, 1, "steps")]
    if steps.empty:
        return events, 0
    rows = steps[[c for c in STEP_ARGS if c in steps.columns] + ["start_s", "end_s"]]
    records = rows.to_dict("records")
    merge = max_steps is not None and len(steps) > max_steps
    groups = (pd.Series(range(len(records))).groupby(_decode_runs(steps)).agg(["first", "last"])
              .itertuples(index=False) if merge else ((i, i) for i in range(len(records))))
    spans = 0
    for first, last in groups:
        head, tail = records[first], records[last]
        args = {k: _plain(head[k]) for k in STEP_ARGS if k in head and pd.notna(head[k])}
        label = _step_name(int(head["num_prefill_tokens"]), int(head["num_decode_tokens"]))
        if last > first:
            args.update(steps=last - first + 1, last_step=_plain(tail["step"]),
                        kv_usage_end=_plain(tail["kv_usage"]))
            label = f"{label} x {last - first + 1}"
        events.append(_span(label, "step", head["start_s"], tail["end_s"], pid, 1, args))
        spans += 1
    events += _counters(steps, pid)
    return events, spans


def fleet_engine_events(steps: pd.DataFrame, info: dict[str, Any],
                        max_steps: int | None = DEFAULT_MAX_STEPS
                        ) -> tuple[list[dict[str, Any]], int]:
    """A process per replica (`REPLICA_PID` + r), each `engine_events` of its own steps;
    the decode-run merging applies to every replica when the fleet has more steps than
    `max_steps`."""
    fleet = info.get("fleet")
    if not isinstance(fleet, dict):
        fleet = {}
    count = int(fleet.get("replicas") or 0)
    if not steps.empty:
        count = max(count, int(steps["replica"].max()) + 1)
    merge = max_steps is not None and len(steps) > max_steps
    events: list[dict[str, Any]] = []
    spans = 0
    by_replica = dict(iter(steps.groupby("replica", sort=True))) if len(steps) else {}
    for r, name in enumerate(replica_names(info, count)):
        mine = by_replica.get(r, steps.iloc[:0]).sort_values("start_s", kind="stable")
        more, n = engine_events(mine, 0 if merge else None, REPLICA_PID + r, name, r)
        events += more
        spans += n
    return events, spans
def _counters(steps: pd.DataFrame, pid: int = ENGINE_PID) -> list[dict[str, Any]]:
    """Counter events at each step's end, only where a value changed."""
    out: list[dict[str, Any]] = []
    last: dict[str, tuple[object, ...]] = {}
    columns = zip(steps["end_s"], steps["num_running"], steps["num_waiting"],
                  steps["kv_usage"], strict=True)
    for end, running, waiting, kv in columns:
        values: dict[str, dict[str, float]] = {
            "requests": {"running": int(running), "waiting": int(waiting)},
            "KV cache usage (%)": {"kv": round(float(kv) * 100, 1)}}
        for name, args in values.items():
            key = tuple(args.values())
            if last.get(name) != key:
                last[name] = key
                out.append({"name": name, "ph": "C", "ts": _us(end), "pid": pid,
                            "tid": 0, "args": args})
    return out


# ---- request tracks ----------------------------------------------------------------------


FLEET_ARGS = ("replica", "prefill_replica", "kv_transfer_bytes")  # where the run has them


def _request_args(row: pd.Series) -> dict[str, Any]:
    first, finish, arrival = row["first_token_s"], row["finish_s"], row["arrival_s"]
    ttft = (first - arrival) * 1e3 if pd.notna(first) else None
    e2el = (finish - arrival) * 1e3 if pd.notna(finish) else None
    args = {k: _plain(row[k]) for k in ("prompt_len", "output_len", "cached_tokens",
                                        "num_preemptions", "status")}
    args.update(ttft_ms=_plain(ttft), e2el_ms=_plain(e2el))
    args.update({k: _plain(row[k]) for k in FLEET_ARGS if k in row.index})
    args.update({k.removesuffix("_s") + "_ms": _plain(row[k] * 1e3)
                 for k in ("routing_s", "kv_transfer_s") if k in row.index})
    return args


def request_events(timeline: RequestTimeline, row: pd.Series, tid: int,
                   max_segments: int | None = DEFAULT_MAX_SEGMENTS) -> list[dict[str, Any]]:
    """Metadata, the whole-request span, its segments and prefill chunks, on track `tid`."""
    rid = timeline.request_id
    spans = [_span(f"request {rid}", "request", timeline.arrival_s, timeline.finish_s,
                   REQUESTS_PID, tid, _request_args(row))]
    segments = timeline.segments if max_segments is None else \
        coalesced(timeline, max_segments)
    for seg in segments:
        args = {k: _plain(v) for k, v in seg.args.items()}
        name = seg.label if seg.kind != "mixed_s" else \
            f"{seg.args['segments']} short segments, mostly {seg.args['dominant']}"
        spans.append(_span(name, seg.kind.removesuffix("_s"), seg.start_s, seg.end_s,
                           REQUESTS_PID, tid, args))
    for n, chunk in enumerate(timeline.chunks):
        args = {k: _plain(v) for k, v in chunk.args.items()}
        spans.append(_span(f"chunk {n}", "prefill_chunk", chunk.start_s, chunk.end_s,
                           REQUESTS_PID, tid, args))
    spans.sort(key=lambda e: (e["ts"], -e["dur"]))  # parents first, ts monotonic
    return [_meta("thread_name", REQUESTS_PID, tid, f"req {rid}"),
            _meta("thread_sort_index", REQUESTS_PID, tid, tid), *spans]


def trace_events(run: Run, requests: int | None = None,
                 window: tuple[float, float] | None = None,
                 max_steps: int | None = DEFAULT_MAX_STEPS,
                 max_segments: int | None = DEFAULT_MAX_SEGMENTS) -> dict[str, Any]:
    """The trace-event document of a run (see the module docstring)."""
    client = run.info.get("timing") == "client"
    kept = select_requests(run.requests, requests, window)
    steps = run.steps.reset_index(drop=True)
    index = EngineSteps(steps)
    shown = select_steps(steps, window)
    if index.fleet:
        events, spans = fleet_engine_events(shown, run.info, max_steps)
    else:
        events, spans = engine_events(shown, max_steps)
    events += [_meta("process_name", REQUESTS_PID, 0, "requests"),
               _meta("process_sort_index", REQUESTS_PID, 0, 1 + len(index.replicas))]
    for tid, (_, row) in enumerate(kept.iterrows(), start=1):
        events += request_events(engine_timeline(row, index, client), row, tid, max_segments)
    other = {"run": run.name, "kind": run.info.get("kind"),
             "requests": f"{len(kept)} of {len(run.requests)}",
             "steps": f"{spans} spans for {len(shown)} of {len(steps)} steps",
             "window_s": list(window) if window else None,
             "timing": run.info.get("timing", "engine"),
             "selection": "slowest tenth by E2E + evenly spread" if requests else "all"}
    if index.fleet:
        other["replicas"] = len(index.replicas)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_trace_events(run: Run, out_path: Path, requests: int | None = None,
                       window: tuple[float, float] | None = None,
                       max_steps: int | None = DEFAULT_MAX_STEPS,
                       max_segments: int | None = DEFAULT_MAX_SEGMENTS) -> Path:
    """Write `trace_events(run, ...)` as compact JSON to `out_path`; returns the path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    document = trace_events(run, requests, window, max_steps, max_segments)
    out_path.write_text(json.dumps(document, separators=(",", ":"), allow_nan=False))
    return out_path
