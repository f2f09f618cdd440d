"""The API process's per-request work made cheaper (docs/serve.md, "Admission at 200
streams"), each against what it replaced: the histogram observations by bisection
(`metrics.observe_one`) against prometheus-client's `observe`, the engine request's wire
form against its fields, and `EngineClient`'s direct sends keeping the messages' order."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest
import zmq
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from backends.engine.sampling_options import SamplingOptions
from backends.serve import metrics as metrics_module
from backends.serve.engine_client import EngineClient, OutputQueue
from backends.serve.messages import EngineRequest, RequestOutput, decode, encode
from backends.serve.metrics import ServeMetrics, observe_one
from runtime import SamplingParams


def _samples(registry: CollectorRegistry) -> list[bytes]:
    return [line for line in generate_latest(registry).splitlines() if b"_created" not in line]


VALUES = [0.0, -0.0, -1.0, 0.001, 0.01, 0.0100000001, 0.5, 1.0, 7.5, 80.0, 1e9, math.inf,
          -math.inf, math.nan, 2.5e-3, 0.1 + 0.2, 3, 16, 17, 0]


def test_observe_one_equals_observe() -> None:
    one, fast = CollectorRegistry(), CollectorRegistry()
    bounds = (0.001, 0.01, 0.1, 0.3, 1.0, 7.5, 80.0)
    h1 = Histogram("h", "x", ["m"], buckets=bounds, registry=one).labels("a")
    h2 = Histogram("h", "x", ["m"], buckets=bounds, registry=fast).labels("a")
    for value in VALUES:
        h1.observe(value)
        observe_one(h2, value)
    assert _samples(one) == _samples(fast)
    # cumulative: 0, -0, -1, 1e-3, -inf, 0 (<= 1e-3), then 0.01 and 2.5e-3
    assert b'h_bucket{le="0.01",m="a"} 8.0' in _samples(fast)


def _drive(m: ServeMetrics) -> None:
    for i, value in enumerate(VALUES):
        phase = None if i % 5 == 0 else abs(value) / 3
        m.on_first_output(256 + i, i % 3 * 16, abs(value))
        m.on_iteration(i * 37)
        m.on_finished("length" if i % 2 else "stop", prompt_len=256 + i, output_len=i % 4,
                      max_tokens=128, cached=i % 3 * 16, e2e_s=value, queue_s=phase,
                      prefill_s=phase, decode_s=None if i % 7 == 0 else value,
                      inference_s=phase, num_preemptions=i % 3)
        m.on_parent_finished(1 + i % 3, i % 4)


def test_serve_metrics_export_what_observe_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = ServeMetrics("m", 4096, 1000, 16, True)
    _drive(fast)
    monkeypatch.setattr(metrics_module, "observe_one", lambda h, v: h.observe(v))
    reference = ServeMetrics("m", 4096, 1000, 16, True)
    _drive(reference)
    assert _samples(fast.registry) == _samples(reference.registry)


def test_engine_requests_survive_the_wire_with_every_field() -> None:
    """`EngineRequest.__reduce__` lists its options' fields by hand: a field added to either
    must be added there too (this test then fails until it is)."""
    assert [f.name for f in dataclasses.fields(SamplingParams)] == \
        ["max_tokens", "min_tokens", "ignore_eos", "eos_token_id", "stop_token_ids"]
    assert [f.name for f in dataclasses.fields(SamplingOptions)] == \
        ["temperature", "top_p", "top_k", "seed", "min_tokens", "stop_token_ids",
         "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"]
    assert [f.name for f in dataclasses.fields(EngineRequest)] == \
        ["request_id", "prompt_token_ids", "params", "sampling", "arrival_s", "priority",
         "cache_salt"]
    for req in [EngineRequest("r" * 32, [5, 6, 7], SamplingParams(9, 2, True, 3, (4, 8)),
                              SamplingOptions(0.7, 0.9, 40, -(2 ** 63), 2, (4, 8, 3), 0.5,
                                              -1.5, 1.2, ((7, -100.0), (3, 2.5))), 12.5,
                              -(2 ** 63), "tenant-a"),
                EngineRequest("q", [1], SamplingParams(1), SamplingOptions(), 0.0)]:
        kind, back = decode(encode(("add", req)))
        assert kind == "add" and back == req
        assert type(back.params) is SamplingParams and type(back.sampling) is SamplingOptions


class _Socket:
    """A stand-in for the engine input's blocking-API view: takes messages or says Again."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.full = False

    def send(self, data: bytes, flags: int = 0) -> None:
        assert flags == zmq.NOBLOCK
        if self.full:
            raise zmq.Again()
        self.sent.append(data)


def test_direct_sends_keep_the_order_of_queued_ones() -> None:
    async def scenario() -> tuple[list[bytes], list[Any]]:
        client = EngineClient()
        direct, queued = _Socket(), []

        async def to_engine(data: bytes) -> None:
            queued.append(data)

        try:
            client._direct = direct  # type: ignore[assignment]
            client.input.send = to_engine  # type: ignore[method-assign]
            client._post(b"a")  # sent at once
            direct.full = True
            client._post(b"b")  # would block: queued
            direct.full = False
            client._post(b"c")  # the socket would take it, but "b" waits: queued behind it
            assert direct.sent == [b"a"] and client.outgoing.qsize() == 2
            sender = asyncio.create_task(client._send())
            while client.outgoing.qsize() or client._sending:
                await asyncio.sleep(0)
            client._post(b"d")  # nothing waits any more: sent at once
            sender.cancel()
            return direct.sent, queued
        finally:
            client.input.close(linger=0)
            client.output.close(linger=0)
            client.context.term()
            client.tmpdir.cleanup()

    sent, queued = asyncio.run(scenario())
    assert sent == [b"a", b"d"] and queued == [b"b", b"c"]


def test_a_steps_first_outputs_wake_their_streams_first() -> None:
    """`EngineClient.deliver`: streams wake in the order their queues are fed; a request's
    first output goes before the decoding streams' (in the engine's order otherwise)."""
    async def scenario() -> list[str]:
        client = EngineClient()
        woken: list[str] = []
        try:
            for rid in "abcde":
                client.streams[rid] = OutputQueue()
            for rid in "ab":  # decoding: an output delivered (and taken) before
                client.streams[rid].put_nowait(RequestOutput(rid, [1]))
                client.streams[rid].get_nowait()
            for rid, queue in client.streams.items():
                queue.wait().add_done_callback(lambda _, rid=rid: woken.append(rid))
            # the engine's order: running (a, b, e's none), then the new requests c, d
            client.deliver([RequestOutput(r, [2]) for r in ("a", "x", "b", "c", "d")])
            await asyncio.sleep(0)
            return woken
        finally:
            client.input.close(linger=0)
            client.output.close(linger=0)
            client.context.term()
            client.tmpdir.cleanup()

    assert asyncio.run(scenario()) == ["c", "d", "a", "b"]
