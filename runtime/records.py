"""The result records both drivers write, and the accounting of where each request's time went.

Times are seconds on the driver's clock (simulated or wall), passed in by the driver.

A request's end-to-end latency, arrival to finish, is split into parts that sum to it exactly:

    api_server      arrival -> handed to the engine (API-server queueing + tokenization)
    step_boundary   handed over -> taken in by the engine core at the next step boundary
    queue_*         waiting for first admission, by the cause the scheduler reports for the
                    waiting queue's head each step (`WaitReason`): token_budget,
                    max_num_seqs, kv_capacity, preempted_step (admission skipped because the
                    step preempted). A running request left out of a step (the budget ran out
                    before its turn) also counts as token_budget.
    preempted       after a preemption: waiting to be readmitted, then recomputing
    prefill         executing steps before the first token
    decode          executing steps after the first token

Each engine step k covers the interval [t_k, e_k): e_k is when its tokens are delivered and t_k
is e_{k-1} if the engine was busy (so host overhead between steps belongs to the next step),
else the time the step began.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from runtime.batch import BatchFeatures
from runtime.outputs import WaitReason
from runtime.request import Request, RequestStatus, finish_reason

WAIT_REASONS = tuple(WaitReason)
QUEUE_COLUMNS = {
    WaitReason.TOKEN_BUDGET: "queue_token_budget_s",
    WaitReason.MAX_NUM_SEQS: "queue_max_num_seqs_s",
    WaitReason.KV_CAPACITY: "queue_kv_capacity_s",
    WaitReason.PREEMPTED_THIS_STEP: "queue_preempted_step_s",
}
PART_COLUMNS = (
    "api_server_s", "step_boundary_s", *QUEUE_COLUMNS.values(), "preempted_s", "prefill_s",
    "decode_s",
)


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline and attribution. Columns of `requests.parquet`."""

    request_id: str
    arrival_s: float
    prompt_len: int
    max_tokens: int
    queued_s: float | None = None  # handed to the engine (tokenized)
    engine_queued_s: float | None = None  # added to the scheduler (vLLM's QUEUED event)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    status: str = "WAITING"
    finish_reason: str | None = None
    stop_reason: str | None = None
    output_len: int = 0
    cached_tokens: int = 0
    num_preemptions: int = 0
    token_times_s: list[float] = field(default_factory=list)
    api_server_s: float = 0.0
    step_boundary_s: float = 0.0
    queue_token_budget_s: float = 0.0
    queue_max_num_seqs_s: float = 0.0
    queue_kv_capacity_s: float = 0.0
    queue_preempted_step_s: float = 0.0
    preempted_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def to_row(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step. Columns of `steps.parquet`; the features are `BatchFeatures`."""

    step: int
    start_s: float  # when the step began (schedule() was called)
    end_s: float  # when its tokens were delivered
    duration_s: float  # execution time (cost model or measured), end_s - start_s in the sim
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_prefill_seqs: int
    prefill_attention_pairs: int
    prefill_kv_tokens: int
    decode_kv_tokens: int
    context_tokens: int  # Σ (c_i + q_i): KV tokens attention reads this step
    kv_usage: float  # after scheduling, 0..1
    num_running: int  # after scheduling
    num_waiting: int  # after scheduling
    num_preempted: int
    num_finished: int
    wait_reason: str | None

    def to_row(self) -> dict[str, object]:
        return asdict(self)


@dataclass(slots=True)
class _Live:
    """Accounting state of a request while the engine holds it."""

    record: RequestRecord
    wait_snapshot: list[float] | None = None  # queue counters when it started waiting
    preempted_at: float | None = None  # interval start of the step that preempted it
    running_since: float | None = None  # interval start of its admission step
    scheduled_time: float = 0.0  # Σ intervals of steps it was scheduled in, since admission
    category: str | None = None  # its category in the current step, if scheduled


class Recorder:
    """Builds request and step records from the engine loop's events.

    Per step, the engine loop calls `step_started` (requests taken in, admitted, preempted),
    then `step_finished` (each scheduled request's category, the requests that got a token,
    the ones that finished). Work is O(1) per request event plus O(scheduled requests) per
    step: waiting requests are never visited; their queue time comes from cumulative
    per-cause counters read when they start and stop waiting.
    """

    def __init__(self) -> None:
        self.live: dict[str, _Live] = {}
        self.finished: list[RequestRecord] = []
        self.steps: list[StepRecord] = []
        self._queue_totals = [0.0] * len(WAIT_REASONS)  # Σ step intervals per head reason
        self._interval_start = 0.0
        self._last_end: float | None = None  # e_{k-1} while the engine stays busy
        self._last_reason: WaitReason | None = None
        # Requests taken in after their step's interval began (host gap between steps):
        # the part of the interval before they were handed over is not theirs.
        self._credits: list[tuple[_Live, float]] = []

    # ---- request events --------------------------------------------------------------------

    def arrived(self, request_id: str, arrival_s: float, prompt_len: int,
                max_tokens: int) -> None:
        self.live[request_id] = _Live(RequestRecord(request_id, arrival_s, prompt_len,
                                                    max_tokens))

    def queued(self, request_id: str, now: float) -> None:
        """Handed from the API server to the engine's input queue."""
        record = self.live[request_id].record
        record.queued_s = now
        record.api_server_s = now - record.arrival_s

    # ---- step events -----------------------------------------------------------------------

    def step_started(self, now: float, taken_in: list[Request], admitted: list[Request],
                     preempted: list[Request]) -> float:
        """Open step k, begun at `now`; returns its interval start t_k."""
        t = self._last_end if self._last_end is not None else now
        self._interval_start = t
        for request in taken_in:
            self._take_in(self.live[request.request_id], t)
        for request in preempted:
            live = self.live[request.request_id]
            self._stop_running(live, t)
            live.preempted_at = t
        for request in admitted:
            self._admit(self.live[request.request_id], request, t)
        return t

    def _take_in(self, live: _Live, t: float) -> None:
        record = live.record
        queued = record.queued_s if record.queued_s is not None else t
        entry = max(t, queued)
        record.engine_queued_s = entry
        record.step_boundary_s = entry - queued
        live.wait_snapshot = list(self._queue_totals)
        if entry > t:
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
        live.running_since = t
        live.scheduled_time = 0.0

    def _add_queue_time(self, live: _Live) -> None:
        assert live.wait_snapshot is not None
        record = live.record
        for reason, total, before in zip(WAIT_REASONS, self._queue_totals, live.wait_snapshot,
                                         strict=True):
            if total != before:
                column = QUEUE_COLUMNS[reason]
                setattr(record, column, getattr(record, column) + total - before)
        live.wait_snapshot = None

    def _stop_running(self, live: _Live, end: float) -> None:
        """Close a running interval: unscheduled running time counts as token budget."""
        assert live.running_since is not None, live.record.request_id
        unscheduled = (end - live.running_since) - live.scheduled_time
        if unscheduled > 1e-12:  # below that it is float rounding of equal sums
            live.record.queue_token_budget_s += unscheduled
        live.running_since = None

    def step_finished(
        self,
        end: float,
        duration_s: float,
        features: BatchFeatures,
        categories: dict[str, str],
        token_owners: list[str],
        finished: list[Request],
        stats: tuple[float, int, int, int, WaitReason | None],
    ) -> None:
        """Close step k at `end`.

        Args:
            duration_s: its execution time (the cost model's, or measured).
            categories: scheduled request id -> "prefill", "decode" or "preempted".
            token_owners: requests that received a token this step.
            finished: requests that finished this step.
            stats: (kv_usage, num_running, num_waiting, num_preempted, wait_reason), all
                as of after scheduling.
        """
        t = self._interval_start
        span = end - t
        for req_id, category in categories.items():
            live = self.live[req_id]
            live.scheduled_time += span
            live.category = category
            column = category + "_s"
            setattr(live.record, column, getattr(live.record, column) + span)
        for req_id in token_owners:
            record = self.live[req_id].record
            if record.first_token_s is None:
                record.first_token_s = end
            record.token_times_s.append(end)
        kv_usage, num_running, num_waiting, num_preempted, wait_reason = stats
        if wait_reason is not None:
            self._queue_totals[WAIT_REASONS.index(wait_reason)] += span
        self._settle_credits(wait_reason)
        for live in (self.live[req_id] for req_id in categories):
            live.category = None
        for request in finished:
            self._finish(request, end)
        self._last_end = end if (num_running or num_waiting) else None
        self._last_reason = wait_reason
        self.steps.append(StepRecord(
            step=len(self.steps), start_s=t, end_s=end, duration_s=duration_s,
            num_prefill_tokens=features.num_prefill_tokens,
            num_decode_tokens=features.num_decode_tokens,
            num_seqs=features.num_seqs, num_prefill_seqs=features.num_prefill_seqs,
            prefill_attention_pairs=features.prefill_attention_pairs,
            prefill_kv_tokens=features.prefill_kv_tokens,
            decode_kv_tokens=features.decode_kv_tokens,
            context_tokens=features.kv_tokens_read, kv_usage=kv_usage,
            num_running=num_running, num_waiting=num_waiting, num_preempted=num_preempted,
            num_finished=len(finished),
            wait_reason=wait_reason.value if wait_reason is not None else None,
        ))

    def _settle_credits(self, wait_reason: WaitReason | None) -> None:
        """Take the pre-hand-over part of this step's interval back from where it went."""
        for live, credit in self._credits:
            record = live.record
            if live.category is not None:
                column = live.category + "_s"
                live.scheduled_time -= credit
                live.running_since = (live.running_since or 0.0) + credit
            elif live.wait_snapshot is not None and wait_reason is not None:
                column = QUEUE_COLUMNS[wait_reason]
            else:
                continue
            setattr(record, column, getattr(record, column) - credit)
        self._credits.clear()

    def _finish(self, request: Request, end: float) -> None:
        live = self.live.pop(request.request_id)
        record = live.record
        if live.running_since is not None:
            self._stop_running(live, end)
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
        # An abort between step boundaries leaves a partial step unaccounted for: give it
        # to the cause the request was waiting for (exact sums, whatever the driver does).
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._settle_abort(record, end)
        self.finished.append(record)

    def _settle_abort(self, record: RequestRecord, end: float) -> None:
        remainder = (end - record.arrival_s) - sum(getattr(record, c) for c in PART_COLUMNS)
        if remainder:
            column = (QUEUE_COLUMNS[self._last_reason] if self._last_reason is not None
                      else "queue_token_budget_s")
            setattr(record, column, getattr(record, column) + remainder)

    def ignored(self, request: Request) -> None:
        """A request the scheduler refused when it was taken in: it finishes on entry."""
        entry = self.live[request.request_id].record.engine_queued_s
        assert entry is not None, request.request_id
        self._finish(request, entry)

    def aborted(self, request: Request, now: float) -> None:
        """A request aborted between steps (`Scheduler.finish_requests`)."""
        self._finish(request, now)
