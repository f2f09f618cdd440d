"""The engine-core step loop, without a clock or a model: both drivers run it.

    while core.has_work():
        step = core.begin_step(now)            # take in new requests, schedule()
        sampled = <execute step.output>        # simulator: cost model; engine: the model
        core.end_step(step, sampled, end, duration_s)   # update_from_output(), records

Requests handed over by the API server wait in an input queue and enter the scheduler at
the next step boundary, as in vLLM's engine core.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

from runtime.batch import BatchFeatures, describe_batch
from runtime.decode_run import (
    decode_run_limit,
    plain_decode_wait_reason,
    run_decode_steps,
    steps_before_token_stop,
)
from runtime.outputs import SchedulerOutput, WaitReason
from runtime.recorder import Recorder
from runtime.request import Request
from runtime.scheduler import Scheduler
from runtime.steady import SteadyDecodes, Upcoming


class RunPlan(NamedTuple):
    """A run of plain decode steps `EngineCore.plan_run` worked out and did not run, for
    `EngineCore.run_plan` while the core stays as it was (`num_steps` steps recorded,
    nothing taken in)."""

    clock: float  # seconds
    horizon: float  # seconds: every step starts before it
    num_steps: int  # steps the recorder held when planned
    ends: list[float]  # step ends, seconds
    durations: list[float]  # step durations, seconds
    limit: int  # steps the run may take at most
    kv_tokens: int  # KV tokens its first step's decodes read
    finishes_last: bool  # steady decodes finish in the step at the limit
    reason: WaitReason | None  # the wait reason its steps report
    tokens: dict[str, Sequence[int]] | None  # next tokens by request (None: steady decodes)

    @property
    def end(self) -> float:
        """When the run ends (seconds)."""
        return self.ends[-1]

    def cut(self, horizon: float) -> RunPlan:
        """The plan's steps that start before `horizon` (at most its own horizon): the plan
        itself when every step does (it holds for any horizon from its last step's start
        to its own; a sleeping fleet replica's plan mostly ends at a finish)."""
        count = bisect_left(self.ends, horizon) + 1
        if count >= len(self.ends):
            return self
        return self._replace(horizon=horizon, ends=self.ends[:count],
                             durations=self.durations[:count])


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """One step between `begin_step` and `end_step`."""

    output: SchedulerOutput
    features: BatchFeatures
    kinds: dict[str, str]  # scheduled request id -> "prefill", "decode" or "preempted"
    start_s: float


class EngineCore:
    """Owns the scheduler and the recorder; the driver owns time and execution.

    With `upcoming` (a simulator, which knows every request's tokens in advance), running
    decodes are advanced implicitly (`runtime.steady`): a step's `output` then lists only
    the other requests, and its `features` count all of them. Records are the same.
    """

    def __init__(self, scheduler: Scheduler, recorder: Recorder | None = None,
                 upcoming: Upcoming | None = None) -> None:
        self.scheduler = scheduler
        self.recorder = recorder if recorder is not None else Recorder()
        self._inbox: list[Request] = []
        self.steady = (SteadyDecodes(scheduler, self.recorder, upcoming)
                       if upcoming is not None else None)

    def sync(self) -> None:
        """Materialise the steady decodes: every request's state as if stepped one by one
        (call before reading running requests from outside)."""
        if self.steady is not None:
            self.steady.leave_all()

    def submit(self, request: Request, now: float) -> None:
        """A tokenized request handed over by the API server at `now`."""
        self.recorder.queued(request.request_id, now)
        self._inbox.append(request)

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished_requests()

    def begin_step(self, now: float) -> ScheduledStep | None:
        """Take in the input queue, then `schedule()`. None when, after taking in, nothing
        is left to run (every new request was refused): an idle engine does not step."""
        scheduler = self.scheduler
        if self._inbox:  # most steps take in nothing
            self._take_in(now)
        if not scheduler.has_unfinished_requests():
            return None
        steady = self.steady
        output = steady.schedule() if steady is not None else None
        if output is None:
            self.sync()
            output = scheduler.schedule()
        requests = scheduler.requests
        admitted = [requests[new.req_id] for new in output.scheduled_new_reqs]
        preempted = [requests[req_id] for req_id in output.preempted_req_ids]
        self.recorder.step_started(now, admitted, preempted)
        features, kinds = describe_batch(output, requests)
        if steady is not None:
            features = steady.add_to_features(features)
        return ScheduledStep(output, features, kinds, now)

    def _take_in(self, now: float) -> None:
        """The input queue enters the scheduler; requests it can never serve are recorded
        as ignored and released."""
        scheduler = self.scheduler
        taken_in, self._inbox = self._inbox, []
        for request in taken_in:
            scheduler.add_request(request)
        self.recorder.take_in(now, taken_in)
        for request in taken_in:
            if request.is_finished():  # ignored: it can never be served
                self.recorder.ignored(request)
                scheduler.release([request.request_id])

    def end_step(self, step: ScheduledStep, sampled: Mapping[str, Sequence[int]],
                 end: float, duration_s: float) -> list[Request]:
        """`update_from_output()` with the sampled tokens; record the step. Returns the
        requests that finished (already recorded and released from the scheduler)."""
        scheduler = self.scheduler
        steady = self.steady
        finished = steady.finish_due() if steady is not None else []
        if finished:  # steady decodes run first: they finish (and free) first
            scheduler.finish_decoded(finished)
        finished += scheduler.update_from_output(step.output, sampled)
        output = step.output
        self.recorder.step_finished(
            end, duration_s, step.features, step.kinds,
            [req_id for req_id in sampled if req_id in output.num_scheduled_tokens],
            finished,
            (scheduler.kv_cache_manager.usage, len(scheduler.running), len(scheduler.waiting),
             len(output.preempted_req_ids), output.wait_reason),
        )
        if finished:
            scheduler.release([request.request_id for request in finished])
        if steady is not None:
            steady.join()
        return finished

    def run_plan(self, plan: RunPlan) -> float:
        """Run the plain decode steps `plan_run` planned (all of them, or those starting
        before a horizon: `RunPlan.cut`): records as if run one by one. With steady decodes
        the run may end with the step in which members finish (`_finishing_step`). Returns
        the end of the last step (seconds). ValueError unless the core is as planned (no
        step recorded, nothing taken in since); a scheduler change from outside (an abort)
        is the caller's to rule out."""
        if not self.plan_holds(plan, plan.clock):
            raise ValueError(f"a stale run plan (planned at step {plan.num_steps}, the core "
                             f"at {self.recorder.num_steps}, {len(self._inbox)} taken in)")
        scheduler = self.scheduler
        num_running = len(scheduler.running)
        ends = plan.ends
        if plan.tokens is None:  # steady decodes: no EOS or stop token can end them
            steady = self.steady
            assert steady is not None, "a plan without tokens is made only of steady decodes"
            free_after = steady.run(len(ends))
            explicit: list[str] = []
        else:
            free_after = run_decode_steps(scheduler, len(ends), plan.tokens)
            explicit = [r.request_id for r in scheduler.running]
        finishing = plan.finishes_last and len(ends) == plan.limit
        self._record_run(plan.clock, ends, plan.durations, free_after,
                         (num_running, plan.kv_tokens), explicit, plan.reason, finishing)
        if self.steady is not None:
            self.steady.join()
        return plan.end

    def plan_holds(self, plan: RunPlan, clock: float, horizon: float | None = None) -> bool:
        """Whether `plan` (cut at `horizon`, if given) is the run `plan_run` would plan now
        from `clock` (up to `horizon`): same clock, no step recorded and nothing taken in
        since, a horizon within its own."""
        return (plan.clock == clock and plan.num_steps == self.recorder.num_steps
                and not self._inbox
                and (horizon is None or clock < horizon <= plan.horizon))

    def plan_run(
        self,
        clock: float,
        horizon: float,
        step_time: Callable[[BatchFeatures, float], float],
        upcoming: Callable[[Request, int], Sequence[int]],
        run_times: Callable[[int, int, int], Sequence[float]] | None = None,
    ) -> RunPlan | None:
        """Plan a run of plain decode steps back to back from `clock`, each starting before
        `horizon` (the next hand-over), up to the first finish or the free blocks' limit;
        nothing is run (`run_plan` runs it). `step_time(features, start)` gives a step's
        duration, seconds, from its features and its start (seconds: the same float as when
        stepping one by one; called in step order, possibly for a few steps past the run's
        end that are then not run); `upcoming(request, n)` gives a request's next n sampled
        tokens. None when the next step is not plain.

        `run_times(num_seqs, decode_kv_tokens, count)`, when given, replaces `step_time`
        for durations that do not depend on the start: the durations of `count` decode
        steps of `num_seqs` sequences, step k reading `decode_kv_tokens + k * num_seqs` KV
        tokens (a cost model's bulk form of its step time; possibly asked for more steps
        than are run).
        """
        scheduler = self.scheduler
        if self._inbox or clock >= horizon:
            return None
        plain, reason = plain_decode_wait_reason(scheduler)  # the run's, finishes aside
        if not plain:
            return None
        steady = self.steady if self.steady is not None and len(self.steady) else None
        limit, kv_tokens, finishes_last = self._run_bounds(steady)
        if limit <= 0:
            return None
        running = scheduler.running
        if run_times is None:
            ends, durations = self._decode_times(clock, horizon, step_time, limit,
                                                 len(running), kv_tokens)
        else:
            ends, durations = _bulk_decode_times(clock, horizon, run_times, limit,
                                                 len(running), kv_tokens)
        tokens = None
        if steady is None:
            tokens = {r.request_id: upcoming(r, len(ends)) for r in running}
            num_steps = steps_before_token_stop(scheduler, tokens, len(ends))
            if num_steps == 0:
                return None
            del ends[num_steps:], durations[num_steps:]
        return RunPlan(clock, horizon, self.recorder.num_steps, ends, durations, limit,
                       kv_tokens, finishes_last, reason, tokens)

    def _record_run(self, clock: float, ends: list[float], durations: list[float],
                    free_after: list[int], batch: tuple[int, int], explicit: list[str],
                    reason: WaitReason | None, finishing: bool) -> None:
        """Record a run from `clock`: its plain decode steps in bulk, then, when steady
        decodes finish in its last step (`finishing`), that step. `batch`: (sequences,
        decode KV tokens of the first step)."""
        num_seqs, kv_tokens = batch
        decodes = len(ends) - 1 if finishing else len(ends)
        if decodes:
            usable = self.scheduler.cache_config.num_usable_blocks
            self.recorder.decode_steps(
                ends[:decodes], durations[:decodes], num_seqs, kv_tokens, explicit,
                [1.0 - free / usable for free in free_after[:decodes]],
                len(self.scheduler.waiting), reason)
        if finishing:
            start = ends[-2] if decodes else clock
            self._finishing_step(start, ends[-1], durations[-1], reason)

    def _finishing_step(self, start: float, end: float, duration_s: float,
                        reason: WaitReason | None) -> None:
        """Record the last step of a run, in which steady decodes finish (already advanced
        by `SteadyDecodes.run`), with the recorder and scheduler calls of `begin_step` and
        `end_step` for a step of steady decodes alone: the same records."""
        scheduler, recorder = self.scheduler, self.recorder
        assert self.steady is not None and len(self.steady) == len(scheduler.running)
        features = self.steady.add_to_features(BatchFeatures())  # as `begin_step`'s
        recorder.step_started(start, [], [])
        finished = self.steady.finish_due()
        scheduler.finish_decoded(finished)
        recorder.step_finished(
            end, duration_s, features, {}, [], finished,
            (scheduler.kv_cache_manager.usage, len(scheduler.running), len(scheduler.waiting),
             0, reason))
        scheduler.release([request.request_id for request in finished])

    def _run_bounds(self, steady: SteadyDecodes | None) -> tuple[int, int, bool]:
        """How many plain decode steps may run (0 unless every running request decodes; with
        steady decodes, only when every running request is one), the KV tokens the first
        of them reads, and whether steady decodes finish in the last of them."""
        if steady is not None:
            limit, finishes_last = steady.run_limit()
            return limit, steady.decode_kv_tokens(), finishes_last
        running = self.scheduler.running
        return (decode_run_limit(self.scheduler),
                sum(r.num_computed_tokens + 1 for r in running), False)

    @staticmethod
    def _decode_times(
        clock: float, horizon: float,
        step_time: Callable[[BatchFeatures, float], float], limit: int,
        num_running: int, kv_tokens: int,
    ) -> tuple[list[float], list[float]]:
        """End times and durations of up to `limit` decode steps from `clock`, each
        starting before `horizon`; ends are start + duration, as when stepping."""
        ends: list[float] = []
        durations: list[float] = []
        start = clock
        while len(ends) < limit and start < horizon:
            feats = BatchFeatures(num_decode_tokens=num_running, num_seqs=num_running,
                                  decode_kv_tokens=kv_tokens + len(ends) * num_running)
            duration = step_time(feats, start)
            start += duration
            ends.append(start)
            durations.append(duration)
        return ends, durations


_FIRST_CHUNK = 32  # decode steps timed at once by `run_times`; doubles while more are needed


def _bulk_decode_times(
    clock: float, horizon: float, run_times: Callable[[int, int, int], Sequence[float]],
    limit: int, num_running: int, kv_tokens: int,
) -> tuple[list[float], list[float]]:
    """`EngineCore._decode_times` with durations from `run_times`, in chunks: the same
    ends and durations."""
    ends: list[float] = []
    durations: list[float] = []
    start = clock
    chunk = _FIRST_CHUNK
    while len(ends) < limit and start < horizon:
        done = len(ends)
        batch = run_times(num_running, kv_tokens + done * num_running,
                          min(chunk, limit - done))
        # start + d0, (start + d0) + d1, ...: stepping's additions; durations are >= 0, so
        # the ends do not decrease and the run goes through the first one at the horizon
        batch_ends = list(accumulate(batch, initial=start))
        del batch_ends[0]
        stop = bisect_left(batch_ends, horizon) + 1
        ends += batch_ends[:stop]
        durations += batch[:stop]
        start = ends[-1]
        chunk *= 2
    return ends, durations
