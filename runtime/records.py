"""The result records both drivers write (the schema of `requests.parquet` / `steps.parquet`).

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
else the time the step began. `runtime.recorder.Recorder` does the accounting.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field, fields

from runtime.outputs import WaitReason

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


class StepTimes(Sequence[float]):
    """A request's token times as runs of steps of its recorder's `end_s` column (seconds):
    one token per step of each run, at that step's end. 16 bytes a run (a request decoding
    uninterrupted has one) instead of 8 per token. Read-only once the recorder is done;
    equal to any sequence of the same floats."""

    __slots__ = ("_ends", "_runs")

    def __init__(self, ends: Sequence[float]) -> None:
        self._ends = ends  # the recorder's end_s column: it grows, never changes
        self._runs = array("q")  # step indices, flattened [start, stop) pairs, increasing

    @classmethod
    def of_runs(cls, ends: Sequence[float], runs: array[int]) -> StepTimes:
        """The token times at rows `runs` (flattened [start, stop) pairs, increasing) of
        `ends` (a record sent between processes, `sim.record_columns`)."""
        times = cls(ends)
        times._runs = runs
        return times

    @property
    def ends(self) -> Sequence[float]:
        """The `end_s` column the runs index."""
        return self._ends

    @property
    def runs(self) -> array[int]:
        """Flattened [start, stop) pairs of rows of `ends`, increasing (do not change)."""
        return self._runs

    def add_steps(self, start: int, stop: int) -> None:
        """Steps start..stop-1 gave a token each (after every step added so far)."""
        runs = self._runs
        if runs and runs[-1] == start:
            runs[-1] = stop
        else:
            runs.extend((start, stop))

    def __len__(self) -> int:
        runs = self._runs
        return sum(runs[1::2]) - sum(runs[0::2])

    def __iter__(self) -> Iterator[float]:
        runs = self._runs
        for i in range(0, len(runs), 2):
            yield from self._ends[runs[i]:runs[i + 1]]

    # an int or a slice, as a list's; untyped: one signature cannot say the two results
    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return list(self)[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"StepTimes({list(self)!r})"


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
    # seconds, one per output token (the recorder's: `StepTimes`, spans of its steps)
    token_times_s: Sequence[float] = field(default_factory=list)
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
        """The record as a dict of its fields (what `dataclasses.asdict` gives, without its
        per-element deep copy: 8 of 25 s of `rt simulate` on 19 k requests); the token
        times are a copy."""
        row = {name: getattr(self, name) for name in REQUEST_FIELDS}
        row["token_times_s"] = list(self.token_times_s)
        return row


REQUEST_FIELDS = tuple(f.name for f in fields(RequestRecord))


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
    kv_usage: float  # at the end of the step (tokens appended, finished requests freed), 0..1
    num_running: int  # at the end of the step
    num_waiting: int  # at the end of the step
    num_preempted: int
    num_finished: int
    wait_reason: str | None

    def to_row(self) -> dict[str, object]:
        """The record as a dict of its (scalar) fields."""
        return {name: getattr(self, name) for name in STEP_FIELDS}


STEP_FIELDS = tuple(f.name for f in fields(StepRecord))
# The array typecode of each numeric step column ("q": int64, "d": float64); wait_reason
# (a string or None) stays a list. Typed columns hold 8 bytes a step instead of a boxed
# object (~30 bytes): 6 M steps of a 1 M-request run are 18 columns of them.
STEP_TYPECODES = {f.name: ("d" if f.type == "float" else "q") for f in fields(StepRecord)
                  if f.name != "wait_reason"}


def new_step_columns() -> dict[str, MutableSequence[object]]:
    """Empty step columns in StepRecord's field order: typed arrays, wait_reason a list."""
    # array('d') is a MutableSequence[float], not [object] (invariant): the columns hold one
    # type each, which the recorder appends and analysis reads by name
    return {name: array(STEP_TYPECODES[name]) if name in STEP_TYPECODES else []  # type: ignore[misc]
            for name in STEP_FIELDS}


def steps_from_columns(columns: Mapping[str, Sequence[object]]) -> list[StepRecord]:
    """StepRecords from step columns (one list per field, in field order)."""
    rows = zip(*(columns[name] for name in STEP_FIELDS), strict=True)
    return [StepRecord(*row) for row in rows]


@dataclass(slots=True)
class RunResult:
    """What one run of either driver produced: the records, the prefix-cache counters and
    the wall-clock seconds the run took. `step_columns` holds the steps column-wise
    (StepRecord's fields); `steps` builds the records one by one (slow on long runs).
    `interrupted`: a replay cut short by Ctrl-C (its unfinished requests are recorded as
    aborted, the requests not yet handed over are left out); never for a simulation."""

    requests: list[RequestRecord]
    step_columns: dict[str, Sequence[object]]
    prefix_cache_queries: int
    prefix_cache_hits: int
    wall_s: float
    interrupted: bool = False

    @property
    def num_steps(self) -> int:
        return len(self.step_columns["step"])

    @property
    def steps(self) -> list[StepRecord]:
        return steps_from_columns(self.step_columns)

    def summary(self) -> RunSummary:
        """The run's counts without its records (what the report needs once they are
        written)."""
        return RunSummary(self.num_steps, self.prefix_cache_queries, self.prefix_cache_hits,
                          self.wall_s, self.interrupted)


@dataclass(frozen=True, slots=True)
class RunSummary:
    """A `RunResult`'s counts and wall seconds, without the records."""

    num_steps: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    wall_s: float
    interrupted: bool = False


def ttft_by_request(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Each request's TTFT (first token - arrival, seconds) where it has a finite first
    token, by request id."""
    return {r.request_id: r.first_token_s - r.arrival_s for r in records
            if r.first_token_s is not None and math.isfinite(r.first_token_s)}
