"""The engine-core process of `rt serve`: the scheduler, the KV cache and an executor.

    API server  --PUSH ipc://.../in-->   engine core   (("add", EngineRequest), ("abort", ids),
                <--PULL ipc://.../out--                ("shutdown", None); pickled tuples)
                                                       (("ready", EngineInfo), ("failed", text),
                                                        ("outputs", EngineOutputs))

The messages are in `backends.serve.messages`. The loop is `runtime.EngineCore`'s, as in
`rt replay` and `rt simulate`: take in the handed-over requests at a step boundary,
`schedule()`, execute, `update_from_output()`, send every request's new tokens in one message
per step. When idle it blocks on its input socket. Aborts (a client gone) finish the request
at once (`Scheduler.finish_requests(FINISHED_ABORTED)`), which frees its KV blocks, and a
stats message reports the new usage.

The executor is injected as a picklable factory (a module-level function and its keyword
arguments), called in this process: `executor.build_real_executor` (the model, `backends`)
or the simulator's wall-clock executor (`sim.live_executor`, injected by `cli.py`). Whatever
it returns needs the attributes of `executor.ExecutorSetup`. Timestamps are
`time.monotonic()` seconds, a clock every process of the machine shares.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from backends.serve.engine_perf import PerfEstimate
from backends.serve.executor import Executor, ExecutorFactory
from backends.serve.messages import (
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    RequestOutput,
    SchedulerStats,
    decode,
    encode,
)
from runtime import EngineCore, Request, RequestStatus, Scheduler, finish_reason
from runtime.perf import PerfShape, StepPerf

_TRIM_EVERY_STEPS = 2048  # drop the recorder's step records this often (a server runs for days)


# ---- the loop --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Live:
    request: Request
    sent: int = 0  # output tokens already sent
    queued_s: float = 0.0
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None


class EngineLoop:
    """The engine core's loop over its two sockets. With `estimate_perf` (rt serve
    --enable-mfu-metrics) each step's stats carry vLLM's FLOPs/bytes estimate per GPU."""

    def __init__(self, setup: Any, inbox: zmq.Socket[bytes],
                 outbox: zmq.Socket[bytes],
                 parent_pid: int | None = None, estimate_perf: bool = False) -> None:
        self.executor: Executor = setup.executor
        shape: PerfShape | None = getattr(setup, "perf_shape", None)
        self.perf = PerfEstimate(shape) if estimate_perf and shape is not None else None
        self.core = EngineCore(Scheduler(setup.scheduler, setup.cache))
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.live: dict[str, _Live] = {}
        self.submitted: list[str] = []  # since the last step
        self.pending_aborts: set[str] = set()  # aborted before the scheduler took them in
        self.stopping = False
        self.busy = False  # had work since the end of the last step
        self.last_end = 0.0
        self.steps = 0

    def run(self) -> None:
        while not self.stopping:
            has_work = self.core.has_work()
            if not has_work:
                self.busy = False  # idle: the next step starts when its request arrives
                self._idle_step()
            self.receive(block=not has_work)
            if self.core.has_work():
                self.step()
            else:
                self.busy = False

    # ---- input ---------------------------------------------------------------------------

    def receive(self, block: bool) -> None:
        """Take every queued message; when `block`, wait (up to 1 s) for the first."""
        if block and not self.inbox.poll(1000):
            self._check_parent()
            self.busy = False
            return
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, payload = decode(data)
            if kind == "add":
                self.add(payload)
            elif kind == "abort":
                self.abort(payload)
            elif kind == "shutdown":
                self.stopping = True
                return

    def _check_parent(self) -> None:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            self.stopping = True  # the API server is gone

    def add(self, req: EngineRequest) -> None:
        now = time.monotonic()
        request = Request(req.request_id, req.prompt_token_ids, req.params,
                          arrival_time=req.arrival_s, priority=req.priority,
                          cache_salt=req.cache_salt)
        self.executor.register(req.request_id, req.sampling)
        self.core.recorder.arrived(req.request_id, req.arrival_s, len(req.prompt_token_ids),
                                   req.params.max_tokens)
        self.core.submit(request, now)
        self.live[req.request_id] = _Live(request, queued_s=now)
        self.submitted.append(req.request_id)

    def abort(self, request_ids: list[str]) -> None:
        """Finish the requests now (their blocks are freed) and report the new usage."""
        outputs = []
        scheduler = self.core.scheduler
        for req_id in request_ids:
            live = self.live.get(req_id)
            if live is None:
                continue
            if req_id not in scheduler.requests:  # still in the core's input queue
                self.pending_aborts.add(req_id)
                continue
            outputs.append(self._abort_one(live))
        if outputs:
            self.send(outputs, time.monotonic(), 0)

    def _abort_one(self, live: _Live) -> RequestOutput:
        request = live.request
        scheduler = self.core.scheduler
        scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        if request.status == RequestStatus.FINISHED_ABORTED:
            self.core.recorder.aborted(request, time.monotonic())
        scheduler.release([request.request_id])
        return self._final(live)

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> None:
        """One engine step. It starts where the last one ended while the engine stayed busy
        (as in the simulator), so a wall-clock executor can absorb the loop's overhead."""
        core = self.core
        start = self.last_end if self.busy else time.monotonic()
        submitted, self.submitted = self.submitted, []
        step = core.begin_step(start)
        outputs = self._refused(submitted)
        if step is None:
            self.busy = False
            if outputs:
                self.send(outputs, time.monotonic(), 0)
            return
        now = time.monotonic()
        for new in step.output.scheduled_new_reqs:
            live = self.live.get(new.req_id)
            if live is not None and live.scheduled_s is None:
                live.scheduled_s = now
        # before the step runs: a wall-clock simulated step absorbs the estimate's CPU time
        perf = None if self.perf is None else self.perf.step(step.output)
        sampled, duration = self.executor.execute(step)
        end = time.monotonic()
        finished = core.end_step(step, sampled, end, duration)
        self.busy, self.last_end = True, end
        outputs.extend(self._step_outputs(sampled, finished, end))
        if self.pending_aborts:
            outputs.extend(self._abort_pending())
        if perf is not None and self.perf is not None and not core.has_work() \
                and not self.inbox.poll(0):
            perf = self.perf.with_idle(perf)  # in the same message: no scrape between
        self.send(outputs, end, len(step.output.preempted_req_ids), perf)
        self._trim()

    def _idle_step(self) -> None:
        """The empty step's estimate (`engine_perf`), when the engine went idle without a
        step (an abort) or a message waiting at its last step brought no work. None while a
        message waits: vLLM takes it in first, and its next schedule reports the finished."""
        if self.perf is not None and not self.perf.idle_counted \
                and self.core.scheduler.finished_req_ids and not self.inbox.poll(0):
            self.send([], time.monotonic(), 0, self.perf.idle())

    def _refused(self, submitted: list[str]) -> list[RequestOutput]:
        """Requests the scheduler finished on entry (FINISHED_IGNORED)."""
        outputs = []
        for req_id in submitted:
            live = self.live.get(req_id)
            if live is not None and live.request.is_finished():
                outputs.append(self._final(live))
        return outputs

    def _step_outputs(self, sampled: Mapping[str, Sequence[int]], finished: list[Request],
                      now: float) -> list[RequestOutput]:
        outputs = []
        done = {request.request_id for request in finished}
        for req_id in sampled:
            live = self.live.get(req_id)
            if live is None:
                continue
            first = live.first_token_s is None
            if first:
                live.first_token_s = now
            live.last_token_s = now
            if req_id in done:
                outputs.append(self._final(live))
                continue
            # Every output carries the prefix-cache hit (vLLM's EngineCoreOutput
            # .num_cached_tokens; the API server counts it at the first one) and the
            # preemptions so far; the first, its queue and schedule times: what a stop
            # string's finish in the API server reports
            request = live.request
            outputs.append(RequestOutput(
                req_id, self._new_tokens(live), num_cached_tokens=request.num_cached_tokens or 0,
                num_preemptions=request.num_preemptions,
                queued_s=live.queued_s if first else None,
                scheduled_s=live.scheduled_s if first else None))
        return outputs

    def _abort_pending(self) -> list[RequestOutput]:
        outputs = []
        for req_id in list(self.pending_aborts):
            live = self.live.get(req_id)
            if live is not None:
                outputs.append(self._abort_one(live))
        self.pending_aborts.clear()
        return outputs

    @staticmethod
    def _new_tokens(live: _Live) -> list[int]:
        request = live.request
        start = request.num_prompt_tokens + live.sent
        tokens = request.token_ids(start, request.num_tokens).tolist()
        live.sent += len(tokens)
        return tokens

    def _final(self, live: _Live) -> RequestOutput:
        """The request's last output; it leaves the loop."""
        request = live.request
        del self.live[request.request_id]
        self.pending_aborts.discard(request.request_id)
        return RequestOutput(
            request.request_id, self._new_tokens(live), finish_reason(request.status),
            request.stop_reason, request.num_cached_tokens or 0, request.num_preemptions,
            live.queued_s, live.scheduled_s, live.first_token_s, live.last_token_s)

    def send(self, outputs: list[RequestOutput], now: float, num_preemptions: int,
             perf: StepPerf | None = None) -> None:
        scheduler = self.core.scheduler
        prefix = scheduler.prefix_cache_stats
        stats = SchedulerStats(len(scheduler.running), len(scheduler.waiting),
                               scheduler.kv_cache_manager.usage, prefix.queries, prefix.hits,
                               num_preemptions, perf)
        self.outbox.send(encode(("outputs", EngineOutputs(now, outputs, stats))))

    def _trim(self) -> None:
        """Forget old records: the server keeps no run directory. Finished requests' records
        (each with its token times) go at every step: kept for 2048 steps, ~2,000 of them at
        100 requests/s held several MiB that `rt bench serve --soak` read as growth.
        Clearing the step columns (`Recorder.forget_steps`) leaves live requests' token-time
        spans (`StepTimes`) and steady-decode step indices pointing at cleared rows: the
        server never reads them (it keeps no records), so the trim must stay here and never
        reach a run directory."""
        self.steps += 1
        recorder = self.core.recorder
        recorder.finished.clear()
        if self.steps % _TRIM_EVERY_STEPS == 0:
            recorder.forget_steps()


