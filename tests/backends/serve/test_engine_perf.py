"""The engine process's messages: its MFU estimates, each step's own, and vLLM's empty step
when the engine goes idle with finished requests (with the last step's message, or alone
after an abort); what the outputs carry for a stop string's finish. The loop runs on
stand-in sockets and a stub executor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from backends.engine.sampling_options import SamplingOptions
from backends.serve.engine_process import EngineLoop
from backends.serve.messages import EngineOutputs, EngineRequest, decode
from runtime import CacheConfig, SamplingParams, ScheduledStep, SchedulerConfig
from runtime.perf import BatchContext, PerfShape, StepPerf, batch_perf

TINY = PerfShape(128, 2, 4, 2, 32, 256, 512, 4, 4, 4)
EMPTY = batch_perf(TINY, BatchContext())  # the weights read once, nothing else


class OneTokenEach:
    """Every scheduled request gets token 100 (the prompts here fit one step)."""

    def register(self, req_id: str, sampling: SamplingOptions) -> None:
        pass

    def execute(self, step: ScheduledStep) -> tuple[Mapping[str, Sequence[int]], float]:
        return {req_id: [100] for req_id in step.output.num_scheduled_tokens}, 0.001


@dataclass
class Setup:
    executor: OneTokenEach = field(default_factory=OneTokenEach)
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(
        max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64))
    cache: CacheConfig = field(default_factory=lambda: CacheConfig(
        block_size=16, num_blocks=32, enable_prefix_caching=True))
    perf_shape: PerfShape = TINY


class Inbox:
    """Hands out `batches` of messages, one batch per poll; at a blocking poll with none
    left, stops the loop."""

    def __init__(self, batches: list[list[tuple[str, Any]]]) -> None:
        self.batches, self.ready, self.loop = batches, [], None  # type: ignore[var-annotated]

    def poll(self, timeout: int = 0) -> bool:
        if not self.ready and self.batches:
            self.ready = list(self.batches.pop(0))
        elif not self.ready and timeout:
            assert self.loop is not None
            self.loop.stopping = True
        return bool(self.ready)

    def recv(self, flags: int = 0) -> tuple[str, Any]:
        if not self.ready:
            raise zmq.Again()
        return self.ready.pop(0)


class Outbox:
    def __init__(self) -> None:
        self.sent: list[EngineOutputs] = []

    def send(self, data: bytes) -> None:
        self.sent.append(decode(data)[1])


def _run(batches: list[list[tuple[str, Any]]], estimate: bool = True) -> list[EngineOutputs]:
    inbox, outbox = Inbox(batches), Outbox()
    loop = EngineLoop(Setup(), inbox, outbox, estimate_perf=estimate)  # type: ignore[arg-type]
    inbox.loop = loop
    loop.receive = lambda block: _receive(loop, inbox, block)  # type: ignore[method-assign]
    loop.run()
    return outbox.sent


def _receive(loop: EngineLoop, inbox: Inbox, block: bool) -> None:
    """EngineLoop.receive on decoded messages (the stand-in inbox holds them decoded)."""
    if not inbox.poll(1000 if block else 0):
        return
    while inbox.ready:
        kind, payload = inbox.recv()
        getattr(loop, kind)(payload)


def _add(req_id: str, prompt_len: int, max_tokens: int) -> tuple[str, EngineRequest]:
    return ("add", EngineRequest(req_id, list(range(10, 10 + prompt_len)),
                                 SamplingParams(max_tokens, ignore_eos=True), SamplingOptions(),
                                 0.0))


def _step(*requests: tuple[int, int, bool]) -> StepPerf:
    ctx = BatchContext()
    for request in requests:
        ctx.add(*request)
    return batch_perf(TINY, ctx)


def test_the_last_step_carries_the_empty_steps_estimate() -> None:
    sent = _run([[_add("a", 8, 3)]])
    assert [m.stats.perf for m in sent] == [
        _step((8, 8, True)), _step((1, 9, False)), _step((1, 10, False)) + EMPTY]


def test_an_abort_that_empties_the_engine_counts_the_empty_step_once() -> None:
    """The request runs its prefill, then the abort arrives: the abort's message carries no
    estimate, the empty step comes alone, and idling on does not count it again."""
    sent = _run([[_add("a", 8, 50)], [("abort", ["a"])], [], []])
    assert [m.stats.perf for m in sent] == [_step((8, 8, True)), None, EMPTY]
    assert sent[1].outputs[0].finish_reason == "abort"


def test_a_request_waiting_at_the_last_step_means_no_empty_step() -> None:
    """b's add is queued when a's last step ends (the third poll hands it over): vLLM takes
    it in before stepping again, so its next schedule reports a finished, no empty step
    comes; the empty step counts once b's last step empties the engine."""
    sent = _run([[_add("a", 8, 3)], [], [], [_add("b", 8, 2)]])
    assert [m.stats.perf for m in sent] == [
        _step((8, 8, True)), _step((1, 9, False)), _step((1, 10, False)),
        _step((8, 8, True)), _step((1, 9, False)) + EMPTY]


def test_without_the_flag_no_estimate_is_sent() -> None:
    sent = _run([[_add("a", 8, 3)]], estimate=False)
    assert len(sent) == 3 and {m.stats.perf for m in sent} == {None}


def test_the_first_output_carries_the_queue_and_schedule_times() -> None:
    """The API server needs them when a stop string ends the request before the engine's
    last output (which carries every time)."""
    sent = _run([[_add("a", 8, 3)]], estimate=False)
    first, middle, last = (m.outputs[0] for m in sent)
    assert last.finish_reason == "length" and last.queued_s is not None
    assert (first.queued_s, first.scheduled_s) == (last.queued_s, last.scheduled_s)
    assert last.queued_s <= last.scheduled_s  # type: ignore[operator]
    assert (middle.queued_s, middle.scheduled_s) == (None, None)


def test_every_output_carries_the_preemptions_so_far() -> None:
    """A stop string can end a request on any output (the API server then reports the
    output's count). a and b (16-token prompts) share 4 usable blocks: the prefill step and
    16 decodes fill 2 blocks each (32 tokens), a's 17th decode needs a third, so b (the
    later) is preempted: its first 17 outputs say 0, the rest 1; a's all say 0."""
    inbox, outbox = Inbox([[_add("a", 16, 30), _add("b", 16, 30)]]), Outbox()
    setup = Setup(cache=CacheConfig(block_size=16, num_blocks=5, enable_prefix_caching=True))
    loop = EngineLoop(setup, inbox, outbox)  # type: ignore[arg-type]
    inbox.loop = loop
    loop.receive = lambda block: _receive(loop, inbox, block)  # type: ignore[method-assign]
    loop.run()
    counts: dict[str, list[int]] = {"a": [], "b": []}
    for message in outbox.sent:
        for out in message.outputs:
            counts[out.request_id].append(out.num_preemptions)
    assert set(counts["a"]) == {0} and len(counts["a"]) == 30
    assert counts["b"] == [0] * 17 + [1] * 13
