"""Accounting of where each request's time went, from the engine loop's events.

The recorder never visits every request every step. Two running totals do the work:
    S           Σ of all step intervals so far (seconds)
    Q[reason]   Σ of the intervals of steps whose waiting-queue head waited for `reason`
A waiting request snapshots Q when it starts waiting and takes the difference when it is
admitted. A running request's time is kept as *runs*: maximal stretches of consecutive steps
in which it was scheduled with one kind of work ("prefill", "decode", "preempted"); a run
adds `S_end - S_start` to its part when it closes, and a gap between runs (steps in which
it ran but was not scheduled: the budget ran out before its turn) goes to token_budget.
Work is O(1) per request event plus O(scheduled requests) per stepped step, and O(running
requests) per fast-forwarded run of decode steps. Both paths perform the same float
operations in the same order, so they give identical records.
"""

from __future__ import annotations

from array import array
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass
from functools import reduce
from operator import add, sub
from typing import Any, cast

from runtime.batch import BatchFeatures
from runtime.outputs import WaitReason
from runtime.records import (
    PART_COLUMNS,
    QUEUE_COLUMNS,
    WAIT_REASONS,
    RequestRecord,
    StepRecord,
    StepTimes,
    new_step_columns,
    steps_from_columns,
)
from runtime.request import Request, RequestStatus, finish_reason
from runtime.step_columns import extend_decode_run


@dataclass(slots=True)
class _Live:
    """Accounting state of a request while the engine holds it."""

    record: RequestRecord
    times: StepTimes  # record.token_times_s, typed: its token times as step runs
    wait_snapshot: list[float] | None = None  # Q when it started waiting (not preempted)
    preempted_at: float | None = None  # interval start of the step that preempted it
    kind: str | None = None  # kind of its open run; None while not running
    run_start: float = 0.0  # S when the open run started
    run_end: float = 0.0  # S at the end of the last step it was scheduled in


def _add(record: RequestRecord, column: str, seconds: float) -> None:
    setattr(record, column, getattr(record, column) + seconds)