def run_engine_process(factory: ExecutorFactory, factory_kwargs: dict[str, Any],
                       input_address: str, output_address: str, parent_pid: int,
                       estimate_perf: bool = False) -> None:
    """The engine process's entry point: build the executor, say "ready", loop until told
    to shut down (or the parent is gone). Ctrl-C and SIGTERM are the API server's to handle:
    a supervisor that signals the whole process group (systemd's default KillMode, `timeout`,
    a terminal's Ctrl-C) must not stop the engine under the streams the server is draining;
    the server stops it when done (`EngineClient.shutdown`, SIGKILL if it does not stop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(output_address)
    try:
        setup = factory(**factory_kwargs)
        info = EngineInfo(setup.scheduler, setup.cache, setup.vocab_size,
                          tuple(setup.eos_token_ids), os.getpid(), dict(setup.description))
    except Exception as err:  # noqa: BLE001 - reported to the API server, which exits
        outbox.send(encode(("failed", f"{type(err).__name__}: {err}")))
        inbox.close(linger=0)  # term() waits for every socket: an open inbox hung it forever
        outbox.close(linger=1000)
        context.term()
        raise SystemExit(1) from None
    gc.collect()
    gc.freeze()  # the startup heap (torch, the model) stays out of every later collection
    outbox.send(encode(("ready", info)))
    try:
        EngineLoop(setup, inbox, outbox, parent_pid, estimate_perf).run()
    finally:
        inbox.close(linger=0)
        outbox.close(linger=200)
        context.term()
