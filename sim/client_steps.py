"""The engine steps of a client-timed run, reconstructed from the chunk times alone.

A streaming server sends every running request one chunk per engine step, right after the
step: the chunk times of all streams cluster at the step ends. Sorted, the chunk times split
into clusters where the gap to the previous chunk exceeds `CLUSTER_FRACTION` of the median
inter-chunk gap of a stream (a cluster also closes when a stream would get a second chunk in
it, and two clusters are one when a slow reader split them: `_merge_split`); each cluster is a
step, ending at its median chunk time. A chunk k >= 1 is a decode of
that step (context prompt + k); a first chunk ends the request's prefill, whose uncached
prompt tokens are put in that step and, with chunked prefill, in the steps before it as
vLLM's token budget (`max_num_batched_tokens`, less the step's decodes and earlier prefills)
leaves room, never before the request was sent. A step's duration is observed when the
engine was busy through it: some stream has chunks in both it and the step before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from runtime import SchedulerConfig
from sim.calibrate import COEFFICIENT_NAMES
from workloads import Trace, TraceRequest

CLUSTER_FRACTION = 0.3
REQUIRED_COLUMNS = ("request_id", "arrival_s", "prompt_len", "output_len", "status",
                    "token_times_s")


@dataclass(frozen=True, slots=True)
class ClientRun:
    """One client-timed run: the requests as sent (`arrival_s`: when the POST was sent,
    seconds from the run's start; `output_len`: the tokens the server returned), each
    request's chunk times on the same clock (first chunk first) and cached prompt tokens."""

    name: str
    trace: Trace
    token_times_s: Mapping[str, tuple[float, ...]]
    cached_tokens: Mapping[str, int]
    skipped: int = 0  # requests left out (failed, or no chunk time)


def client_run(name: str, columns: Mapping[str, Sequence[Any]],
               trace: Trace | None = None) -> ClientRun:
    """A `ClientRun` from a run's requests table (`rt replay --endpoint`'s requests.parquet,
    a vLLM bench JSON read as a run, any run directory); `trace` (when the replayed trace is
    at hand) keeps its token ids and prefix sharing, else each request is rebuilt from its
    lengths. ValueError naming the run and why it cannot be used."""
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise ValueError(f"{name}: no {', '.join(missing)} column(s): calibrating from client "
                         "timings needs each request's arrival, lengths and chunk times")
    by_id = {req.request_id: req for req in trace} if trace is not None else {}
    cached_column = columns.get("cached_tokens")
    requests, times, cached, skipped = [], {}, {}, 0
    for i in range(len(columns["request_id"])):
        rid, chunks = str(columns["request_id"][i]), columns["token_times_s"][i]
        chunks = tuple(float(t) for t in (chunks if chunks is not None else ()))
        ok = (columns["status"][i] != "FINISHED_ABORTED" and len(chunks) > 0
              and all(math.isfinite(t) for t in chunks) and int(columns["output_len"][i]) > 0)
        if not ok:
            skipped += 1
            continue
        base = by_id.get(rid) or TraceRequest(rid, 0.0, int(columns["prompt_len"][i]), 1)
        requests.append(replace(base, arrival_s=float(columns["arrival_s"][i]),
                                output_len=int(columns["output_len"][i])))
        times[rid] = chunks
        cached[rid] = int(cached_column[i] or 0) if cached_column is not None else 0
    if not requests:
        raise ValueError(f"{name}: no request has per-request token times (token_times_s "
                         "empty or every request failed): calibrating from client timings "
                         "needs each request's chunk times (`rt replay --endpoint` records "
                         "them; `vllm bench serve` only with --save-detailed)")
    requests.sort(key=lambda r: r.arrival_s)
    return ClientRun(name, Trace(tuple(requests), name), times, cached, skipped)


@dataclass(frozen=True, slots=True)
class ObservedSteps:
    """The reconstructed steps of one run, in order.

    Attributes:
        end_s: [M] each step's end (its chunks' median time), seconds.
        features: [M, 6] each step's features in `COEFFICIENT_NAMES` order.
        sampled: [M] chunks (tokens) the step delivered.
        decodes: [M] the step's decode chunks (ITL gaps it ends).
        busy: [M] the engine ran the step back to back after the previous one (its duration
            end_s[m] - end_s[m - 1] is observed).
        first_step: request id -> the step of its first chunk.
        split_streams: streams whose consecutive chunks landed in non-adjacent steps (a
            cluster split by jitter, or a preemption), a diagnostic.
    """

    end_s: np.ndarray
    features: np.ndarray
    sampled: np.ndarray
    decodes: np.ndarray
    busy: np.ndarray
    first_step: dict[str, int]
    split_streams: int


Event = tuple[float, str, int]  # (chunk time s, request id, chunk index)


def _clusters(run: ClientRun) -> list[list[Event]]:
    events = sorted((t, rid, k) for rid, times in run.token_times_s.items()
                    for k, t in enumerate(times))
    gaps = [b - a for times in run.token_times_s.values()
            for a, b in zip(times, times[1:], strict=False)]
    tau = CLUSTER_FRACTION * float(np.median(gaps)) if gaps else math.inf
    clusters: list[list[Event]] = []
    members: set[str] = set()
    last = -math.inf
    for event in events:
        if not clusters or event[0] - last > tau or event[1] in members:
            clusters.append([])
            members = set()
        clusters[-1].append(event)
        members.add(event[1])
        last = event[0]
    return _merge_split(clusters, {rid: len(times) for rid, times in run.token_times_s.items()})


def _merge_split(clusters: list[list[Event]], chunks: Mapping[str, int]) -> list[list[Event]]:
    """Join a cluster to the one before it when their streams are disjoint although a
    stream of the earlier one has a later chunk: a running stream gets a chunk every step,
    so the two are one step whose chunks a slow reader read with a gap (on a loaded 2-core
    VM, 800-1,200 of ~6,000 chunk pairs against vLLM and rt serve)."""
    out: list[list[Event]] = []
    for cluster in clusters:
        if out:
            before = {rid: k for _, rid, k in out[-1]}
            continues = any(k + 1 < chunks[rid] for rid, k in before.items())
            if continues and before.keys().isdisjoint(rid for _, rid, _ in cluster):
                out[-1] = out[-1] + cluster
                continue
        out.append(cluster)
    return out


def _first_possible(m: int, busy: np.ndarray, ends: np.ndarray, arrival_s: float) -> bool:
    """Whether a request sent at `arrival_s` cannot have been in the step before m: the
    engine was idle before m, or that step started (at ends[m - 2]) before it was sent."""
    return m == 0 or not busy[m] or (m >= 2 and ends[m - 2] <= arrival_s)


def observed_steps(run: ClientRun, scheduler: SchedulerConfig) -> ObservedSteps:
    """The steps of `run` (see the module docstring)."""
    clusters = _clusters(run)
    count = len(clusters)
    ends = np.asarray([float(np.median([e[0] for e in c])) for c in clusters])
    feats = np.zeros((count, len(COEFFICIENT_NAMES)))
    col = {name: j for j, name in enumerate(COEFFICIENT_NAMES)}
    step_of: dict[tuple[str, int], int] = {}
    for m, cluster in enumerate(clusters):
        for _, rid, k in cluster:
            step_of[(rid, k)] = m
    prompts = {r.request_id: r for r in run.trace}
    decodes = np.zeros(count)
    used = np.zeros(count)  # budget used: decodes, then prefill chunks
    for (rid, k), m in step_of.items():
        if k >= 1:
            decodes[m] += 1
            feats[m, col["per_decode_kv_token_s"]] += prompts[rid].prompt_len + k
    used += decodes
    feats[:, col["per_decode_token_s"]] = decodes
    feats[:, col["per_seq_s"]] = decodes
    busy = np.zeros(count, dtype=bool)
    split = 0
    for rid, times in run.token_times_s.items():
        for k in range(1, len(times)):
            m0, m1 = step_of[(rid, k - 1)], step_of[(rid, k)]
            if m1 == m0 + 1:
                busy[m1] = True
            else:
                split += 1
    first = {rid: step_of[(rid, 0)] for rid in run.token_times_s}
    budget = scheduler.max_num_batched_tokens if scheduler.enable_chunked_prefill else math.inf
    for req in sorted(run.trace, key=lambda r: (first[r.request_id], r.arrival_s)):
        rid = req.request_id
        need = max(req.prompt_len - run.cached_tokens.get(rid, 0), 1)
        m = first[rid]
        need -= max(budget - used[m], 0)
        while need > 0 and not _first_possible(m, busy, ends, req.arrival_s):
            m -= 1  # the prefill spans the steps before its first chunk too
            need -= max(budget - used[m], 0)
        need = max(req.prompt_len - run.cached_tokens.get(rid, 0), 1)
        context = req.prompt_len - need  # cached
        for step in range(m, first[rid] + 1):  # FCFS: each step takes what budget it has
            take = need if step == first[rid] else int(min(need, max(budget - used[step], 0)))
            if take <= 0:
                continue
            used[step] += take
            feats[step, col["per_prefill_token_s"]] += take
            feats[step, col["per_seq_s"]] += 1
            feats[step, col["per_prefill_attention_pair_s"]] += (take * context
                                                                 + take * (take + 1) // 2)
            context += take
            need -= take
    feats[:, col["constant_s"]] = 1.0
    sampled = np.asarray([len(c) for c in clusters], dtype=np.float64)
    return ObservedSteps(ends, feats, sampled, decodes, busy, first, split)