class Recorder:
    """Builds request and step records. Per stepped step the engine loop calls
    `step_started` then `step_finished`; a fast-forwarded run calls `decode_steps` (and, for
    its last step when steady decodes finish in it, `step_started` then `step_finished`)."""

    def __init__(self, step_columns: dict[str, MutableSequence[object]] | None = None) -> None:
        """`step_columns`: columns (`new_step_columns`) to append this recorder's steps to,
        after the rows already there (recorders that run one after another can share one
        set: a pre-routed fleet's replicas, `sim.fleet_replica`); by default its own."""
        self.live: dict[str, _Live] = {}
        self.finished: list[RequestRecord] = []
        # Steps as columns, in StepRecord's field order: a run of decode steps extends them.
        self.step_columns = new_step_columns() if step_columns is None else step_columns
        self._columns = list(self.step_columns.values())
        # Rows of the columns before this recorder's first step (`follow`): its step k is
        # row first_row + k. Token times and steady decodes hold rows (`StepTimes` indexes
        # the whole column).
        self.first_row = len(self._columns[0])
        self.num_steps = 0  # steps recorded so far (this recorder's)
        *typed, reasons = self._columns  # StepRecord's fields: wait_reason, a list, is last
        assert isinstance(reasons, list) and all(isinstance(c, array) for c in typed)
        self._typed_columns = cast("list[array[Any]]", typed)
        self._reasons = cast(list[str | None], reasons)
        self._ends = cast(Sequence[float], self.step_columns["end_s"])  # array("d")
        self._span_total = 0.0  # S
        self._span_total_before_step = 0.0  # S at the start of the step being closed
        self._queue_totals = [0.0] * len(WAIT_REASONS)  # Q
        self._interval_start = 0.0  # t_k of the open step
        self._last_end: float | None = None  # e_{k-1} while the engine stays busy
        self._last_reason: WaitReason | None = None
        # Requests taken in after their step's interval began (the host gap between steps):
        # the part of the interval before they were handed over is not theirs.
        self._credits: list[tuple[_Live, float]] = []
        # Steady decodes (`runtime.steady`): request id -> the row of the first step whose end
        # is not yet in its token times. Such a request is scheduled as a decode in every step
        # from then on, so its open decode run goes on and each step's end is one of its tokens;
        # both are written into its record only when it leaves (`steady_leave`).
        self._steady_since: dict[str, int] = {}

    @property
    def steps(self) -> list[StepRecord]:
        """Every step of this recorder so far, in order (built from the columns: slow, for
        tests)."""
        rows = slice(self.first_row, self.first_row + self.num_steps)
        return steps_from_columns({name: column[rows]
                                   for name, column in self.step_columns.items()})

    def follow(self) -> None:
        """Number this recorder's rows from the end of its columns as they are now: the
        recorders sharing them before it have recorded all their steps. Before its first
        step."""
        assert not self.num_steps, "follow() after a step"
        self.first_row = len(self._columns[0])

    def forget_steps(self) -> None:
        """Clear the step columns and number the next step 0, as a new recorder would (a
        server that keeps no records, `rt serve`). Live requests' token-time spans and
        steady decodes' step indices then point at cleared rows: never read again."""
        for column in self._columns:
            del column[:]  # typed arrays have no clear()
        self.first_row = self.num_steps = 0

    # ---- request events --------------------------------------------------------------------

    def arrived(self, request_id: str, arrival_s: float, prompt_len: int, max_tokens: int,
                record_type: type[RequestRecord] = RequestRecord) -> RequestRecord:
        """The request reached the API server at `arrival_s`: its record (of `record_type`,
        a subclass for a driver's own columns, e.g. a fleet's), filled in as it runs."""
        record = record_type(request_id, arrival_s, prompt_len, max_tokens)
        record.token_times_s = times = StepTimes(self._ends)
        self.live[request_id] = _Live(record, times)
        return record

    def queued(self, request_id: str, now: float) -> None:
        """Handed from the API server to the engine's input queue."""
        record = self.live[request_id].record
        record.queued_s = now
        record.api_server_s = now - record.arrival_s

    def ignored(self, request: Request) -> None:
        """A request the scheduler refused when it was taken in: it finishes on entry."""
        entry = self.live[request.request_id].record.engine_queued_s
        assert entry is not None, request.request_id
        self._finish(request, entry)

    def aborted(self, request: Request, now: float) -> None:
        """A request aborted between steps (`Scheduler.finish_requests`)."""
        self._finish(request, now)

    # ---- stepped steps ---------------------------------------------------------------------

    def _step_start(self, now: float) -> float:
        """t_k of a step begun at `now`: the previous step's end while the engine is busy."""
        return self._last_end if self._last_end is not None else now

    def take_in(self, now: float, taken_in: list[Request]) -> None:
        """The engine core added these requests to the scheduler at a step boundary."""
        t = self._step_start(now)
        for request in taken_in:
            self._take_in(self.live[request.request_id], t, request.is_finished())

    def step_started(self, now: float, admitted: list[Request],
                     preempted: list[Request]) -> float:
        """Open step k, begun at `now`; returns its interval start t_k."""
        t = self._step_start(now)
        self._interval_start = t
        for request in preempted:
            live = self.live[request.request_id]
            self._close_run(live, self._span_total)
            live.preempted_at = t
        for request in admitted:
            self._admit(self.live[request.request_id], request, t)
        return t

    def _take_in(self, live: _Live, t: float, ignored: bool) -> None:
        record = live.record
        queued = record.queued_s if record.queued_s is not None else t
        entry = max(t, queued)
        record.engine_queued_s = entry
        record.step_boundary_s = entry - queued
        live.wait_snapshot = list(self._queue_totals)
        if entry > t and not ignored:
            self._credits.append((live, entry - t))

    def _admit(self, live: _Live, request: Request, t: float) -> None:
        record = live.record
        if live.preempted_at is not None:
            record.preempted_s += t - live.preempted_at
            live.preempted_at = None
        elif live.wait_snapshot is not None:
            self._add_queue_time(live)
        if record.first_scheduled_s is None:
            record.first_scheduled_s = t
            record.cached_tokens = request.num_cached_tokens or 0
        live.run_end = self._span_total  # admitted: scheduled from this step on, no gap

    def _add_queue_time(self, live: _Live) -> None:
        assert live.wait_snapshot is not None
        for reason, total, before in zip(WAIT_REASONS, self._queue_totals, live.wait_snapshot,
                                         strict=True):
            if total != before:
                _add(live.record, QUEUE_COLUMNS[reason], total - before)
        live.wait_snapshot = None

    def _schedule(self, live: _Live, kind: str, span_end: float) -> None:
        """`live` is scheduled with `kind` of work in the step ending at S = span_end."""
        step_start = self._span_total_before_step
        if live.kind is not None and (live.kind != kind or live.run_end != step_start):
            self._close_run(live, step_start)
        if live.kind is None:
            gap = step_start - live.run_end
            if gap > 1e-12:  # below that it is float rounding of equal sums
                live.record.queue_token_budget_s += gap
            live.kind = kind
            live.run_start = step_start
        live.run_end = span_end

    def _close_run(self, live: _Live, now_total: float) -> None:
        """Close the open run; steps after it up to `now_total` were unscheduled."""
        if live.kind is None:
            return
        _add(live.record, live.kind + "_s", live.run_end - live.run_start)
        gap = now_total - live.run_end
        if gap > 1e-12:
            live.record.queue_token_budget_s += gap
        live.kind = None
        live.run_end = now_total

    def step_finished(
        self,
        end: float,
        duration_s: float,
        features: BatchFeatures,
        kinds: dict[str, str],
        token_owners: list[str],
        finished: list[Request],
        stats: tuple[float, int, int, int, WaitReason | None],
    ) -> None:
        """Close step k at `end`.

        Args:
            duration_s: its execution time (the cost model's, or measured).
            kinds: scheduled request id -> "prefill", "decode" or "preempted".
            token_owners: requests that received a token this step.
            finished: requests that finished this step.
            stats: (kv_usage, num_running, num_waiting, num_preempted, wait_reason); the
                first three at the end of the step.
        """
        t = self._interval_start
        span = end - t
        self._span_total_before_step = self._span_total
        self._span_total += span
        for req_id, kind in kinds.items():
            self._schedule(self.live[req_id], kind, self._span_total)
        step = len(self._columns[0])  # this step's row, appended below
        for req_id in token_owners:
            live = self.live[req_id]
            if live.record.first_token_s is None:
                live.record.first_token_s = end
            live.times.add_steps(step, step + 1)
        kv_usage, num_running, num_waiting, num_preempted, wait_reason = stats
        if wait_reason is not None:
            self._queue_totals[WAIT_REASONS.index(wait_reason)] += span
        self._settle_credits(wait_reason)
        for request in finished:
            if request.request_id in self._steady_since:  # it decoded in this step too
                self.steady_leave(request.request_id)
                self.live[request.request_id].times.add_steps(step, step + 1)
            self._finish(request, end)
        self._last_end = end if (num_running or num_waiting) else None
        self._last_reason = wait_reason
        row = (
            self.num_steps, t, end, duration_s, features.num_prefill_tokens,
            features.num_decode_tokens, features.num_seqs, features.num_prefill_seqs,
            features.prefill_attention_pairs, features.prefill_kv_tokens,
            features.decode_kv_tokens, features.kv_tokens_read, kv_usage, num_running,
            num_waiting, num_preempted, len(finished),
            wait_reason.value if wait_reason is not None else None,
        )
        for column, value in zip(self._columns, row, strict=True):
            column.append(value)
        self.num_steps += 1

    def _settle_credits(self, wait_reason: WaitReason | None) -> None:
        """Take the pre-hand-over part of this step's interval back from where it went."""
        for live, credit in self._credits:
            if live.kind is not None:  # admitted this step: its run starts later
                live.run_start += credit
            elif live.wait_snapshot is not None and wait_reason is not None:
                _add(live.record, QUEUE_COLUMNS[wait_reason], -credit)
        self._credits.clear()

    # ---- steady decodes ------------------------------------------------------------------

    def scheduled_in_last_step(self, request_id: str) -> bool:
        """The request's open run (any kind) is one that the last step extended."""
        live = self.live[request_id]
        return live.kind is not None and live.run_end == self._span_total

    def steady_enter(self, request_id: str) -> None:
        """From the next step on, `request_id` decodes in every step until it leaves: its
        decode run and token times are kept implicitly. It must have been scheduled in the
        last step (`scheduled_in_last_step`); an open run of another kind (its prefill, or
        its recompute after a preemption, just completed) closes now, as `_schedule` would
        close it at the next step: that step starts at S = now, so no gap."""
        live = self.live[request_id]
        assert live.kind is not None and live.run_end == self._span_total, request_id
        if live.kind != "decode":
            self._close_run(live, self._span_total)
            live.kind = "decode"
            live.run_start = self._span_total
        self._steady_since[request_id] = len(self._columns[0])  # the next step's row

    def steady_leave(self, request_id: str) -> None:
        """Write the steps since `steady_enter` into the request's record, as stepping would
        have: their ends are its token times, and its decode run extends to now."""
        live = self.live[request_id]
        since = self._steady_since.pop(request_id)
        live.times.add_steps(since, len(self._columns[0]))
        live.run_end = self._span_total

    # ---- fast-forwarded decode runs ------------------------------------------------------

    def decode_steps(self, ends: list[float], durations: list[float], num_seqs: int,
                     decode_kv_tokens: int, request_ids: list[str],
                     kv_usages: list[float], num_waiting: int,
                     wait_reason: WaitReason | None) -> None:
        """Record a run of plain decode steps (`runtime.decode_run`) in which every running
        request decodes: the same float operations, in the same order, as stepping. Step k
        of the run decodes `num_seqs` sequences reading `decode_kv_tokens + k * num_seqs`
        KV tokens. `request_ids` are the running requests that are not steady decodes
        (those need nothing: their decode run and token times are implicit)."""
        assert self._last_end is not None, "a decode run follows a busy step"
        starts = [self._last_end, *ends[:-1]]
        spans = list(map(sub, ends, starts))
        first_step_total = self._span_total
        # the same additions, in the same order, as stepping: ((S + span_0) + span_1) ...
        self._span_total = total = reduce(add, spans, first_step_total)
        if wait_reason is not None:
            index = WAIT_REASONS.index(wait_reason)
            self._queue_totals[index] = reduce(add, spans, self._queue_totals[index])
        self._last_end = ends[-1]
        count = len(ends)
        first_row = len(self._columns[0])
        extend_decode_run(self._typed_columns, self._reasons, self.num_steps, starts, ends,
                          durations, num_seqs, decode_kv_tokens, kv_usages, num_waiting,
                          None if wait_reason is None else wait_reason.value)
        self.num_steps += count
        # One `_schedule` per request does what the steps one by one would: open (or keep)
        # a decode run at the first step, extend it to the last.
        self._span_total_before_step = first_step_total
        live_requests = self.live
        for req_id in request_ids:
            live = live_requests[req_id]
            if live.kind == "decode" and live.run_end == first_step_total:
                live.run_end = total  # its open decode run goes on: `_schedule`'s no-op case
            else:
                self._schedule(live, "decode", total)
            live.times.add_steps(first_row, first_row + count)
        self._interval_start = self._last_end
        self._last_reason = wait_reason

    # ---- finishing ---------------------------------------------------------------------------

    def _finish(self, request: Request, end: float) -> None:
        live = self.live.pop(request.request_id)
        record = live.record
        if live.kind is not None:
            self._close_run(live, live.run_end)
        elif live.preempted_at is not None:  # aborted while preempted
            record.preempted_s += end - live.preempted_at
        elif live.wait_snapshot is not None:  # aborted (or ignored) while waiting
            self._add_queue_time(live)
        record.finish_s = end
        record.status = request.status.name
        record.finish_reason = finish_reason(request.status)
        record.stop_reason = None if request.stop_reason is None else str(request.stop_reason)
        record.output_len = request.num_output_tokens
        record.num_preemptions = request.num_preemptions
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._settle_abort(record, end, was_running=live.kind is not None)
        self.finished.append(record)

    def _settle_abort(self, record: RequestRecord, end: float, was_running: bool) -> None:
        """An abort between step boundaries leaves a partial step unaccounted for: give it
        to what the request was waiting for (a running one: its next scheduled step, i.e.
        token budget), so the parts still sum to E2E."""
        remainder = (end - record.arrival_s) - sum(getattr(record, c) for c in PART_COLUMNS)
        if remainder:
            column = ("queue_token_budget_s" if was_running or self._last_reason is None
                      else QUEUE_COLUMNS[self._last_reason])
            _add(record, column, remainder)
