"""The real-time replay driver: a trace through `runtime.EngineCore` and the real model.

Two stages, as in a serving runtime:

    API server  a process (`backends.replay.api_process`, as vLLM's front end is to its engine
                core: no shared GIL) that releases each trace request at its arrival time on
                the wall clock and tokenizes it (one FIFO server: a burst queues here), then
                hands its token ids to the engine with the hand-over time.
    engine      the engine-core loop of `sim/simulator.py` on the wall clock: take in the
                handed-over requests, `begin_step`, execute on the model (step time measured:
                CUDA events / perf_counter), `end_step`. When idle it blocks on the API
                server's queue until the next hand-over (no spinning).

Tokens are the trace's deterministic ids (`workloads.prompt_token_ids`), so the prefix cache
sees the same sharing as in the simulator. With a tokenizer, the API server encodes the
prompt's text (decoded from those ids before the clock starts) for its real cost; the engine
still gets the trace's ids, so lengths and sharing match the trace exactly. Every request
runs with `ignore_eos` and `max_tokens` = its trace output length. Times are seconds from
the start of the replay.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.engine.model_runner import ModelRunner
from backends.heap import frozen_heap
from backends.replay.api_process import ApiServerFailed, ApiServerProcess, Done, HandOver, Tokenizer
from runtime import (
    CacheConfig,
    EngineCore,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from runtime.records import RunResult
from workloads import Trace

if TYPE_CHECKING:
    from backends.engine.setup import RealSetup

Progress = Callable[[int, int], None]  # (requests finished, requests in the trace)


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """Everything a replay depends on besides the trace, the engine configs and the runner.

    Attributes:
        scheduler, cache: the engine core's configuration (the cache's num_blocks is the
            runner's KV pool).
        vocab_size: trace token ids are drawn from [10, vocab_size).
        seed: seed of the trace's token ids.
        check_invariants: `Scheduler.check_invariants()` after every step (slow).
    """

    scheduler: SchedulerConfig
    cache: CacheConfig
    vocab_size: int
    seed: int = 0
    check_invariants: bool = False

    def __post_init__(self) -> None:
        if self.vocab_size <= 10:
            raise ValueError(f"vocab_size must be > 10, got {self.vocab_size}")

    @classmethod
    def of(cls, setup: RealSetup, check_invariants: bool = False) -> ReplayConfig:
        """A loaded real engine's configs, vocabulary size and seed."""
        return cls(setup.scheduler, setup.cache, setup.shape.vocab_size, setup.args.seed,
                   check_invariants)


ReplayResult = RunResult  # the records of one replay (the simulator's shape)


class _Replay:
    def __init__(self, trace: Trace, config: ReplayConfig, runner: ModelRunner,
                 tokenizer: Tokenizer | None, progress: Progress | None) -> None:
        self.trace = trace
        self.config = config
        self.runner = runner
        self.progress = progress
        self.core = EngineCore(Scheduler(config.scheduler, config.cache))
        self.api = ApiServerProcess(trace, config.vocab_size, config.seed, tokenizer)
        self.by_id = {req.request_id: req for req in trace}
        self.api_done = False
        self.done = 0
        self.started = time.perf_counter()

    def now(self) -> float:
        """Seconds since the replay started (wall clock)."""
        return time.perf_counter() - self.started

    def run(self) -> None:
        """Start the API server (its start-up is not timed), then the clock, then serve."""
        self.api.start()
        try:
            with frozen_heap():
                self.serve()
        finally:
            self.api.stop()

    def serve(self) -> None:
        """Start the clock and the API server's releases; step until every request is done."""
        self.started = time.perf_counter()
        self.api.begin(self.started)
        while not self.api_done or self.core.has_work():
            self.take_handovers(block=not self.core.has_work())
            if self.core.has_work():
                self.one_step()

    def take_handovers(self, block: bool) -> None:
        """Move every queued hand-over into the engine; when `block`, first wait for one."""
        while not self.api_done:
            message = self.api.get(block)
            if message is None:
                return
            block = False
            if isinstance(message, ApiServerFailed):
                raise RuntimeError(f"the replay's API server failed: {message.message}")
            if isinstance(message, Done):
                self.api_done = True
                return
            self.submit(message)

    def submit(self, handover: HandOver) -> None:
        req = self.by_id[handover.request_id]
        self.core.recorder.arrived(req.request_id, req.arrival_s, req.prompt_len,
                                   req.output_len)
        request = Request(
            req.request_id, array("q", handover.prompt_token_ids),
            SamplingParams(max_tokens=req.output_len, ignore_eos=True),
            arrival_time=req.arrival_s, priority=req.priority, cache_salt=req.cache_salt)
        self.core.submit(request, handover.handover_s)

    def one_step(self) -> None:
        core = self.core
        step = core.begin_step(self.now())
        if step is None:  # every new request was refused: nothing to run
            return
        result = self.runner.execute(step.output)
        finished = core.end_step(step, result.sampled, self.now(), result.duration_s)
        if self.config.check_invariants:
            core.scheduler.check_invariants()
        if finished and self.progress is not None:
            self.done += len(finished)
            self.progress(self.done, len(self.trace))

    def abort_all(self) -> None:
        """Ctrl-C: record every request the engine holds as aborted now."""
        self.api.stop()
        scheduler = self.core.scheduler
        unfinished = [r for r in scheduler.requests.values() if not r.is_finished()]
        scheduler.finish_requests([r.request_id for r in unfinished],
                                  RequestStatus.FINISHED_ABORTED)
        now = self.now()
        for request in unfinished:
            self.core.recorder.aborted(request, now)
        scheduler.release([r.request_id for r in unfinished])


def replay(trace: Trace, config: ReplayConfig, runner: ModelRunner,
           tokenizer: Tokenizer | None = None, progress: Progress | None = None
           ) -> ReplayResult:
    """Replay the trace in real time to completion (or Ctrl-C: records so far, unfinished
    requests aborted)."""
    run = _Replay(trace, config, runner, tokenizer, progress)
    interrupted = False
    try:
        run.run()
    except KeyboardInterrupt:
        interrupted = True
        run.abort_all()
    wall_s = run.now()
    recorder = run.core.recorder
    assert interrupted or not recorder.live, f"{len(recorder.live)} requests never finished"
    stats = run.core.scheduler.prefix_cache_stats
    order = {req.request_id: i for i, req in enumerate(trace)}
    return ReplayResult(
        requests=sorted(recorder.finished, key=lambda r: order[r.request_id]),
        step_columns=dict(recorder.step_columns),
        prefix_cache_queries=stats.queries,
        prefix_cache_hits=stats.hits,
        wall_s=wall_s,
        interrupted=interrupted,
    )
